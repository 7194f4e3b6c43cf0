"""Run the nvidia-pytriton-bundled tritonserver (CPU) on a model repository; run with .venv-triton's Python.

    .venv-triton/bin/python scripts/triton_serve.py --model-repository triton_repo/ [--http-port 8000 --grpc-port 8001]

Sets what the bundled binary needs on a CPU-only host (docs/serving.md, "Triton Inference Server"): LD_LIBRARY_PATH with this
Python's LIBDIR (the backend stub must load the same libpython as this interpreter's stdlib) and the wheel's bundled
libraries (nvidia_pytriton.libs: libcudart is linked even on CPU); the backend directory laid out by
scripts/setup_triton.sh; loopback addresses. Replaces this process with tritonserver (exec).
"""
import argparse
import os
import pathlib
import sysconfig

import pytriton

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-repository", required=True)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--address", default="127.0.0.1")
    args = ap.parse_args()
    server_root = pathlib.Path(pytriton.__file__).parent / "tritonserver"
    libs = pathlib.Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    backends = ROOT / ".venv-triton" / "triton-backends"
    if not (backends / "python" / "triton_python_backend_stub").is_file():
        raise SystemExit(f"{backends}: no Python backend stub; run bash scripts/setup_triton.sh first")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (sysconfig.get_config_var("LIBDIR"), str(libs),
                                                         env.get("LD_LIBRARY_PATH", "")) if p)
    binary = str(server_root / "bin" / "tritonserver")
    argv = [binary, "--model-repository", str(pathlib.Path(args.model_repository).resolve()),
            "--backend-directory", str(backends), "--http-address", args.address, "--grpc-address", args.address,
            "--metrics-address", args.address, "--http-port", str(args.http_port), "--grpc-port", str(args.grpc_port),
            "--metrics-port", str(args.metrics_port), "--log-verbose", "0"]
    os.execve(binary, argv, env)


if __name__ == "__main__":
    main()
