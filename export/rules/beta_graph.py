"""The in-graph beta(N) subgraph of SharpDraft (arXiv 2610.05106) and the query ``Mul`` it feeds.

From an int64 or float32 N (visible keys, any shape broadcastable to the query):

    Cast(float) -> Sub(top_k) -> Div(ref_keys - top_k) -> Max(1) -> Log -> Div(slope) -> Add(1) -> Min(cap)

in float32, then ``Cast`` to the query's dtype and ``Mul`` onto the query. This is the ONNX form of
:func:`plugins.rule.beta`; the constants come from the :class:`plugins.rule.QueryScaleProfile` and N is always read
from a ``Shape`` (or an input) at run time, never folded to a constant.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from export.rules.base import NAME_PREFIX, ROLE_KEY, ROLE_QUERY_SCALE, AttentionMatch
from plugins.rule import QueryScaleProfile


class NameTable:
    """Node and value names already taken in a graph; hands out unique ones (``name``, ``name_1``, ...)."""

    def __init__(self, graph: ir.Graph) -> None:
        self._taken: set[str] = set()
        for node in graph.all_nodes():
            self._taken.add(node.name or "")
            self._taken.update(v.name or "" for v in node.outputs)
        self._taken.update(v.name or "" for v in graph.inputs)
        self._taken.update(graph.initializers)

    def unique(self, base: str) -> str:
        name, i = base, 0
        while name in self._taken:
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        return name


class SubgraphBuilder:
    """Collects new nodes named ``sharpdraft/query_scale/<scope>/<op>`` until :meth:`insert_before`.

    Args:
        graph: the graph the nodes go into.
        names: the graph's :class:`NameTable` (shared by every builder of one rewrite).
        scope: e.g. ``"beta0"`` or ``"site3"``.
    """

    def __init__(self, graph: ir.Graph, names: NameTable, scope: str) -> None:
        self.graph = graph
        self._names = names
        self._scope = scope
        self._nodes: list[ir.Node] = []

    def op(self, op_type: str, *inputs: ir.Value, metadata_props: dict[str, str] | None = None,
           **attributes: Any) -> ir.Value:
        """Append one single-output node; returns its output value."""
        name = self._names.unique(f"{NAME_PREFIX}{self._scope}/{op_type}")
        node = ir.node(op_type, list(inputs), attributes, name=name, num_outputs=1,
                       metadata_props=dict(metadata_props or {}))
        node.outputs[0].name = name
        self._nodes.append(node)
        return node.outputs[0]

    def const(self, array: np.ndarray) -> ir.Value:
        return self.op("Constant", value=ir.tensor(np.asarray(array)))

    def shape_dim(self, value: ir.Value, axis: int) -> ir.Value:
        """``value.shape[axis]`` at run time as an int64 tensor of shape [1] (Shape + Gather; axis may be < 0)."""
        shape = self.op("Shape", value)
        return self.op("Gather", shape, self.const(np.array([axis], dtype=np.int64)), axis=0)

    def insert_before(self, anchor: ir.Node) -> list[ir.Node]:
        """Insert the collected nodes before ``anchor`` (the caller toposorts afterwards); returns them."""
        nodes, self._nodes = self._nodes, []
        if nodes:
            self.graph.insert_before(anchor, nodes)
        return nodes


def beta_from_num_keys(builder: SubgraphBuilder, num_keys: ir.Value, profile: QueryScaleProfile) -> ir.Value:
    """beta(N) in float32, elementwise.

    Args:
        num_keys: int64 or float32 N, any shape (``[1]`` for one N per graph, ``[q_len, 1]`` per row,
            ``[batch, 1, q_len, 1]``).
        profile: constants ref_keys, top_k, slope, cap (``profile.enabled`` is the caller's business).

    Returns:
        float32 value of the same shape: min(cap, 1 + ln(max((N - top_k) / (ref_keys - top_k), 1)) / slope).
    """
    def f32(x: float) -> ir.Value:
        return builder.const(np.array(x, dtype=np.float32))

    n = num_keys if num_keys.dtype == ir.DataType.FLOAT else builder.op("Cast", num_keys, to=int(ir.DataType.FLOAT))
    r = builder.op("Div", builder.op("Sub", n, f32(profile.top_k)), f32(profile.ref_keys - profile.top_k))
    r = builder.op("Max", r, f32(1.0))
    log_r = builder.op("Div", builder.op("Log", r), f32(profile.slope))
    return builder.op("Min", builder.op("Add", log_r, f32(1.0)), f32(profile.cap))


class SharedBeta:
    """One beta subgraph and its casts to each query dtype, shared by every attention that sees the same N."""

    def __init__(self, builder: SubgraphBuilder, beta: ir.Value) -> None:
        self.builder = builder  # the group's builder: the casts are part of the shared subgraph
        self.beta = beta  # float32
        self._casts: dict[ir.DataType, ir.Value] = {}

    def cast_to(self, dtype: ir.DataType) -> ir.Value:
        if dtype not in self._casts:
            self._casts[dtype] = self.builder.op("Cast", self.beta, to=int(dtype))
        return self._casts[dtype]


def scale_query(builder: SubgraphBuilder, match: AttentionMatch, shared: SharedBeta) -> ir.Node:
    """Insert ``Q' = Mul(Q, Cast(beta, to=Q.dtype))`` and rewire ``match.anchor`` to read Q'.

    Args:
        builder: this attention's builder (the ``Mul`` and, if needed, a ``CastLike`` go there).
        match: the attention; its query Q has any shape (e.g. ``[batch, heads, q_len, head_dim]``) and float dtype.
        shared: beta as float32, broadcastable to Q (``[1]``, ``[q_len, 1]``, ``[batch, 1, q_len, 1]``). When Q's
            dtype is unknown, ``CastLike(beta, Q)`` is used instead of ``Cast`` (opset >= 15, checked by the rule).

    Returns:
        The inserted ``Mul``, tagged ``{"sharpdraft.role": "query_scale"}`` in its metadata_props.
    """
    query = match.query
    if query.dtype is None:
        beta_q = builder.op("CastLike", shared.beta, query)
    else:
        beta_q = shared.cast_to(query.dtype)
    scaled = builder.op("Mul", query, beta_q, metadata_props={ROLE_KEY: ROLE_QUERY_SCALE})
    scaled.type = query.type
    if query.shape is not None:
        scaled.shape = ir.Shape(list(query.shape))
    match.anchor.replace_input_with(match.query_index, scaled)
    return scaled.producer()
