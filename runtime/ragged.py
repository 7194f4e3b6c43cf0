"""The ragged-batch layout every graph call uses: rows of different lengths on top of caches of different lengths.

A batch of ``b`` rows is fed as ``[b, q]`` ids and positions, right-padded to the longest row, and one
``attention_mask`` ``[b, l_max + q]`` whose first ``l_max`` columns are the (padded) past and the rest the new
slots; 1 = a key the row may see. Each row ``r`` sees its own ``past_lens[r]`` cached keys and its first
``visible[r]`` new slots; padding slots are hidden, so a real query never reads them (causal graphs), and the in-graph
beta counts only visible keys (docs/design.md §1). Positions continue each row's past and are clamped to the
model's last position (a padding slot past the end is never read).

Worked example (:func:`rows_after_past`): two rows, caches of 3 and 1 tokens (so ``l_max`` = 3), new tokens
``[7, 8]`` and ``[9]``, padding by repeating the row's last token::

    past_lens = [3, 1]; rows = [[7, 8], [9]]; past_width = 3
    input_ids      = [[7, 8],            [9, 9]]
    position_ids   = [[3, 4],            [1, 2]]
    attention_mask = [[1, 1, 1, 1, 1],   [1, 0, 0, 1, 0]]
                      past  | new         past  | new

DFlash's block drafting adds a third segment (:func:`dflash_block`): past | new context rows (target features,
``c_max`` wide) | the block of ``block_size`` queries, all of which every block query sees (non-causal block)::

    past_lens = [2, 0]; ctx_lens = [1, 2]; past_width = 2; block_size = 2
    position_ids   = [[2, 3, 3, 4],        [0, 1, 2, 3]]        # ctx slots (c_max = 2) | block
    attention_mask = [[1, 1, 1, 0, 1, 1],  [0, 0, 1, 1, 1, 1]]  # past | ctx | block

Used by the ONNX Runtime and torch backends (runtime/backends/ort.py, runtime/backends/pytorch.py) and by export
validation (export/validate.py). numpy int64 throughout; torch callers wrap with ``torch.from_numpy``.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RaggedRows:
    """Model inputs of one ragged batch: ``input_ids`` / ``position_ids`` ``[b, q]`` and ``attention_mask``
    ``[b, past_width + q]``, all int64."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray

    def feed(self) -> dict[str, np.ndarray]:
        """The three as graph inputs (names of the exported graphs)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": self.attention_mask}


def positions(past_lens: Sequence[int], width: int, max_positions: int | None = None) -> np.ndarray:
    """``[b, width]`` int64: row r counts up from ``past_lens[r]``, clamped to ``max_positions - 1`` if given."""
    pos = np.asarray(past_lens, np.int64)[:, None] + np.arange(width, dtype=np.int64)[None, :]
    return pos if max_positions is None else np.minimum(pos, max_positions - 1)


def attention_mask(past_lens: Sequence[int], visible: Sequence[int], past_width: int, width: int) -> np.ndarray:
    """``[b, past_width + width]`` int64: row r sees its ``past_lens[r]`` cached keys (columns 0 ..) and its first
    ``visible[r]`` new slots (columns past_width ..).

    Raises:
        ValueError: a past longer than ``past_width`` or more visible slots than ``width``.
    """
    past_lens, visible = np.asarray(past_lens, np.int64), np.asarray(visible, np.int64)
    if past_lens.shape != visible.shape:
        raise ValueError(f"past_lens {past_lens.shape} and visible {visible.shape} need one entry per row")
    if past_lens.size and (past_lens.max() > past_width or visible.max() > width or min(past_lens.min(),
                                                                                     visible.min()) < 0):
        raise ValueError(f"past_lens {past_lens.tolist()} / visible {visible.tolist()} do not fit a past of "
                         f"{past_width} and {width} new slots")
    cols = np.arange(past_width + width, dtype=np.int64)[None, :]
    past = cols < past_lens[:, None]
    new = (cols >= past_width) & (cols < past_width + visible[:, None])
    return (past | new).astype(np.int64)


def rows_after_past(past_lens: Sequence[int], rows: Sequence[Sequence[int]], past_width: int, *,
                    width: int | None = None, pad_id: int | None = None, visible: Sequence[int] | None = None,
                    max_positions: int | None = None) -> RaggedRows:
    """Ids, positions and mask of ``rows`` appended after caches of ``past_lens`` tokens (module docstring).

    Args:
        past_lens: per row, the cached tokens (<= ``past_width``, the padded past the graph is fed).
        rows: per row, the new token ids (>= 1 each).
        width: new slots per row (>= the longest row; default the longest row).
        pad_id: id of the padding slots; None repeats each row's last token (a placeholder after every real token
            of a causal row, never read by one).
        visible: per row, new slots the mask shows (default: the row's own length; PARD shows its mask tokens).
        max_positions: clamp positions to this many (the model's position table).
    Raises:
        ValueError: an empty row, a row longer than ``width``, or a mask that does not fit.
    """
    lens = [len(r) for r in rows]
    if not lens or min(lens) < 1:
        raise ValueError("every row needs at least one token")
    width = max(lens) if width is None else width
    if max(lens) > width:
        raise ValueError(f"a row of {max(lens)} tokens does not fit {width} slots")
    ids = np.empty((len(rows), width), np.int64)
    for r, row in enumerate(rows):
        ids[r, : lens[r]] = row
        ids[r, lens[r]:] = row[-1] if pad_id is None else pad_id
    mask = attention_mask(past_lens, lens if visible is None else visible, past_width, width)
    return RaggedRows(ids, positions(past_lens, width, max_positions), mask)


def dflash_block(past_lens: Sequence[int], ctx_lens: Sequence[int], past_width: int,
                 block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """DFlash's three-segment layout (module docstring): ``(position_ids [b, c_max + block_size],
    attention_mask [b, past_width + c_max + block_size])``, int64. Context slot j of row r sits at position
    ``past_lens[r] + j`` (padding slots masked, their positions unused); block slot j at
    ``past_lens[r] + ctx_lens[r] + j``.

    Raises:
        ValueError: a past longer than ``past_width``.
    """
    past = np.asarray(past_lens, np.int64)
    ctx = np.asarray(ctx_lens, np.int64)
    c_max = int(ctx.max()) if ctx.size else 0
    pos = np.concatenate([positions(past, c_max), positions(past + ctx, block_size)], axis=1)
    mask = attention_mask(past, ctx, past_width, c_max)
    mask = np.concatenate([mask, np.ones((len(past), block_size), np.int64)], axis=1)
    return pos, mask
