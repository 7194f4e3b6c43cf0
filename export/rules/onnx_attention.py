"""Query scale for the ONNX ``Attention`` op (opset 23/24): ``Attention(Q', K, V, ...)``, Q' = beta * Q.

Inputs: Q [batch, q_heads, q_len, head_dim] or [batch, q_len, q_hidden]; K [batch, kv_heads, kv_len, head_dim] or
[batch, kv_len, kv_hidden]; optional past_key [batch, kv_heads, past_len, head_dim] (input 4) and, opset 24,
nonpad_kv_seqlen [batch] int64 (input 6). The sequence axis is -2 in both layouts.

Visible keys (the causal frontier is offset-aligned, as in the ONNX reference and ONNX Runtime):
- not causal: N = past_len + kv_len (or nonpad_kv_seqlen[b]), the same for every row;
- causal: row i sees N_i = min(offset + i + 1, N) keys, offset = past_len (0 without a cache) or
  nonpad_kv_seqlen[b] - q_len. Example: past_len 5, q_len 3 -> N_i = 6, 7, 8.
beta is then a [q_len, 1] tensor (broadcasts against both layouts), or [batch, 1, q_len, 1] / [batch, q_len, 1]
with nonpad_kv_seqlen. NOTE(sharpdraft): attn_mask (input 3) is not subtracted from N.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from export.rules.base import AttentionMatch, MatchFailure, dim_key, fail, int_attr, optional_input, rank_of
from export.rules.beta_graph import SharedBeta, SubgraphBuilder, scale_query

_Q, _K, _PAST_KEY, _NONPAD = 0, 1, 4, 6  # input slots of Attention


class OnnxAttentionQueryScale:
    """Scale input 0 (Q) of every ONNX ``Attention`` node by beta(N), per row when ``is_causal=1``."""

    name = "OnnxAttentionQueryScale"

    def pattern(self, node: ir.Node) -> AttentionMatch | None:
        """Anchor: ``Attention`` in the default domain with Q and K present. Never raises."""
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            return None
        query, keys = optional_input(node, _Q), optional_input(node, _K)
        if query is None or keys is None:
            return None
        past, nonpad = optional_input(node, _PAST_KEY), optional_input(node, _NONPAD)
        causal = int_attr(node, "is_causal", 0) == 1
        sources = tuple(v for v in (query, keys, past, nonpad) if v is not None)
        info = {"causal": causal, "past_key": past, "nonpad": nonpad, "rank": rank_of(query, keys)}
        return AttentionMatch(rule=self.name, anchor=node, query_index=_Q, key_sources=sources,
                              group_key=_group_key(query, keys, past, nonpad, causal, info["rank"]), info=info)

    def check(self, match: AttentionMatch) -> MatchFailure | None:
        node = match.anchor
        for window in ("left_window_size", "right_window_size"):
            if int_attr(node, window, -1) != -1:
                return fail(f"sliding-window Attention ({window}) is not supported", int_attr(node, window, -1))
        if match.info["nonpad"] is not None:
            if match.info["past_key"] is not None:
                return fail("nonpad_kv_seqlen together with past_key is invalid ONNX", node.name)
            if match.info["rank"] not in (3, 4):
                return fail("nonpad_kv_seqlen needs Q or K of known rank 3 or 4", match.info["rank"])
        return None

    def num_keys(self, match: AttentionMatch, builder: SubgraphBuilder) -> ir.Value:
        """int64 N: [1] (not causal), [q_len, 1] (causal); with nonpad_kv_seqlen see :func:`_num_keys_nonpad`."""
        node, info = match.anchor, match.info
        if info["nonpad"] is not None:
            return _num_keys_nonpad(match, builder)
        total = builder.shape_dim(node.inputs[_K], -2)  # [1]
        offset = None
        if info["past_key"] is not None:
            offset = builder.shape_dim(info["past_key"], -2)  # [1]
            total = builder.op("Add", total, offset)
        if not info["causal"]:
            return total
        rows = _row_counts(builder, match.query)  # [q_len]: 1, 2, ..., q_len
        per_row = rows if offset is None else builder.op("Add", rows, offset)
        per_row = builder.op("Min", per_row, total)  # rows past the last key see all N keys
        return builder.op("Unsqueeze", per_row, builder.const(np.array([1], dtype=np.int64)))  # [q_len, 1]

    def rewrite(self, match: AttentionMatch, shared: SharedBeta, builder: SubgraphBuilder) -> ir.Node:
        """``Attention(Q, ...)`` becomes ``Attention(Mul(Q, beta), ...)``; returns the inserted ``Mul``."""
        return scale_query(builder, match, shared)


def _row_counts(builder: SubgraphBuilder, query: ir.Value) -> ir.Value:
    """int64 [q_len] = 1, 2, ..., q_len (CumSum of ones; q_len read from Q at run time)."""
    q_len = builder.shape_dim(query, -2)  # [1]
    ones = builder.op("ConstantOfShape", q_len, value=ir.tensor(np.array([1], dtype=np.int64)))
    return builder.op("CumSum", ones, builder.const(np.array(0, dtype=np.int64)))


def _num_keys_nonpad(match: AttentionMatch, builder: SubgraphBuilder) -> ir.Value:
    """Per-batch N from nonpad_kv_seqlen [batch]; causal rows: min(nonpad[b] - q_len + i + 1, nonpad[b]).

    Returns int64 [batch, 1, 1, 1] / [batch, 1, 1] (not causal) or [batch, 1, q_len, 1] / [batch, q_len, 1] (causal)
    for 4-D / 3-D Q.
    """
    nonpad = match.info["nonpad"]
    # 4-D Q [b, h, q, d] takes beta [b, 1, q, 1]; 3-D Q [b, q, hidden] takes beta [b, q, 1].
    tail_axes = [1, 3] if match.info["rank"] == 4 else [2]
    if not match.info["causal"]:
        axes = [1, 2, 3] if match.info["rank"] == 4 else [1, 2]
        return builder.op("Unsqueeze", nonpad, builder.const(np.array(axes, dtype=np.int64)))
    col = builder.op("Unsqueeze", nonpad, builder.const(np.array([1], dtype=np.int64)))  # [b, 1]
    q_len = builder.shape_dim(match.query, -2)  # [1]
    rows = _row_counts(builder, match.query)  # [q_len]
    per_row = builder.op("Add", builder.op("Sub", col, q_len), rows)  # [b, q_len]
    per_row = builder.op("Min", per_row, col)
    return builder.op("Unsqueeze", per_row, builder.const(np.array(tail_axes, dtype=np.int64)))


def _group_key(query, keys, past, nonpad, causal: bool, rank: int | None):
    """Matches with equal keys compute the same N tensor; None when a needed dim is unknown."""
    if nonpad is not None:
        q_dim = dim_key(query, -2) if causal else "any"
        return None if q_dim is None else ("nonpad", id(nonpad), causal, rank, q_dim)
    parts = [dim_key(keys, -2)] + ([dim_key(past, -2)] if past is not None else [])
    if causal:
        parts += [dim_key(query, -2)]
    if any(p is None for p in parts):  # dims unknown: only attentions reading the very same values share
        return ("values", causal, id(query) if causal else None, id(keys), id(past))
    if not causal and past is None:
        return ("keys", parts[0])  # same N as a decomposed attention over the same key dim
    return ("causal" if causal else "keys+past", past is not None, *parts)
