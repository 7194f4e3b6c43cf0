"""Query scale for decomposed attention: ``Softmax(MatMul(Q, K^T) [*|/ scale] [+ mask] [Where] [Cast])``.

This is what torch.onnx (dynamo) emits for an explicit ``softmax(q @ k.transpose(-1, -2) * scale + mask) @ v``
and for its decomposition of ``scaled_dot_product_attention`` (which multiplies both Q and K^T by sqrt(scale)
before the MatMul: the first MatMul input is then ``Q * sqrt(scale)``, which we scale again - same result).

Worked example (one layer, DFlash, keys on the last axis of K^T)::

    q [b, h, q_len, d] --------------------------------------------.
    k [b, h, N, d] -> Transpose -> kt [b, h, d, N] -> MatMul(q, kt) -> Mul(0.35) -> Add(mask) -> Softmax(-1)
becomes
    q -> Mul(q, Cast(beta(Shape(kt)[-1]))) -> MatMul(., kt) -> ...

N is the full key length (dim -1 of K^T). NOTE(sharpdraft): in that default mode additive / Where masks are not
subtracted from N, so a causal decomposed attention gets the same beta for every row (exact for DFlash, whose block
sees all N keys). For causal drafters (PARD, EAGLE-3) ``export/rewrite.py``'s ``num_keys_from="score_mask"`` mode
instead counts, per query row, the keys the attention's own mask leaves visible: :func:`score_masks` finds the mask
operands of the score chain and :func:`visible_keys_from_masks` builds N from them.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from export.rules.base import (AttentionMatch, MatchFailure, default_opset, dim_key, fail, int_attr, is_constant,
                               is_scalar_like, rank_of)
from export.rules.beta_graph import SharedBeta, SubgraphBuilder, scale_query

_MAX_WALK = 8  # ops between the QK MatMul and the Softmax (Cast, Mul/Div scale, Add mask, Where mask, ...)
_PROBS_PASS_THROUGH = ("Cast", "Where", "Dropout", "Identity")  # ops allowed between Softmax and P @ V


def _is_onnx(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _score_sources(node: ir.Node) -> tuple[ir.Value | None, ...]:
    """The inputs of a score-side op that may carry the scores (the others are masks or scale factors)."""
    if _is_onnx(node, "Cast"):
        return (node.inputs[0],)
    if _is_onnx(node, "Add"):
        return tuple(node.inputs[:2])
    if _is_onnx(node, "Where") and len(node.inputs) == 3:
        return (node.inputs[1], node.inputs[2])
    if _is_onnx(node, "Mul") and len(node.inputs) == 2:
        a, b = node.inputs
        return tuple(x for x, other in ((a, b), (b, a)) if is_scalar_like(other))
    if _is_onnx(node, "Div") and len(node.inputs) == 2 and is_scalar_like(node.inputs[1]):
        return (node.inputs[0],)
    return ()


def _find_score_matmuls(value: ir.Value | None, depth: int = 0) -> list[ir.Node]:
    """Every MatMul reachable upwards from ``value`` through score-side ops only (bounded walk)."""
    node = value.producer() if value is not None else None
    if node is None or depth > _MAX_WALK:
        return []
    if _is_onnx(node, "MatMul"):
        return [node]
    found: list[ir.Node] = []
    for source in _score_sources(node):
        found.extend(m for m in _find_score_matmuls(source, depth + 1) if m not in found)
    return found


def _feeds_value_matmul(probs: ir.Value, depth: int = 0) -> bool:
    """True when the softmax output reaches a MatMul as its first input (P @ V), through Cast/Where/Dropout."""
    for user, index in probs.uses():
        if _is_onnx(user, "MatMul") and index == 0:
            return True
        if depth < 3 and any(_is_onnx(user, op) for op in _PROBS_PASS_THROUGH) and user.outputs:
            if _feeds_value_matmul(user.outputs[0], depth + 1):
                return True
    return False


# An additive mask entry at or below this is a hidden key (HF uses finfo(dtype).min or -inf, 0 for visible keys).
# fp16's finfo.min is -65504, so the threshold is max(-1e30, finfo(dtype).min / 2) per mask dtype.
HIDDEN_BELOW = -1e30


def hidden_threshold(dtype: ir.DataType) -> float:
    """The additive-mask value at or below which a key counts as hidden, for a float mask of ``dtype``."""
    import ml_dtypes  # a dependency of onnx_ir; its finfo also knows bfloat16 / float8

    return max(HIDDEN_BELOW, float(ml_dtypes.finfo(dtype.numpy()).min) / 2)


@dataclasses.dataclass(frozen=True, slots=True)
class ScoreMask:
    """One mask operand of a score chain.

    Attributes:
        kind: ``"additive"`` (float M added to the scores; visible = M > threshold), ``"keep"`` (bool cond of
            ``Where(cond, scores, fill)``: visible = cond) or ``"hide"`` (``Where(cond, fill, scores)``: visible =
            Not(cond)).
        value: the mask value (e.g. [batch, 1, q_len, keys] float or bool; any shape broadcastable to the scores).
    """

    kind: str
    value: ir.Value

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, id(self.value))


def score_masks(match: AttentionMatch) -> list[ScoreMask] | MatchFailure:
    """The mask operands between ``match.anchor`` (the QK MatMul) and its Softmax, in chain order.

    Returns a failure when the chain has no mask (e.g. an ``is_causal`` SDPA exported without a mask) or a mask
    that does not span the key axis (scalar / last dim 1: it cannot say which keys are hidden). Never raises.
    """
    softmax: ir.Node = match.info["softmax"]
    masks = _masks_on_path(softmax.inputs[0], match.anchor)
    if masks is None:
        return fail("the score chain from Softmax to the QK MatMul could not be followed", softmax.name)
    if not masks:
        return fail("no mask (Add or Where) in the score chain: the visible keys per query row are unknown",
                    softmax.name)
    for mask in masks:
        shape = mask.value.shape
        if shape is not None and (len(shape) == 0 or shape[-1] == 1):
            return fail("mask does not span the key axis (last dim 1)", mask.value.name)
        if mask.kind == "additive" and mask.value.dtype is None:
            return fail("additive mask of unknown dtype", mask.value.name)
        if mask.kind != "additive" and mask.value.dtype not in (None, ir.DataType.BOOL):
            return fail("Where condition is not bool", mask.value.dtype)
    return masks


def _masks_on_path(value: ir.Value | None, target: ir.Node, depth: int = 0) -> list[ScoreMask] | None:
    """Masks met walking up from ``value`` to ``target`` through score-side ops; None if ``target`` is not reached."""
    node = value.producer() if value is not None else None
    if node is None or depth > _MAX_WALK:
        return None
    if node is target:
        return []
    if _is_onnx(node, "Add") and len(node.inputs) == 2:
        for i in (0, 1):
            found = _masks_on_path(node.inputs[i], target, depth + 1)
            if found is not None:
                other = node.inputs[1 - i]
                return found if is_scalar_like(other) else found + [ScoreMask("additive", other)]
        return None
    if _is_onnx(node, "Where") and len(node.inputs) == 3:
        for branch, kind in ((1, "keep"), (2, "hide")):
            found = _masks_on_path(node.inputs[branch], target, depth + 1)
            if found is not None:
                return found + [ScoreMask(kind, node.inputs[0])]
        return None
    for source in _score_sources(node):  # Cast, Mul/Div by a scale
        found = _masks_on_path(source, target, depth + 1)
        if found is not None:
            return found
    return None


def _where_fill_visibility(builder: SubgraphBuilder, mask: ir.Value) -> ir.Value | None:
    """For ``M = Where(cond, a, b)`` with constants a visible (> threshold) and b hidden: ``cond`` (or Not(cond)).

    HF / torch build their additive mask this way; reading the bool skips a float compare. None otherwise.
    """
    node = mask.producer()
    if node is None or not _is_onnx(node, "Where") or len(node.inputs) != 3 or mask.dtype is None:
        return None
    consts = [ir.convenience.get_const_tensor(v) for v in node.inputs[1:]]
    if any(c is None or c.size != 1 for c in consts) or node.inputs[0].dtype != ir.DataType.BOOL:
        return None
    threshold = hidden_threshold(mask.dtype)
    a, b = (float(c.numpy().reshape(())) for c in consts)
    if a > threshold >= b:
        return node.inputs[0]
    if b > threshold >= a:
        return builder.op("Not", node.inputs[0])
    return None


def visible_keys_from_masks(builder: SubgraphBuilder, masks: list[ScoreMask]) -> ir.Value:
    """float32 N = ReduceSum(Cast(visible, float32), axes=[-1], keepdims=1), visible = And over the masks.

    Args:
        masks: from :func:`score_masks`, e.g. one [batch, 1, q_len, keys] mask.

    Returns:
        float32 N with the masks' broadcast shape and last dim 1 (e.g. [batch, 1, q_len, 1]); it broadcasts onto
        a query [batch, heads, q_len, head_dim]. A fully hidden row gives N = 0 (beta 1).
    """
    visible = None
    for mask in masks:
        if mask.kind == "keep":
            vis = mask.value
        elif mask.kind == "hide":
            vis = builder.op("Not", mask.value)
        else:
            vis = _where_fill_visibility(builder, mask.value)
            if vis is None:
                threshold = builder.const(np.array(hidden_threshold(mask.value.dtype), dtype=mask.value.dtype.numpy()))
                vis = builder.op("Greater", mask.value, threshold)
        visible = vis if visible is None else builder.op("And", visible, vis)
    as_float = builder.op("Cast", visible, to=int(ir.DataType.FLOAT))
    num_keys = builder.op("ReduceSum", as_float, builder.const(np.array([-1], dtype=np.int64)), keepdims=1)
    num_keys.dtype = ir.DataType.FLOAT
    return num_keys


class DecomposedAttentionQueryScale:
    """Scale Q of every ``MatMul(Q, K^T) -> ... -> Softmax(axis=-1)`` by beta(N), N = K^T.shape[-1]."""

    name = "DecomposedAttentionQueryScale"

    def pattern(self, node: ir.Node) -> AttentionMatch | None:
        """Anchor: a ``Softmax`` whose score chain reaches exactly one ``MatMul``. Never raises."""
        if not _is_onnx(node, "Softmax") or not node.inputs or node.inputs[0] is None:
            return None
        matmuls = _find_score_matmuls(node.inputs[0])
        if len(matmuls) != 1 or len(matmuls[0].inputs) != 2:
            return None
        matmul = matmuls[0]
        keys_t = matmul.inputs[1]  # [..., head_dim, N]
        return AttentionMatch(rule=self.name, anchor=matmul, query_index=0, key_sources=(keys_t,),
                              group_key=_group_key(keys_t), info={"softmax": node})

    def check(self, match: AttentionMatch) -> MatchFailure | None:
        softmax: ir.Node = match.info["softmax"]
        query, keys_t = match.anchor.inputs
        graph = match.anchor.graph
        opset = default_opset(graph) if graph is not None else 0
        if opset < 13:
            return fail("decomposed attention needs default opset >= 13", opset)
        scores_rank = rank_of(softmax.inputs[0], query, keys_t)
        axis = int_attr(softmax, "axis", -1)
        if axis != -1 and (scores_rank is None or axis != scores_rank - 1):
            return fail("Softmax is not over the last (key) axis", axis)
        if query is None or keys_t is None or is_constant(keys_t) or is_constant(query):
            return fail("MatMul has a constant operand (a projection, not Q @ K^T)", match.anchor.name)
        rank = rank_of(keys_t)
        if rank is not None and rank < 3:
            return fail("K^T must be at least [batch, head_dim, N]", rank)
        if not softmax.outputs or not _feeds_value_matmul(softmax.outputs[0]):
            return fail("Softmax output does not feed a MatMul (P @ V)", softmax.name)
        if query.dtype is None and opset < 15:
            return fail("query dtype unknown and CastLike needs opset >= 15", opset)
        return None

    def num_keys(self, match: AttentionMatch, builder: SubgraphBuilder) -> ir.Value:
        """N = K^T.shape[-1] as int64 [1]."""
        return builder.shape_dim(match.anchor.inputs[1], -1)

    def rewrite(self, match: AttentionMatch, shared: SharedBeta, builder: SubgraphBuilder) -> ir.Node:
        """``MatMul(Q, K^T)`` becomes ``MatMul(Mul(Q, beta), K^T)``; returns the inserted ``Mul``."""
        return scale_query(builder, match, shared)


def _group_key(keys_t: ir.Value | None):
    """("keys", dim) when the key dim is known (shared with any attention over that dim), else the K^T value itself."""
    dim = dim_key(keys_t, -1)
    return ("keys", dim) if dim is not None else ("keys_t value", id(keys_t))
