#!/usr/bin/env bash
# The main job on the embedded default pair: set up, export drafter + target to engines/, then generate from a
# real prompt through the exported engines (speculative and target-only side by side, lossless check).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/sharpdraft-export --drafter dflash --out engines/  # the exporters' own output: engines/export.log
.venv/bin/python -m runtime.generate --engine engines/ "$@"
