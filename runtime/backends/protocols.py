"""What the loop (runtime/engine.py) needs of a target and a drafter backend, as typed Protocols.

Implemented by runtime/backends/ort.py (ONNX Runtime graphs), runtime/backends/pytorch.py (PyTorch) and the scripted
backends of tests/runtime/scripted.py. :func:`check_backend` refuses an object that lacks a member, naming it,
instead of the loop falling back to a default deep inside a step.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from runtime.modes import DrafterContext, Verification


class TargetBackend(Protocol):
    """The target model. Optional: ``prefill(cache, tokens) -> (last logits [V], feats [n, F])`` (chunked prefill
    with bounded memory; without it the loop prefills through :meth:`forward`)."""

    vocab_size: int
    max_positions: int

    def new_cache(self) -> Any:
        """An empty per-sequence cache with ``length`` and ``truncate(n)``."""

    def forward(self, caches: list, tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Run a ragged batch: row r appends ``tokens[r]`` after its cache. Returns logits ``[b, q, V]`` float32 and
        tapped features ``[b, q, F]`` float32 (F = 0 without taps); each cache grows by its row's length."""


class DrafterBackend(Protocol):
    """A drafter of one family (runtime/backends/ort.py ``ORT_DRAFTERS``)."""

    vocab_size: int
    num_draft_tokens: int  # K, drafted per call
    max_positions: int
    verification: Verification  # the lossless scheme sampled rows use (runtime/sampling.py)
    context: DrafterContext  # what ``draft`` reads of the committed context
    query_scaled: bool  # the graph multiplies queries by beta
    query_scale_switch: bool  # the graph takes a per-row on/off (``draft(..., query_scale=[...])``)

    def new_cache(self) -> Any: ...

    def can_draft(self, committed: int) -> bool:
        """False when a block after ``committed`` tokens would pass the drafter's positions."""

    def draft(self, caches: list, bonus_tokens: list[int], contexts: list, query_scale: list[bool] | None = None,
              num_tokens: int | None = None) -> np.ndarray:
        """Logits ``[b, k, V_drafter]`` float32 of the draft slots after each row's bonus token, k >= ``num_tokens``
        (the most any row of the call will verify; a drafter may use it to skip work) and <= K."""


def check_backend(obj: Any, protocol: type) -> None:
    """Raise TypeError naming every member of ``protocol`` that ``obj`` lacks."""
    names = [n for n in getattr(protocol, "__annotations__", {})]
    names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise TypeError(f"{type(obj).__name__} is not a {protocol.__name__}: it lacks {', '.join(missing)} "
                        "(runtime/backends/protocols.py)")
