#!/usr/bin/env bash
# Build .venv-triton: the nvidia-pytriton wheel's real tritonserver (CPU), its Python backend, tritonclient, and what
# runtime/triton_backend.py imports (onnxruntime, onnx, transformers, tokenizers). pytriton pins numpy<2, so it gets
# its own venv. Also lays out a backend directory (.venv-triton/triton-backends/python) with the backend stub built
# for this Python version. Idempotent; prints the tritonserver path at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
if [ -x .venv/bin/python ]; then PY=$(.venv/bin/python -c "import sys; print(sys._base_executable)"); fi
if [ ! -x .venv-triton/bin/python ]; then "$PY" -m venv .venv-triton; fi
.venv-triton/bin/pip install -q --disable-pip-version-check -r scripts/requirements-triton.txt 2>&1 | grep -v "is ignored" || true
.venv-triton/bin/python - <<'PYEOF'
import pathlib, shutil, sys
import pytriton
root = pathlib.Path(pytriton.__file__).parent / "tritonserver"
dst = pathlib.Path(".venv-triton/triton-backends/python")
dst.mkdir(parents=True, exist_ok=True)
for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
    shutil.copy2(root / "backends" / "python" / f, dst / f)
stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
shutil.copy2(stub, dst / "triton_python_backend_stub")
print(root / "bin" / "tritonserver")
PYEOF
