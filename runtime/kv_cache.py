"""Per-sequence KV caches and their ragged-batch padding, shared by the ONNX Runtime (numpy) and torch backends.

A cache holds ``kv[2 * layer + {0: K, 1: V}]`` = ``[1, kv_heads, length, head_dim]`` arrays (numpy) or tensors
(torch). A ragged batch right-pads the rows' caches to the longest (:func:`pad_caches`); after the call each row
takes back its old K/V plus its real new positions (:func:`unpad_present`): placeholders and padding are dropped,
and rollback is :meth:`KVCache.truncate` (a view, no copy).
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _zeros_like(first: Any, shape: tuple[int, ...]):
    return first.new_zeros(shape) if hasattr(first, "new_zeros") else np.zeros(shape, first.dtype)


def _concat(parts: list[Any]):
    if hasattr(parts[0], "new_zeros"):
        import torch

        return torch.cat(parts, dim=2)
    return np.concatenate(parts, axis=2)


class KVCache:
    """One sequence's KV cache of one graph / model.

    Args:
        num_layers, kv_heads, head_dim: the cache's geometry.
        empty: a ``[1, kv_heads, 0, head_dim]`` array or tensor to start from (default: numpy float32), which sets
            the array type, dtype and device of the cache.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, empty: Any = None) -> None:
        if empty is None:
            empty = np.zeros((1, kv_heads, 0, head_dim), np.float32)
        self.kv: list[Any] = [empty] * (2 * num_layers)

    @property
    def length(self) -> int:
        return self.kv[0].shape[2]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (rollback of rejected tokens; a view, no copy).

        Raises:
            ValueError: ``length`` outside [0, current length].
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.kv = [t[:, :, :length] for t in self.kv]


def pad_caches(caches: list[KVCache]) -> tuple[list[Any], int]:
    """Right-pad the rows' caches into batched ``[batch, kv_heads, L_max, head_dim]``; returns (per-slot, L_max)."""
    if len(caches) == 1:
        return caches[0].kv, caches[0].length
    l_max = max(c.length for c in caches)
    out = []
    for layer in range(len(caches[0].kv)):
        first = caches[0].kv[layer]
        buf = _zeros_like(first, (len(caches), first.shape[1], l_max, first.shape[3]))
        for r, c in enumerate(caches):
            buf[r, :, : c.length] = c.kv[layer][0]
        out.append(buf)
    return out, l_max


def unpad_present(present: list[Any], caches: list[KVCache], l_max: int, new_lens: list[int]) -> None:
    """Give each row back its old K/V plus its ``new_lens[r]`` real new positions (placeholders dropped).

    ``present[i]`` is ``[batch, kv_heads, l_max + q, head_dim]``: the padded past, then the q new positions.
    """
    if len(caches) == 1:
        caches[0].kv = [t[:, :, : l_max + new_lens[0]] for t in present]
        return
    for r, c in enumerate(caches):
        old, n = c.length, new_lens[r]
        c.kv = [_concat([t[r: r + 1, :, :old], t[r: r + 1, :, l_max: l_max + n]]) for t in present]
