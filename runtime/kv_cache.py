"""Per-sequence KV caches and their ragged-batch padding, shared by the ONNX Runtime (numpy) and torch backends.

:class:`StaticKVCache` (ONNX Runtime target and DFlash drafter graphs exported with kv_io "static",
export/graphs.py) preallocates
``[1, kv_heads, capacity, head_dim]`` buffers per layer: a step writes only its new positions, the graph reads the
whole buffer in place (slots past ``length`` are masked), and rollback is a length change.

:class:`KVCache` (graphs that return past + new, and the torch backend) holds ``kv[2 * layer + {0: K, 1: V}]`` = ``[1, kv_heads, length, head_dim]`` arrays (numpy) or tensors
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

    def fork(self) -> "KVCache":
        """An independent cache of the same positions (requests sharing one prefill). The arrays are shared:
        this cache never writes into them (a step replaces them, a rollback takes a view)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.kv = list(self.kv)
        return new


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


class StaticKVCache:
    """One sequence's KV cache in preallocated numpy buffers ``kv_buffers[2 * layer + {0: K, 1: V}]`` =
    ``[1, kv_heads, capacity, head_dim]`` float32, of which the first ``length`` positions are valid.

    Appending writes the new positions in place; :meth:`truncate` (rollback of rejected draft tokens) only moves
    ``length``; the buffers grow by re-allocation (to at least ``GROWTH`` x their capacity, rounded up to ``ALIGN``
    positions) when a step needs more room, so a decode step copies no cache and a growth copy comes once per
    ~length / 8 new tokens, while masked spare slots (which a graph call still reads) stay under ~1/8. Spare
    slots start as zeros (finite: a masked slot must not turn a score into NaN) and afterwards hold rolled-back
    positions, which the caller masks out.
    """

    GROWTH = 1.125
    ALIGN = 256

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype=np.float32) -> None:
        self.kv_buffers = [np.zeros((1, kv_heads, 0, head_dim), dtype) for _ in range(2 * num_layers)]
        self.length = 0
        self.binding = None  # (key, ONNX Runtime IOBinding of these buffers), owned by the graph that binds them

    @property
    def capacity(self) -> int:
        return self.kv_buffers[0].shape[2]

    @property
    def kv(self) -> list[np.ndarray]:
        """Views ``[1, kv_heads, length, head_dim]`` of the valid positions (no copy)."""
        return [t[:, :, : self.length] for t in self.kv_buffers]

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` positions in total (re-allocates and copies only when it must grow)."""
        if positions <= self.capacity:
            return
        cap = max(positions, int(self.capacity * self.GROWTH))
        cap = -(-cap // self.ALIGN) * self.ALIGN
        grown = []
        for t in self.kv_buffers:
            new = np.zeros((1, t.shape[1], cap, t.shape[3]), t.dtype)
            new[:, :, : self.length] = t[:, :, : self.length]
            grown.append(new)
        self.kv_buffers = grown

    def append(self, new: list[np.ndarray], count: int, row: int = 0) -> None:
        """Write ``new[i][row, :, :count]`` (``new[i]``: ``[batch, kv_heads, q_len, head_dim]``, a graph's new K/V)
        at positions ``length .. length + count - 1`` and advance ``length``."""
        end = self.length + count
        self.reserve(end)
        for buf, t in zip(self.kv_buffers, new):
            buf[0, :, self.length: end] = t[row, :, :count]
        self.length = end

    def advance(self, count: int) -> None:
        """Count ``count`` positions a graph wrote into :attr:`kv_buffers` in place (kv_io "shared").

        Raises:
            ValueError: the buffers have no room for them.
        """
        if self.length + count > self.capacity:
            raise ValueError(f"{count} new positions do not fit a cache of {self.capacity} ({self.length} used)")
        self.length += count

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (rollback: a length change, no copy).

        Raises:
            ValueError: ``length`` outside [0, current length].
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def fork(self) -> "StaticKVCache":
        """An independent copy of the valid positions (requests sharing one prefill); steps write in place, so the
        buffers are copied (capacity kept), and the copy gets its own ONNX Runtime binding when first run."""
        new = object.__new__(type(self))
        new.kv_buffers = [t.copy() for t in self.kv_buffers]
        new.length = self.length
        new.binding = None
        return new


def gather_static(caches: list[StaticKVCache]) -> tuple[list[np.ndarray], int]:
    """Past tensors for one graph call over ``caches`` and their past_len.

    One row: its buffers themselves (capacity-long, no copy). Several rows: their valid positions right-padded
    into new ``[batch, kv_heads, max length, head_dim]`` tensors (rows own separate buffers, so a ragged batch
    pays one gather per step; the single-sequence path, and every path's rollback, copy nothing).
    """
    if len(caches) == 1:
        return caches[0].kv_buffers, caches[0].capacity
    l_max = max(c.length for c in caches)
    out = []
    for layer, first in enumerate(caches[0].kv_buffers):
        buf = np.zeros((len(caches), first.shape[1], l_max, first.shape[3]), first.dtype)
        for r, c in enumerate(caches):
            buf[r, :, : c.length] = c.kv_buffers[layer][0, :, : c.length]
        out.append(buf)
    return out, l_max
