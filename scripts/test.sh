#!/usr/bin/env bash
# Set up and run the whole test suite (unit tests, end-to-end on the real default pair, a real tritonserver).
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_triton.sh >/dev/null  # .venv-triton: the real tritonserver for tests/e2e/test_triton.py
# Test folders live in a scratch basetemp removed on exit (exports of the real pair are hundreds of MB each): a run
# never leaves gigabytes behind in /tmp/pytest-of-$USER for the next one. Peak disk: docs/what-was-run.md.
BASETEMP=$(mktemp -d "${TMPDIR:-/tmp}/sharpdraft-tests.XXXXXX")
trap 'rm -rf "$BASETEMP"' EXIT
echo "disk free before the tests: $(df -h --output=avail "$BASETEMP" | tail -1 | tr -d ' ')"
.venv/bin/python -m pytest -q -p no:cacheprovider --basetemp "$BASETEMP" "$@"
