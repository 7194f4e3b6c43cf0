#!/usr/bin/env bash
# Set up and run the whole test suite (unit tests, end-to-end on the real default pair, a real tritonserver).
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_triton.sh >/dev/null  # .venv-triton: the real tritonserver for tests/e2e/test_triton.py
bash scripts/setup_vllm.sh >/dev/null  # .venv-vllm: vLLM 0.32 (CPU) + the plugin, for tests/vllm
# Test folders live in a scratch basetemp removed on exit (exports of the real pair are hundreds of MB each): a run
# never leaves gigabytes behind in /tmp/pytest-of-$USER for the next one. Peak disk: docs/what-was-run.md.
BASETEMP=$(mktemp -d "${TMPDIR:-/tmp}/sharpdraft-tests.XXXXXX")
trap 'rm -rf "$BASETEMP"' EXIT
echo "disk free before the tests: $(df -h --output=avail "$BASETEMP" | tail -1 | tr -d ' ')"
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider --basetemp "$BASETEMP" "$@" || status=$?
# the vLLM plugin's unit tests import vLLM, so they run in .venv-vllm (tests/vllm's engine tests drive it from .venv)
if [ $# -eq 0 ]; then
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider --basetemp "$BASETEMP/vllm" tests/vllm/test_plugin.py || status=$?
fi
exit $status
