"""Query scale for ONNX Runtime's ``com.microsoft`` ``GroupQueryAttention`` (always causal).

Inputs used: query [batch, q_len, num_heads * head_dim] (input 0), key (input 1; absent = packed QKV, not
supported), seqlens_k [batch] int32 = keys in the cache after this step - 1 (input 5), total_sequence_length
int32 scalar (input 6). Following ONNX Runtime (``group_query_attention_helper.h``):

- first prompt (q_len == total_sequence_length): offset = 0;
- otherwise (decode, or a subsequent prompt): offset[b] = seqlens_k[b] + 1 - q_len;
- row i of batch b sees N[b, i] = offset[b] + i + 1 keys (rows past seqlens_k[b] are padding).

Example: decode, seqlens_k = [10, 7], q_len 1 -> N = [[11], [8]]; subsequent prompt, seqlens_k = [12], q_len 3
-> N = [[11, 12, 13]]. beta is the [batch, q_len, 1] tensor beta(N). Rotary (``do_rotary``) is linear, so
scaling Q before it is the same as after. NOTE(sharpdraft): attention_bias is not subtracted from N, and
``local_window_size`` is rejected rather than guessed.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from export.rules.base import (AttentionMatch, MatchFailure, default_opset, dim_key, fail, int_attr,
                               optional_input)
from export.rules.beta_graph import SharedBeta, SubgraphBuilder, scale_query

_QUERY, _KEY, _SEQLENS_K, _TOTAL_SEQ_LEN = 0, 1, 5, 6  # input slots of GroupQueryAttention


class GroupQueryAttentionQueryScale:
    """Scale the query (input 0) of every ``com.microsoft.GroupQueryAttention`` by a per-batch, per-row beta."""

    name = "GroupQueryAttentionQueryScale"

    def pattern(self, node: ir.Node) -> AttentionMatch | None:
        """Anchor: ``GroupQueryAttention`` in domain ``com.microsoft`` with a query. Never raises."""
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            return None
        query = optional_input(node, _QUERY)
        seqlens, total = optional_input(node, _SEQLENS_K), optional_input(node, _TOTAL_SEQ_LEN)
        if query is None:
            return None
        q_dim = dim_key(query, 1)
        key = None if q_dim is None or seqlens is None or total is None else ("gqa", id(seqlens), id(total), q_dim)
        sources = tuple(v for v in (query, seqlens, total) if v is not None)
        return AttentionMatch(rule=self.name, anchor=node, query_index=_QUERY, key_sources=sources, group_key=key)

    def check(self, match: AttentionMatch) -> MatchFailure | None:
        node = match.anchor
        if optional_input(node, _KEY) is None:
            return fail("packed QKV GroupQueryAttention (no key input) is not supported", node.name)
        if optional_input(node, _SEQLENS_K) is None or optional_input(node, _TOTAL_SEQ_LEN) is None:
            return fail("GroupQueryAttention without seqlens_k / total_sequence_length", node.name)
        window = int_attr(node, "local_window_size", -1)
        if window != -1:
            return fail("local_window_size GroupQueryAttention is not supported", window)
        opset = default_opset(node.graph) if node.graph is not None else 0
        if opset < 13 or (match.query.dtype is None and opset < 15):
            return fail("needs default opset >= 13 (>= 15 when the query dtype is unknown)", opset)
        if match.query.shape is not None and len(match.query.shape) != 3:
            return fail("GroupQueryAttention query must be [batch, q_len, hidden]", len(match.query.shape))
        return None

    def num_keys(self, match: AttentionMatch, builder: SubgraphBuilder) -> ir.Value:
        """int64 N [batch, q_len, 1] (see the module docstring)."""
        node = match.anchor

        def i64(x) -> ir.Value:
            return builder.const(np.array(x, dtype=np.int64))

        q_len = builder.shape_dim(match.query, 1)  # [1]
        total = builder.op("Add", builder.op("Cast", node.inputs[_SEQLENS_K], to=int(ir.DataType.INT64)), i64(1))
        first_prompt = builder.op("Equal", q_len, builder.op("Cast", node.inputs[_TOTAL_SEQ_LEN],
                                                             to=int(ir.DataType.INT64)))  # [1]
        offset = builder.op("Where", first_prompt, i64([0]), builder.op("Sub", total, q_len))  # [batch]
        ones = builder.op("ConstantOfShape", q_len, value=ir.tensor(np.array([1], dtype=np.int64)))
        rows = builder.op("CumSum", ones, i64(0))  # [q_len]: 1, 2, ..., q_len
        # rows past seqlens_k (padding of a first prompt) get N > total: their output is unused
        per_row = builder.op("Add", builder.op("Unsqueeze", offset, i64([1])), rows)  # [batch, q_len]
        return builder.op("Unsqueeze", per_row, i64([2]))  # [batch, q_len, 1]

    def rewrite(self, match: AttentionMatch, shared: SharedBeta, builder: SubgraphBuilder) -> ir.Node:
        """``GroupQueryAttention(Q, ...)`` becomes ``GroupQueryAttention(Mul(Q, beta), ...)``."""
        return scale_query(builder, match, shared)
