"""Write a Triton Inference Server model repository that serves an engines/ folder with the Python backend.

    python -m runtime.triton_repo --engine engines/ --out triton_repo/ [--kind cpu|gpu] [--max-running 8]

Layout (triton-inference-server/python_backend README)::

    triton_repo/sharpdraft/config.pbtxt   backend "python", decoupled, tensors named like TensorRT-LLM's llmapi model
    triton_repo/sharpdraft/1/model.py     imports runtime.triton_backend.TritonPythonModel

The engines folder and this project's source are referenced by absolute path (``parameters``); the Python that
Triton's backend stub runs must be able to import onnxruntime, transformers and numpy (scripts/setup_triton.sh builds
such an environment next to the pytriton-bundled tritonserver). Run it with
``tritonserver --model-repository triton_repo/`` (scripts/triton_serve.sh does that with the bundled binary).
"""
from __future__ import annotations

from pathlib import Path

import click

INPUTS = [  # (name, data type, dims, optional)
    ("text_input", "TYPE_STRING", "[ 1 ]", False),
    ("streaming", "TYPE_BOOL", "[ 1 ]", True),
    ("sampling_param_max_tokens", "TYPE_INT32", "[ 1 ]", True),
    ("sampling_param_temperature", "TYPE_FP32", "[ 1 ]", True),
    ("sampling_param_top_p", "TYPE_FP32", "[ 1 ]", True),
    ("sampling_param_top_k", "TYPE_INT32", "[ 1 ]", True),
    ("sampling_param_seed", "TYPE_UINT64", "[ 1 ]", True),
    ("sampling_param_stop", "TYPE_STRING", "[ -1 ]", True),
    ("speculative", "TYPE_BOOL", "[ 1 ]", True),
    ("query_scale", "TYPE_BOOL", "[ 1 ]", True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", "[ 1 ]"),
    ("finish_reason", "TYPE_STRING", "[ 1 ]"),
    ("acceptance_rate", "TYPE_FP32", "[ 1 ]"),
    ("total_accepted_draft_tokens", "TYPE_INT32", "[ 1 ]"),
    ("total_draft_tokens", "TYPE_INT32", "[ 1 ]"),
    ("mean_accepted_length", "TYPE_FP32", "[ 1 ]"),
    ("completion_tokens", "TYPE_INT32", "[ 1 ]"),
]

MODEL_PY = '''"""Triton Python-backend entry point written by runtime/triton_repo.py: serves an engines/ folder."""
import json
import sys


def _add_project_path():
    import os

    config = json.load(open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "project_path.json")))
    for p in reversed(config["python_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)


_add_project_path()
from runtime.triton_backend import TritonPythonModel  # noqa: E402,F401
'''


def config_pbtxt(name: str, engine_dir: Path, kind: str, max_running: int, max_waiting: int) -> str:
    """The ``config.pbtxt`` text (protobuf text format of Triton's ModelConfig)."""
    def tensor(n, t, dims, optional=None):
        opt = "\n    optional: true" if optional else ""
        return f"  {{\n    name: \"{n}\"\n    data_type: {t}\n    dims: {dims}{opt}\n  }}"

    params = {"engine_dir": str(engine_dir.resolve()), "max_running": str(max_running),
              "max_waiting": str(max_waiting)}
    lines = [f'name: "{name}"', 'backend: "python"', "max_batch_size: 0",
             "model_transaction_policy {\n  decoupled: true\n}",
             "input [\n" + ",\n".join(tensor(*i) for i in INPUTS) + "\n]",
             "output [\n" + ",\n".join(tensor(*o) for o in OUTPUTS) + "\n]",
             f"instance_group [\n  {{\n    count: 1\n    kind: {kind}\n  }}\n]"]
    lines += [f'parameters {{\n  key: "{k}"\n  value: {{\n    string_value: "{v}"\n  }}\n}}' for k, v in params.items()]
    return "\n".join(lines) + "\n"


def write_model_repository(engine_dir: Path, out: Path, name: str = "sharpdraft", kind: str = "cpu",
                           max_running: int = 8, max_waiting: int = 64, python_path: list[str] | None = None) -> Path:
    """Write ``out/<name>/config.pbtxt`` and ``out/<name>/1/model.py``; returns the model folder.

    Args:
        engine_dir: an exported engines/ folder (must hold manifest.json).
        out: the model repository root (created; an existing model folder of the same name is replaced).
        kind: "cpu" (KIND_CPU) or "gpu" (KIND_GPU: ONNX Runtime's CUDA provider when onnxruntime-gpu is present).
        python_path: folders prepended to the backend's sys.path (default: this project's root).
    Raises:
        FileNotFoundError: ``engine_dir`` has no manifest.json.
        ValueError: unknown ``kind``.
    """
    import json
    import shutil

    engine_dir = Path(engine_dir)
    if not (engine_dir / "manifest.json").is_file():
        raise FileNotFoundError(f"{engine_dir}: no manifest.json; run sharpdraft-export first")
    kinds = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
    if kind not in kinds:
        raise ValueError(f"kind must be one of {sorted(kinds)}, got {kind!r}")
    model = Path(out) / name
    if model.exists():
        shutil.rmtree(model)
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(config_pbtxt(name, engine_dir, kinds[kind], max_running, max_waiting))
    (model / "1" / "model.py").write_text(MODEL_PY)
    root = str(Path(__file__).resolve().parents[1])
    (model / "project_path.json").write_text(json.dumps({"python_path": python_path or [root]}, indent=1))
    return model


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path), show_default=True)
@click.option("--out", default="triton_repo", type=click.Path(path_type=Path), show_default=True)
@click.option("--name", default="sharpdraft", show_default=True)
@click.option("--kind", default="cpu", type=click.Choice(["cpu", "gpu"]), show_default=True)
@click.option("--max-running", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=0))
@click.option("--python-path", multiple=True, help="extra folders for the backend's sys.path (e.g. the site-packages "
              "of .venv-triton; Triton's backend stub does not read PYTHONPATH)")
def main(engine_dir: Path, out: Path, name: str, kind: str, max_running: int, max_waiting: int,
         python_path: tuple[str, ...]) -> None:
    root = str(Path(__file__).resolve().parents[1])
    try:
        model = write_model_repository(engine_dir, out, name, kind, max_running, max_waiting,
                                       [root, *[str(Path(p).resolve()) for p in python_path]])
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {model}/config.pbtxt and {model}/1/model.py; serve with: .venv-triton/bin/python "
               f"scripts/triton_serve.py --model-repository {out}  (see README, Triton Inference Server)")


if __name__ == "__main__":
    main()
