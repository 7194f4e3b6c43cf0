#!/usr/bin/env bash
# Set up and run the whole test suite (unit tests + end-to-end on the real default pair). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
