"""Shared vocabulary of the query-scale rules: matches, match failures and shape/constant helpers.

A rule (see ``decomposed.py``, ``onnx_attention.py``) is ``pattern(node) -> AttentionMatch | None`` (structure only),
``check(match) -> MatchFailure | None`` (semantic conditions, each failure says why and on what value),
``num_keys(match, builder) -> ir.Value`` (the N subgraph) and ``rewrite(match, beta, builder)`` (the ``Mul`` on the
query). Matching never raises and rules keep no state: everything ``rewrite`` needs travels in the match.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import onnx_ir as ir

ROLE_KEY = "sharpdraft.role"  # node metadata_props key of every inserted query-scale Mul
ROLE_QUERY_SCALE = "query_scale"
NAME_PREFIX = "sharpdraft/query_scale/"


@dataclasses.dataclass(frozen=True, slots=True)
class MatchFailure:
    """Why a structurally matched node is not rewritten."""

    reason: str
    value: Any = None

    def __str__(self) -> str:
        return f"{self.reason} (got {self.value!r})"


def fail(reason: str, value: Any = None) -> MatchFailure:
    return MatchFailure(reason, value)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class AttentionMatch:
    """One attention whose query gets multiplied by beta.

    Attributes:
        rule: name of the rule that matched.
        anchor: the node whose input ``query_index`` is the query (the QK ``MatMul``, or the ``Attention`` node).
        query_index: input slot of the query on ``anchor``.
        key_sources: the values the N subgraph reads (for ordering and cycle checks when N is shared).
        group_key: hashable description of N; two matches with equal non-None keys see the same N and share one
            beta subgraph (same symbolic/static dims, or the very same input values). None: its own subgraph.
        info: rule-specific facts found by ``pattern`` (e.g. the softmax node, ``is_causal``).
    """

    rule: str
    anchor: ir.Node
    query_index: int
    key_sources: tuple[ir.Value, ...]
    group_key: Hashable | None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def query(self) -> ir.Value:
        return self.anchor.inputs[self.query_index]


def dim_key(value: ir.Value | None, axis: int) -> Hashable | None:
    """A hashable id of ``value.shape[axis]``: ("static", 8), ("sym", "s0 + 8"), or None if unknown."""
    if value is None or value.shape is None:
        return None
    rank = len(value.shape)
    if not -rank <= axis < rank:
        return None
    dim = value.shape[axis]
    if isinstance(dim, int):
        return ("static", dim)
    if isinstance(dim, ir.SymbolicDim) and dim.value:
        return ("sym", dim.value)
    return None


def rank_of(*values: ir.Value | None) -> int | None:
    """The rank of the first value whose shape is known, else None."""
    for value in values:
        if value is not None and value.shape is not None:
            return len(value.shape)
    return None


def is_constant(value: ir.Value | None) -> bool:
    """True for initializers and ``Constant`` outputs (weights, not activations)."""
    if value is None:
        return False
    if value.const_value is not None or value.is_initializer():
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx")


def is_scalar_like(value: ir.Value | None) -> bool:
    """True when ``value`` holds one element (a scale factor): shape [] / [1] / [1, 1], or a 1-element constant."""
    if value is None:
        return False
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        return tensor.size == 1
    return value.shape is not None and all(isinstance(d, int) and d == 1 for d in value.shape)


def default_opset(graph: ir.Graph) -> int:
    return int(graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0)))


def int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    if attr is None or attr.type != ir.AttributeType.INT:
        return default
    return int(attr.value)


def is_query_scale_mul(node: ir.Node | None) -> bool:
    """True for a ``Mul`` inserted by this rewrite (tagged in node metadata, never recognised by name)."""
    return (node is not None and node.op_type == "Mul"
            and node.metadata_props.get(ROLE_KEY) == ROLE_QUERY_SCALE)


def optional_input(node: ir.Node, index: int) -> ir.Value | None:
    """Input ``index`` of ``node``, or None when the node has fewer inputs (trailing optional inputs omitted)."""
    return node.inputs[index] if len(node.inputs) > index else None
