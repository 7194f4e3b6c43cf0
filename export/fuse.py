"""Emit SharpDraft's fused attention node ``sharpdraft::QueryScaledAttention`` into a drafter ONNX graph.

TensorRT users get the query scale fused *into* attention (the OpenAI Triton kernel of plugins/triton_attention.py,
registered with TensorRT by plugins/tensorrt_plugin.py) instead of the portable form (a ``Mul`` on Q fed by an
in-graph beta subgraph, export/rewrite.py). This pass rewrites the **frozen** drafter graph (no beta subgraph):

    Softmax(Where(Not(mask), -inf, MatMul(Q, Transpose(K_rep)) * scale)) @ V_rep
        K_rep = Reshape(Expand(Unsqueeze(K, 2)))   (repeat_interleave of GQA; optional)
becomes
    QueryScaledAttention(Q, K, V, kv_lens, key_mask)          domain "sharpdraft", version 1

Node contract (the TensorRT plugin, the torch op and the validation op all follow it):
    inputs   q        [batch, heads, q_len, head_dim]   float (fp32/fp16/bf16)
             k, v     [batch, kv_heads, kv_len, head_dim] same dtype; heads % kv_heads == 0
             kv_lens  [batch] int32, keys present per row (here every row: kv_len)
             key_mask [batch, kv_len] int32, nonzero = visible (ragged rows' padding holes are 0)
    output   [batch, heads, q_len, head_dim], q's dtype
    attrs    ref_keys, top_k (int), slope, cap (float), enabled, causal, window (int; window 0 = none),
             scale (float softmax scale), plugin_namespace = "sharpdraft" and aot = 1 (read by TensorRT's ONNX
             parser: the plugin's namespace and its ahead-of-time implementation)
    N of query row i = visible keys it sees (key_mask, causal, window); beta = plugins.rule.beta(N).

Only what can be proven from the graph is fused: a non-causal key-mask attention (DFlash blocks), and a DFlash
sliding layer's, whose mask is ``And(key_pos > query_pos - W, key mask)`` with key positions ``Concat(arange(cache
length), position_ids)`` and query positions the block's slice of ``position_ids`` (runtime/models/dflash.py
``window_mask``): that site gets ``window = W``, which the op anchors at each block query's position with positions
taken as ranks of the visible keys (plugins/attention_ref.py), equal to the drafter's positions when each row's
visible keys are positions 0..N-1 in order, as the runtime lays out a ragged batch. An additive mask, a causal mask
or a scale that is not a constant scalar makes the site be reported as not fusable, with the reason.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from export.rules.base import is_query_scale_mul
from plugins.attention_ref import DOMAIN, OP_TYPE, OP_VERSION, PLUGIN_NAME  # noqa: F401  (re-used by callers)
from plugins.rule import QueryScaleProfile

logger = logging.getLogger(__name__)

_NEG_INF_BELOW = -1e30  # a Where branch at or below this is the "hidden key" value


class FusionError(RuntimeError):
    """The graph has no attention this pass can fuse; the message lists each candidate and why it was skipped."""


@dataclasses.dataclass(slots=True)
class _Site:
    softmax: ir.Node
    qk: ir.Node
    pv: ir.Node
    q: ir.Value
    k: ir.Value
    v: ir.Value
    scale: float
    window: int = 0  # a sliding layer's W (0: full attention)


def _onnx(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _const_scalar(value: ir.Value | None) -> float | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return float(np.asarray(tensor.numpy()).reshape(()))


def _through(value: ir.Value, *ops: str) -> ir.Value:
    """``value`` followed up through producers of types ``ops`` (each with the data as its first input)."""
    for _ in range(8):
        node = value.producer()
        if not any(_onnx(node, op) for op in ops):
            return value
        value = node.inputs[0]
    return value


def _is_position_ids(value: ir.Value, graph_input: ir.Value | None) -> bool:
    return graph_input is not None and value is graph_input


def _window_of(cond: ir.Value, positions: ir.Value | None) -> int | str:
    """W if ``cond`` is DFlash's sliding-window test ``key_pos > query_pos - W``, else why it is not.

    runtime/models/dflash.py ``window_mask``: key positions = ``Concat(arange(c_past), position_ids)`` along the key
    axis (the cache holds positions 0..c_past-1, then the new context rows and the block), query positions = the
    block's slice of ``position_ids``; both through Unsqueeze/Expand/Cast.
    """
    gt = cond.producer()
    if not _onnx(gt, "Greater"):
        return "its extra condition is not Greater(key positions, query positions - W)"
    key_pos, shifted = gt.inputs
    sub = _through(shifted, "Cast").producer()
    w = _const_scalar(sub.inputs[1]) if _onnx(sub, "Sub") else None
    if w is None or w < 1 or w != int(w):
        return "the window test is not Greater(key positions, Sub(query positions, constant W >= 1))"
    q_slice = _through(sub.inputs[0], "Unsqueeze", "Cast").producer()
    if not (_onnx(q_slice, "Slice") and _is_position_ids(q_slice.inputs[0], positions)):
        return "the window's query positions are not a slice of position_ids"
    cat = _through(key_pos, "Unsqueeze", "Cast").producer()
    if not (_onnx(cat, "Concat") and len(cat.inputs) == 2 and _is_position_ids(cat.inputs[1], positions)):
        return "the window's key positions are not Concat(arange(cache length), position_ids)"
    rng = _through(cat.inputs[0], "Expand", "Unsqueeze", "Cast").producer()
    if not (_onnx(rng, "Range") and _const_scalar(rng.inputs[0]) == 0 and _const_scalar(rng.inputs[2]) == 1):
        return "the window's cache positions are not Range(0, cache length, 1)"
    return int(w)


def _mask_source(cond: ir.Value, mask_input: ir.Value, positions: ir.Value | None = None,
                 allow_window: bool = True) -> tuple[int, int] | str:
    """``(number of Not, window W or 0)`` between ``cond`` and ``mask_input`` (through Cast/Unsqueeze, a Gather of
    index 0 on an unsqueezed axis, and at most one ``And`` with DFlash's window test), or why it is not a key
    mask."""
    nots, value, window = 0, cond, 0
    for _ in range(12):
        if value is mask_input:
            return nots, window
        node = value.producer()
        if _onnx(node, "Not"):
            nots += 1
        elif _onnx(node, "And") and allow_window and window == 0:
            reasons = []
            for m, c in ((0, 1), (1, 0)):
                inner = _mask_source(node.inputs[m], mask_input, positions, allow_window=False)
                if isinstance(inner, str) or inner[0]:
                    reasons.append(inner if isinstance(inner, str) else "a Not inside the And")
                    continue
                w = _window_of(node.inputs[c], positions)
                if isinstance(w, str):
                    return w
                window = w
                value = node.inputs[m]
                break
            else:
                return f"And {node.name!r}: neither side is the key mask ({reasons[0]})"
            continue
        elif _onnx(node, "Gather"):
            idx, data = _const_scalar(node.inputs[1]), node.inputs[0].producer()
            axis = int(node.attributes["axis"].value) if "axis" in node.attributes else 0
            axes = ir.convenience.get_const_tensor(data.inputs[1]) if _onnx(data, "Unsqueeze") else None
            if idx != 0 or axes is None or axis not in np.asarray(axes.numpy()).reshape(-1).tolist():
                return f"Gather {node.name!r} is not index 0 of an unsqueezed axis"
        elif not (_onnx(node, "Cast") or _onnx(node, "Unsqueeze")):
            return f"{node.op_type if node else 'graph input ' + repr(value.name)} in the mask path"
        value = node.inputs[0]
    return "the mask path is longer than 12 ops"


def _unrepeat(value: ir.Value) -> ir.Value:
    """K/V before GQA's repeat_interleave (``Reshape(Expand(Unsqueeze(x, 2)))``), or ``value`` itself."""
    reshape = value.producer()
    if not _onnx(reshape, "Reshape"):
        return value
    expand = reshape.inputs[0].producer()
    if not _onnx(expand, "Expand"):
        return value
    unsq = expand.inputs[0].producer()
    if not _onnx(unsq, "Unsqueeze") or len(unsq.inputs) < 2:
        return value
    axes = ir.convenience.get_const_tensor(unsq.inputs[1])
    if axes is None or np.asarray(axes.numpy()).reshape(-1).tolist() != [2]:
        return value
    return unsq.inputs[0]


def _match(softmax: ir.Node, mask_input: ir.Value, positions: ir.Value | None = None) -> _Site | str:
    """A fusable site, or the reason it is not one."""
    axis = softmax.attributes.get("axis")
    if axis is not None and int(axis.value) not in (-1, 3):
        return "Softmax is not over the key axis"
    scores, scale, masked, window = softmax.inputs[0], 1.0, False, 0
    for _ in range(6):
        node = scores.producer()
        if _onnx(node, "MatMul"):
            break
        if _onnx(node, "Where"):
            cond, a, b = node.inputs
            src = _mask_source(cond, mask_input, positions)
            if isinstance(src, str):
                return f"Where {node.name!r}: its condition is not a key mask of {mask_input.name!r}: {src}"
            nots, window = src
            hidden, kept = (a, b) if nots % 2 else (b, a)
            fill = _const_scalar(hidden)
            if fill is None or fill > _NEG_INF_BELOW:
                return f"Where {node.name!r}: hidden keys are not set to -inf"
            scores, masked = kept, True
        elif _onnx(node, "Mul") or _onnx(node, "Div"):
            x, y = node.inputs
            c = _const_scalar(y)
            if c is None and _onnx(node, "Mul"):
                x, c = y, _const_scalar(x)
            if c is None:
                return f"{node.op_type} {node.name!r} is not a constant scalar scale"
            scale *= c if _onnx(node, "Mul") else 1.0 / c
            scores = x
        elif _onnx(node, "Cast"):
            scores = node.inputs[0]
        else:
            return f"{node.op_type if node else 'graph input'} between Q @ K^T and Softmax (additive or causal " \
                   "masks are not fused: keep the portable Mul form)"
    else:
        return "no Q @ K^T MatMul within 6 ops of the Softmax"
    qk = node
    if not masked:
        return "no key mask on the scores"
    trans = qk.inputs[1].producer()
    perm = trans.attributes.get("perm") if _onnx(trans, "Transpose") else None
    if perm is None or list(perm.value) != [0, 1, 3, 2]:
        return "K^T is not Transpose(K, perm=[0, 1, 3, 2])"
    users = list(softmax.outputs[0].uses())
    if len(users) != 1 or not _onnx(users[0][0], "MatMul") or users[0][1] != 0:
        return "Softmax output does not feed exactly one P @ V MatMul"
    pv = users[0][0]
    q = qk.inputs[0]
    if is_query_scale_mul(q.producer()):
        return "the query is already scaled by export/rewrite.py: fuse the frozen graph instead"
    if q.shape is None or len(q.shape) != 4:
        return f"Q must be rank 4 [batch, heads, q_len, head_dim], got {q.shape}"
    return _Site(softmax, qk, pv, q, _unrepeat(trans.inputs[0]), _unrepeat(pv.inputs[1]), scale, window)


def fuse_attention(model: ir.Model, profile: QueryScaleProfile, key_mask_input: str = "attention_mask",
                   positions_input: str = "position_ids") -> int:
    """Replace every key-mask attention of a frozen drafter graph by one ``sharpdraft::QueryScaledAttention`` node.

    Args:
        model: the frozen drafter graph (export/graphs.py, before export/rewrite.py); modified in place.
        profile: the query-scale constants written into each node's attributes (``enabled`` included).
        key_mask_input: name of the graph input ``[batch, keys]`` (1 = visible) the attention masks come from.
        positions_input: name of the graph input ``[batch, c_new + B]`` (positions of the new context rows and the
            block) a sliding layer's window test reads; such a layer is fused with its ``window`` attribute.
    Returns:
        the number of attentions fused.
    Raises:
        FusionError: ``key_mask_input`` is not a graph input, or no attention could be fused (every candidate and
            the reason it was skipped are listed).
    """
    graph = model.graph
    mask_input = next((v for v in graph.inputs if v.name == key_mask_input), None)
    if mask_input is None:
        raise FusionError(f"{key_mask_input!r} is not an input of graph {graph.name!r}; the fused node needs the key "
                          f"mask (inputs: {[v.name for v in graph.inputs]})")
    positions = next((v for v in graph.inputs if v.name == positions_input), None)
    graph.sort()
    sites, skipped = [], []
    for node in list(graph):
        if _onnx(node, "Softmax"):
            site = _match(node, mask_input, positions)
            (sites if isinstance(site, _Site) else skipped).append(site if isinstance(site, _Site)
                                                                   else f"{node.name!r}: {site}")
    if not sites:
        raise FusionError("no attention to fuse:\n  " + "\n  ".join(skipped or ["no Softmax in the graph"]))
    for reason in skipped:
        logger.warning("not fused: %s", reason)
    first = next(iter(graph))
    mask_i32 = ir.node("Cast", [mask_input], {"to": int(ir.DataType.INT32)}, name="sharpdraft/fused/key_mask")
    batch = ir.node("Shape", [mask_input], {"start": 0, "end": 1}, name="sharpdraft/fused/batch")
    graph.insert_before(first, [mask_i32, batch])
    for i, s in enumerate(sites):
        pre = f"sharpdraft/fused/{i}"
        kv_len = ir.node("Shape", [s.k], {"start": 2, "end": 3}, name=f"{pre}/kv_len")
        kv_len32 = ir.node("Cast", [kv_len.outputs[0]], {"to": int(ir.DataType.INT32)}, name=f"{pre}/kv_len_i32")
        kv_lens = ir.node("Expand", [kv_len32.outputs[0], batch.outputs[0]], name=f"{pre}/kv_lens")
        attrs = {"ref_keys": int(profile.ref_keys), "top_k": int(profile.top_k), "slope": float(profile.slope),
                 "cap": float(profile.cap), "enabled": int(profile.enabled), "causal": 0, "window": int(s.window),
                 "scale": float(s.scale), "plugin_namespace": DOMAIN, "aot": 1}
        fused = ir.node(OP_TYPE, [s.q, s.k, s.v, kv_lens.outputs[0], mask_i32.outputs[0]], attrs, domain=DOMAIN,
                        version=OP_VERSION, name=f"{pre}/{OP_TYPE}", num_outputs=1)
        out = s.pv.outputs[0]
        fused.outputs[0].name = f"{pre}/out"
        fused.outputs[0].shape, fused.outputs[0].type = out.shape, out.type
        graph.insert_before(s.pv, [kv_len, kv_len32, kv_lens, fused])
        ir.convenience.replace_all_uses_with(out, fused.outputs[0])
        if out in graph.outputs:  # keep graph output names
            graph.outputs[graph.outputs.index(out)] = fused.outputs[0]
            fused.outputs[0].name, out.name = out.name, out.name + "/unfused"
    graph.opset_imports[DOMAIN] = OP_VERSION
    RemoveUnusedNodesPass()(model)
    TopologicalSortPass()(model)
    logger.info("fused %d attention(s) into %s", len(sites), PLUGIN_NAME)
    return len(sites)


def fuse_file(src: Path, dst: Path, profile: QueryScaleProfile, key_mask_input: str = "attention_mask",
              positions_input: str = "position_ids") -> int:
    """Load the frozen drafter ``src``, :func:`fuse_attention`, save to ``dst`` (+ ``dst.data``) and check it.

    Raises:
        FusionError: see :func:`fuse_attention`.
        onnx.checker.ValidationError: the result is not valid ONNX.
    """
    model = ir.load(Path(src))
    n = fuse_attention(model, profile, key_mask_input, positions_input)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, dst, external_data=dst.name + ".data")
    onnx.checker.check_model(str(dst))
    return n


def fused_windows(path: Path) -> list[int]:
    """The ``window`` attribute of every fused node of the graph at ``path``, in graph order (0 = full attention)."""
    model = onnx.load(str(path), load_external_data=False)
    return [int(node_attributes(n)["window"]) for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def node_attributes(node: onnx.NodeProto) -> dict:
    """The attributes of a fused node as Python values (``{"ref_keys": 2048, "slope": 5.0, ...}``)."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def profile_of(attrs: dict) -> QueryScaleProfile:
    """The :class:`QueryScaleProfile` a fused node's attributes describe."""
    return QueryScaleProfile(ref_keys=int(attrs["ref_keys"]), top_k=int(attrs["top_k"]), slope=float(attrs["slope"]),
                             cap=float(attrs["cap"]), enabled=bool(attrs["enabled"]))

