#!/usr/bin/env bash
# Set up and run the whole test suite (unit tests, end-to-end on the real default pair, a real tritonserver).
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_triton.sh >/dev/null  # .venv-triton: the real tritonserver for tests/e2e/test_triton.py
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
