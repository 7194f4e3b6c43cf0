"""Observe drafter attention scores (calibration and diagnostics; ``sharpdraft-calibrate``).

Inside ``with record(callback):`` every drafter attention of this project's torch models (DFlash
:class:`runtime.models.dflash.DFlashAttention` on its eager path, EAGLE-3 :class:`runtime.models.eagle3.Eagle3Attention`,
and Hugging Face drafters running ``attn_implementation="sharpdraft_eager"``, e.g. PARD) calls
``callback(module, scores)`` with its pre-softmax scores ``[batch, heads, q_len, keys]``: ``q . k / sqrt(head_dim)``
with the query already multiplied by beta when a query scale is active, hidden keys at -inf or at the mask's
finfo.min. Outside a ``record`` block the attentions do nothing extra (one context-variable read).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

ScoreCallback = Callable[[torch.nn.Module, torch.Tensor], None]
_PROBE: contextvars.ContextVar[ScoreCallback | None] = contextvars.ContextVar("sharpdraft_score_probe", default=None)


@contextlib.contextmanager
def record(callback: ScoreCallback) -> Iterator[None]:
    """Route every drafter attention's scores to ``callback(module, scores)`` for the duration of the block."""
    token = _PROBE.set(callback)
    try:
        yield
    finally:
        _PROBE.reset(token)


def active() -> bool:
    """True inside a :func:`record` block."""
    return _PROBE.get() is not None


def emit(module: torch.nn.Module, scores: torch.Tensor) -> None:
    """Hand ``scores`` ``[batch, heads, q_len, keys]`` to the active callback, if any (no-op otherwise)."""
    if torch.compiler.is_compiling():  # tracing for export: never part of a graph
        return
    callback = _PROBE.get()
    if callback is not None:
        with torch.no_grad():
            callback(module, scores.detach())
