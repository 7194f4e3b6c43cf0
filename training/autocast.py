"""What the drafter training recipes share: the CPU autocast that pays on this machine.

bf16 autocast halves activation memory and is fast where the CPU has bf16 instructions (AVX512-BF16 or AMX, as
oneDNN reports them); on an AVX2-only CPU oneDNN emulates bf16 and a training step is ~25x slower than in fp32
(measured on a 2-core AMD EPYC without AVX-512: a [512, 576] x [576, 1536] matmul forward + backward 9.3 s in bf16
vs 0.36 s in fp32 for 20 calls). So training autocasts to bf16 only where it is native, unless
``$SHARPDRAFT_TRAIN_AUTOCAST`` (``bf16`` | ``off``) says otherwise.
"""
from __future__ import annotations

import contextlib
import os

import torch


def bf16_is_native() -> bool:
    """Whether oneDNN runs bf16 on this CPU's own instructions (AVX512-BF16 / AMX), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def use_bf16() -> bool:
    """The autocast choice: ``$SHARPDRAFT_TRAIN_AUTOCAST`` (``bf16`` / ``off``), else :func:`bf16_is_native`.

    Raises:
        ValueError: the variable holds anything else.
    """
    env = os.environ.get("SHARPDRAFT_TRAIN_AUTOCAST", "").strip().lower()
    if env not in ("", "bf16", "off"):
        raise ValueError(f"SHARPDRAFT_TRAIN_AUTOCAST={env!r}: use 'bf16', 'off' or leave it unset (auto)")
    return env == "bf16" if env else bf16_is_native()


def cpu_autocast() -> contextlib.AbstractContextManager:
    """``torch.autocast("cpu", bfloat16)`` where :func:`use_bf16`, else a no-op (fp32 throughout)."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if use_bf16() else contextlib.nullcontext()


def compute_dtype() -> torch.dtype:
    """The dtype of matmuls done outside autocast (the frozen LM head): bf16 where :func:`use_bf16`, else fp32."""
    return torch.bfloat16 if use_bf16() else torch.float32
