"""Tests of export/rewrite.py: in-graph query scale beta(N) for decomposed attention and ONNX ``Attention``.

Graphs are built in code (onnx.helper); the oracle is numpy float64 attention with :func:`plugins.rule.beta`.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from export.rewrite import (PROFILE_METADATA_KEY, QueryScaleRewriteError, insert_query_scale, remove_query_scale,
                            rewrite_file)
from export.rules import is_query_scale_mul
from plugins.rule import QueryScaleProfile

ATOL, RTOL = 1e-5, 1e-5
HEADS, HEAD_DIM, Q_LEN = 2, 8, 3
SCALE = HEAD_DIM ** -0.5
SMALL = QueryScaleProfile(ref_keys=64, top_k=8)  # small ref so short key lengths already reach beta > 1
DEFAULT = QueryScaleProfile()  # ref_keys 2048
F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64


# ----------------------------------------------------------------------------------------------------------------
# graph builders


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _const(name, array):
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(array), name))


def decomposed_two_layer(with_value_info: bool = True) -> onnx.ModelProto:
    """Two decomposed layers over a shared past length: N = past + q_len (symbolic "past + q_len") for both.

    Layer 0: softmax(q @ K0^T * scale + mask) @ V0.  Layer 1 (torch SDPA decomposition form):
    softmax(Where(keep, (q1 * sqrt(scale)) @ (K1^T * sqrt(scale)), -1e9)) @ V1 with q1 = q + out0.
    Inputs q, k{l}, v{l} [1, H, q_len, D]; past_{k,v}{l} [1, H, past, D]; mask [1, 1, q_len, N] float;
    keep [1, 1, q_len, N] bool.
    """
    n_dim = "past + q_len"
    nodes = [_const("scale", np.array(SCALE, np.float32)), _const("sqrt_scale", np.array(SCALE ** 0.5, np.float32)),
             _const("neg", np.array(-1e9, np.float32))]
    for layer in range(2):
        p = f"l{layer}_"
        nodes += [helper.make_node("Concat", [f"past_k{layer}", f"k{layer}"], [p + "K"], axis=2),
                  helper.make_node("Concat", [f"past_v{layer}", f"v{layer}"], [p + "V"], axis=2),
                  helper.make_node("Transpose", [p + "K"], [p + "KT"], perm=[0, 1, 3, 2])]
    nodes += [helper.make_node("MatMul", ["q", "l0_KT"], ["l0_S"]),
              helper.make_node("Mul", ["l0_S", "scale"], ["l0_Ss"]),
              helper.make_node("Add", ["l0_Ss", "mask"], ["l0_Sm"]),
              helper.make_node("Softmax", ["l0_Sm"], ["l0_P"], axis=-1),
              helper.make_node("MatMul", ["l0_P", "l0_V"], ["out0"]),
              helper.make_node("Add", ["q", "out0"], ["q1"]),
              helper.make_node("Mul", ["q1", "sqrt_scale"], ["q1s"]),
              helper.make_node("Mul", ["l1_KT", "sqrt_scale"], ["l1_KTs"]),
              helper.make_node("MatMul", ["q1s", "l1_KTs"], ["l1_S"]),
              helper.make_node("Where", ["keep", "l1_S", "neg"], ["l1_Sm"]),
              helper.make_node("Cast", ["l1_Sm"], ["l1_Sc"], to=F),
              helper.make_node("Softmax", ["l1_Sc"], ["l1_P"]),
              helper.make_node("MatMul", ["l1_P", "l1_V"], ["out1"])]
    cur, past = [1, HEADS, "q_len", HEAD_DIM], [1, HEADS, "past", HEAD_DIM]
    inputs = [_vi("q", F, cur), _vi("mask", F, [1, 1, "q_len", n_dim]), _vi("keep", B, [1, 1, "q_len", n_dim])]
    for layer in range(2):
        inputs += [_vi(f"k{layer}", F, cur), _vi(f"v{layer}", F, cur),
                   _vi(f"past_k{layer}", F, past), _vi(f"past_v{layer}", F, past)]
    value_info = []
    if with_value_info:  # what torch.onnx (dynamo) records: the concatenated key length as one symbolic dim
        value_info = [_vi(f"l{layer}_KT", F, [1, HEADS, HEAD_DIM, n_dim]) for layer in range(2)]
        value_info += [_vi("l1_KTs", F, [1, HEADS, HEAD_DIM, n_dim]), _vi("q1", F, cur), _vi("q1s", F, cur)]
    graph = helper.make_graph(nodes, "drafter", inputs, [_vi("out1", F, cur)], value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def decomposed_feeds(num_keys: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    past = num_keys - Q_LEN
    feeds = {"q": 3.0 * rng.standard_normal((1, HEADS, Q_LEN, HEAD_DIM))}  # peaky softmax: beta visibly matters
    for layer in range(2):
        feeds |= {f"k{layer}": rng.standard_normal((1, HEADS, Q_LEN, HEAD_DIM)),
                  f"v{layer}": rng.standard_normal((1, HEADS, Q_LEN, HEAD_DIM)),
                  f"past_k{layer}": rng.standard_normal((1, HEADS, past, HEAD_DIM)),
                  f"past_v{layer}": rng.standard_normal((1, HEADS, past, HEAD_DIM))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    feeds["mask"] = np.where(rng.random((1, 1, Q_LEN, num_keys)) < 0.1, -1e4, 0.0).astype(np.float32)
    feeds["keep"] = rng.random((1, 1, Q_LEN, num_keys)) > 0.1
    return feeds


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def decomposed_reference(feeds, profile: QueryScaleProfile) -> np.ndarray:
    """numpy float64: softmax((beta(N) q) K^T * scale [+ mask]) V for both layers; returns out1 [1, H, q_len, D]."""
    f = {k: v.astype(np.float64) if v.dtype != bool else v for k, v in feeds.items()}
    keys = [np.concatenate([f[f"past_k{i}"], f[f"k{i}"]], 2) for i in range(2)]
    values = [np.concatenate([f[f"past_v{i}"], f[f"v{i}"]], 2) for i in range(2)]
    beta = profile.beta(keys[0].shape[2])
    out0 = _softmax((beta * f["q"]) @ keys[0].swapaxes(-1, -2) * SCALE + f["mask"]) @ values[0]
    s1 = (beta * (f["q"] + out0)) @ keys[1].swapaxes(-1, -2) * SCALE
    return _softmax(np.where(f["keep"], s1, -1e9)) @ values[1]


def run(model: onnx.ModelProto | ir.Model, feeds, outputs=None):
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(outputs, {k: v for k, v in feeds.items() if k in names})


def expose_betas(model: ir.Model) -> list[str]:
    """Add the beta input of every query-scale Mul as a graph output; returns their names (graph order)."""
    names = []
    for node in model.graph:
        if is_query_scale_mul(node) and node.inputs[1] not in model.graph.outputs:
            model.graph.outputs.append(node.inputs[1])
            names.append(node.inputs[1].name)
    return names


def rewritten(proto: onnx.ModelProto, profile: QueryScaleProfile) -> tuple[ir.Model, dict[str, int]]:
    model = ir.from_proto(proto)
    counts = insert_query_scale(model, profile)
    onnx.checker.check_model(ir.to_proto(model))
    return model, counts


# ----------------------------------------------------------------------------------------------------------------
# decomposed attention


def test_decomposed_two_layers_share_one_beta_subgraph():
    model, counts = rewritten(decomposed_two_layer(), SMALL)
    assert counts == {"DecomposedAttentionQueryScale": 2, "OnnxAttentionQueryScale": 0,
                      "GroupQueryAttentionQueryScale": 0, "beta_subgraphs": 1, "already_scaled": 0}
    muls = [n for n in model.graph if is_query_scale_mul(n)]
    assert len(muls) == 2 and muls[0].inputs[1] is muls[1].inputs[1]  # one Cast(beta) feeds both Muls
    original = {n.name for n in decomposed_two_layer().graph.node}
    inserted = [n for n in model.graph if n.name not in original]
    assert all(n.name.startswith("sharpdraft/query_scale/") for n in inserted)
    assert {n.metadata_props.get("sharpdraft.role") for n in inserted} == {None, "query_scale"}
    # N comes from a Shape at run time: walk up from the beta Cast and find Shape, not a Constant holding N
    ops, stack = set(), [muls[0].inputs[1].producer()]
    while stack:
        node = stack.pop()
        ops.add(node.op_type)
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None
                     and v.producer().name.startswith("sharpdraft/"))
    assert {"Shape", "Gather", "Sub", "Div", "Max", "Log", "Add", "Min", "Cast"} <= ops
    assert json.loads(model.metadata_props[PROFILE_METADATA_KEY]) == SMALL.to_dict()


@pytest.mark.parametrize("profile, num_keys", [
    (SMALL, 20), (SMALL, 64), (SMALL, 100), (SMALL, 2048), (SMALL, 8192), (SMALL, 40960),
    (DEFAULT, 100), (DEFAULT, 2048), (DEFAULT, 2049), (DEFAULT, 8190),
])
def test_decomposed_matches_numpy_reference(profile, num_keys):
    model, _ = rewritten(decomposed_two_layer(), profile)
    feeds = decomposed_feeds(num_keys)
    (out,) = run(model, feeds)
    np.testing.assert_allclose(out, decomposed_reference(feeds, profile), atol=ATOL, rtol=RTOL)
    if profile.beta(num_keys) > 1.01:  # the scale is visible: the unscaled reference is far off
        unscaled = decomposed_reference(feeds, profile.replace(enabled=False))
        assert np.abs(out - unscaled).max() > 1e-2


def test_decomposed_beta_is_computed_at_run_time():
    """One rewritten model, two key lengths, two betas (N is not folded to the dummy length)."""
    model, _ = rewritten(decomposed_two_layer(), DEFAULT)
    assert len(expose_betas(model)) == 1  # one shared beta
    for num_keys in (2049, 8190, 40960):
        _, beta = run(model, decomposed_feeds(num_keys))
        np.testing.assert_allclose(beta, DEFAULT.beta(num_keys), atol=1e-6, rtol=1e-6)
    assert DEFAULT.beta(2049) < DEFAULT.beta(8190) < DEFAULT.beta(40960)


def test_decomposed_without_shape_info_uses_castlike_and_own_subgraphs():
    """No value_info: key dims unknown -> one beta subgraph per attention; layer 1's query (an intermediate) has no
    dtype -> CastLike; layer 0's query is a typed graph input -> Cast. Numbers still exact."""
    model, counts = rewritten(decomposed_two_layer(with_value_info=False), SMALL)
    assert counts["DecomposedAttentionQueryScale"] == 2 and counts["beta_subgraphs"] == 2
    casts = [n.op_type for n in model.graph if n.op_type in ("Cast", "CastLike") and n.name.startswith("sharpdraft/")]
    assert sorted(casts) == ["Cast", "Cast", "Cast", "CastLike"]  # 2 x Cast(N -> float), Cast(beta), CastLike(beta)
    feeds = decomposed_feeds(300)
    np.testing.assert_allclose(run(model, feeds)[0], decomposed_reference(feeds, SMALL), atol=ATOL, rtol=RTOL)


def test_decomposed_fp16_query_gets_fp16_beta():
    """fp16 scores cast to fp32 for the softmax and back: beta is computed in fp32 and cast to fp16 for the Mul."""
    h = TensorProto.FLOAT16
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Cast", ["s"], ["s32"], to=F),
             helper.make_node("Softmax", ["s32"], ["p32"]),
             helper.make_node("Cast", ["p32"], ["p"], to=h), helper.make_node("MatMul", ["p", "k"], ["y"])]
    dims = [1, HEADS, "n", HEAD_DIM]
    graph = helper.make_graph(nodes, "fp16", [_vi("q", h, [1, HEADS, "q_len", HEAD_DIM]), _vi("k", h, dims)],
                              [_vi("y", h, [1, HEADS, "q_len", HEAD_DIM])],
                              value_info=[_vi("kt", h, [1, HEADS, HEAD_DIM, "n"])])
    model, counts = rewritten(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), SMALL)
    assert counts["DecomposedAttentionQueryScale"] == 1
    (mul,) = [n for n in model.graph if is_query_scale_mul(n)]
    assert mul.inputs[1].producer().attributes["to"].value == ir.DataType.FLOAT16
    rng = np.random.default_rng(2)
    q = (2.0 * rng.standard_normal((1, HEADS, Q_LEN, HEAD_DIM))).astype(np.float16)
    k = rng.standard_normal((1, HEADS, 500, HEAD_DIM)).astype(np.float16)
    beta = np.float16(SMALL.beta(500))  # what the graph multiplies by: beta rounded to fp16
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    expected = _softmax((beta * q64) @ k64.swapaxes(-1, -2)) @ k64
    out = run(model, {"q": q, "k": k})[0].astype(np.float64)
    np.testing.assert_allclose(out, expected, atol=5e-3, rtol=5e-3)
    assert np.abs(out - _softmax(q64 @ k64.swapaxes(-1, -2)) @ k64).max() > 5e-2  # beta = 1 would fail above


def test_unknown_key_dims_share_only_the_same_key_value():
    """Without shape info, two attentions reading the very same K^T value still share one beta subgraph."""
    proto = decomposed_two_layer(with_value_info=False)
    matmul = next(n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] == "l1_KTs")
    matmul.input[1] = "l0_KT"
    model, counts = rewritten(proto, SMALL)
    assert counts["DecomposedAttentionQueryScale"] == 2 and counts["beta_subgraphs"] == 1


def test_rewrite_is_idempotent():
    model, first = rewritten(decomposed_two_layer(), SMALL)
    num_nodes = len(list(model.graph))
    feeds = decomposed_feeds(500)
    (before,) = run(model, feeds)
    second = insert_query_scale(model, SMALL)
    assert second == {"DecomposedAttentionQueryScale": 0, "OnnxAttentionQueryScale": 0,
                      "GroupQueryAttentionQueryScale": 0, "beta_subgraphs": 0, "already_scaled": 2}
    assert len(list(model.graph)) == num_nodes
    np.testing.assert_array_equal(run(model, feeds)[0], before)


def test_remove_query_scale_restores_the_frozen_graph():
    frozen = decomposed_two_layer()
    feeds = decomposed_feeds(3000)  # far above ref_keys: beta > 1, so the scaled output differs
    (want,) = run(frozen, feeds)
    model, _ = rewritten(frozen, SMALL)
    assert not np.allclose(run(model, feeds)[0], want)
    assert remove_query_scale(model) == 2
    assert sorted(n.op_type for n in model.graph) == sorted(n.op_type for n in frozen.graph.node)
    assert PROFILE_METADATA_KEY not in model.metadata_props
    np.testing.assert_array_equal(run(model, feeds)[0], want)
    assert remove_query_scale(model) == 0


def test_rewrite_under_another_profile_raises():
    model, _ = rewritten(decomposed_two_layer(), SMALL)
    with pytest.raises(QueryScaleRewriteError, match="already query-scaled"):
        insert_query_scale(model, DEFAULT)


def test_disabled_profile_records_metadata_and_changes_nothing():
    proto = decomposed_two_layer()
    model, counts = rewritten(proto, SMALL.replace(enabled=False))
    assert set(counts.values()) == {0}
    assert len(list(model.graph)) == len(proto.graph.node)
    assert json.loads(model.metadata_props[PROFILE_METADATA_KEY])["enabled"] is False
    feeds = decomposed_feeds(500)
    np.testing.assert_array_equal(run(model, feeds)[0], run(proto, feeds)[0])
    np.testing.assert_allclose(run(model, feeds)[0], decomposed_reference(feeds, SMALL.replace(enabled=False)),
                               atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------------------------------
# negative cases


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_graph_without_attention_raises():
    proto = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", F, [2, 3])], [_vi("y", F, [2, 3])])
    with pytest.raises(QueryScaleRewriteError, match="no attention to scale"):
        insert_query_scale(ir.from_proto(proto), SMALL)


def test_softmax_not_fed_by_matmul_is_not_attention():
    proto = _model([helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Softmax", ["s"], ["p"]),
                    helper.make_node("MatMul", ["p", "v"], ["y"])],
                   [_vi(n, F, [1, 2, 4, 4]) for n in "abv"], [_vi("y", F, [1, 2, 4, 4])])
    with pytest.raises(QueryScaleRewriteError):
        insert_query_scale(ir.from_proto(proto), SMALL)


def test_classifier_matmul_softmax_is_not_attention():
    """MatMul(x, W) -> Softmax -> MatMul: W is a weight, so this is no Q @ K^T; only the real attention is scaled."""
    weight = onnx.numpy_helper.from_array(np.ones((HEAD_DIM, 5), np.float32), "W")
    classifier = [helper.make_node("MatMul", ["out1", "W"], ["logits"]), helper.make_node("Softmax", ["logits"], ["c"]),
                  helper.make_node("MatMul", ["c", "E"], ["emb"])]
    alone = _model(classifier, [_vi("out1", F, [1, HEADS, Q_LEN, HEAD_DIM]), _vi("E", F, [5, 4])],
                   [_vi("emb", F, [1, HEADS, Q_LEN, 4])], [weight])
    with pytest.raises(QueryScaleRewriteError, match="constant operand"):
        insert_query_scale(ir.from_proto(alone), SMALL)
    proto = decomposed_two_layer()
    proto.graph.node.extend(classifier)
    proto.graph.initializer.append(weight)
    proto.graph.input.append(_vi("E", F, [5, 4]))
    _, counts = rewritten(proto, SMALL)
    assert counts["DecomposedAttentionQueryScale"] == 2  # the classifier softmax counted 0 times


# ----------------------------------------------------------------------------------------------------------------
# ONNX Attention (opset 23 / 24)


def attention_model(*, causal: bool, past: bool, rank: int = 4, q_heads: int = HEADS, kv_heads: int = HEADS,
                    nonpad: bool = False, layers: int = 1) -> onnx.ModelProto:
    """``layers`` chained Attention nodes (layer l+1's Q = layer l's Y) over the same key length.

    4-D: Q [b, q_heads, q_len, D], K/V [b, kv_heads, kv_len, D]; 3-D: Q [b, q_len, q_heads*D], K/V [b, kv_len,
    kv_heads*D] (with q_num_heads / kv_num_heads attrs). past_{key,value} [b, kv_heads, past, D]; nonpad [b] int64.
    """
    def dims(heads, seq):
        return ["b", heads, seq, HEAD_DIM] if rank == 4 else ["b", seq, heads * HEAD_DIM]

    attrs = {"is_causal": int(causal)} | ({"q_num_heads": q_heads, "kv_num_heads": kv_heads} if rank == 3 else {})
    nodes, inputs = [], [_vi("Q", F, dims(q_heads, "q_len"))]
    for layer in range(layers):
        names = [f"Q{layer}" if layer else "Q", f"K{layer}", f"V{layer}", "", f"past_k{layer}" if past else "",
                 f"past_v{layer}" if past else ""] + (["nonpad"] if nonpad else [])
        outs = [f"Q{layer + 1}" if layer + 1 < layers else "Y"] + ([f"present_k{layer}", f"present_v{layer}"] * past)
        nodes.append(helper.make_node("Attention", names, outs, **attrs))
        inputs += [_vi(f"K{layer}", F, dims(kv_heads, "kv_len")), _vi(f"V{layer}", F, dims(kv_heads, "kv_len"))]
        if past:
            inputs += [_vi(f"past_{x}{layer}", F, ["b", kv_heads, "past", HEAD_DIM]) for x in "kv"]
    inputs += [_vi("nonpad", I64, ["b"])] if nonpad else []
    outputs = [_vi("Y", F, dims(q_heads, "q_len"))]
    value_info = [_vi(f"Q{layer}", F, dims(q_heads, "q_len")) for layer in range(1, layers)]
    graph = helper.make_graph(nodes, "attention", inputs, outputs, value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24 if nonpad else 23)])


def attention_feeds(*, q_len, kv_len, past_len=0, rank=4, q_heads=HEADS, kv_heads=HEADS, batch=1, layers=1, seed=0):
    rng = np.random.default_rng(seed)

    def tensor(heads, seq, scale=1.0):
        x = scale * rng.standard_normal((batch, heads, seq, HEAD_DIM)).astype(np.float32)
        return x if rank == 4 else x.transpose(0, 2, 1, 3).reshape(batch, seq, heads * HEAD_DIM)

    feeds = {"Q": tensor(q_heads, q_len, 3.0)}
    for layer in range(layers):
        feeds |= {f"K{layer}": tensor(kv_heads, kv_len), f"V{layer}": tensor(kv_heads, kv_len)}
        if past_len:
            feeds |= {f"past_{x}{layer}": rng.standard_normal((batch, kv_heads, past_len, HEAD_DIM)).astype(np.float32)
                      for x in "kv"}
    return feeds


def _heads(x, heads):  # [b, s, heads*D] -> [b, heads, s, D]; 4-D passes through
    return x if x.ndim == 4 else x.reshape(x.shape[0], x.shape[1], heads, HEAD_DIM).transpose(0, 2, 1, 3)


def attention_reference(feeds, profile, *, causal, q_heads=HEADS, kv_heads=HEADS, nonpad=None, layer=0, q=None):
    """numpy float64 ONNX Attention with beta per row: N_i = min(offset + i + 1, N) (causal) or N (not causal);
    offset = past_len, or nonpad[b] - q_len. Returns Y in the layout of Q."""
    q_in = feeds["Q"] if q is None else q
    qh = _heads(q_in.astype(np.float64), q_heads)
    k = _heads(feeds[f"K{layer}"].astype(np.float64), kv_heads)
    v = _heads(feeds[f"V{layer}"].astype(np.float64), kv_heads)
    if f"past_k{layer}" in feeds:
        k = np.concatenate([feeds[f"past_k{layer}"], k], 2)
        v = np.concatenate([feeds[f"past_v{layer}"], v], 2)
    k, v = np.repeat(k, q_heads // kv_heads, 1), np.repeat(v, q_heads // kv_heads, 1)
    batch, q_len, total = qh.shape[0], qh.shape[2], k.shape[2]
    rows, cols = np.arange(q_len)[None, :, None], np.arange(total)[None, None, :]
    if nonpad is not None:
        offset = (nonpad - q_len)[:, None, None]
        visible = np.broadcast_to(np.minimum(offset + rows + 1, nonpad[:, None, None]) if causal
                                  else nonpad[:, None, None], (batch, q_len, 1))
        allowed = (cols < nonpad[:, None, None]) & ((cols <= offset + rows) if causal else True)
    else:
        offset = total - _heads(feeds[f"K{layer}"], kv_heads).shape[2]  # past_len (0 without a cache)
        visible = np.broadcast_to(np.minimum(offset + rows + 1, total) if causal else total, (batch, q_len, 1))
        allowed = (cols <= offset + rows) if causal else np.ones((1, 1, total), bool)
    beta = profile.beta(np.maximum(visible, 1))[:, None]  # [b, 1, q_len, 1]
    scores = (beta * qh) @ k.swapaxes(-1, -2) * SCALE
    y = _softmax(np.where(allowed[:, None], scores, -np.inf)) @ v
    return y if q_in.ndim == 4 else y.transpose(0, 2, 1, 3).reshape(q_in.shape)


@pytest.mark.parametrize("past_len, kv_len", [(0, 20), (0, 200), (197, 3), (4997, 3)])
def test_onnx_attention_not_causal(past_len, kv_len):
    model, counts = rewritten(attention_model(causal=False, past=past_len > 0), SMALL)
    assert counts == {"DecomposedAttentionQueryScale": 0, "OnnxAttentionQueryScale": 1,
                      "GroupQueryAttentionQueryScale": 0, "beta_subgraphs": 1, "already_scaled": 0}
    feeds = attention_feeds(q_len=Q_LEN, kv_len=kv_len, past_len=past_len)
    np.testing.assert_allclose(run(model, feeds)[0], attention_reference(feeds, SMALL, causal=False),
                               atol=ATOL, rtol=RTOL)


def test_onnx_attention_causal_rows_straddle_ref_keys():
    """q_len 5, past ref-3: rows see N = ref-2 .. ref+2 keys -> beta 1, 1, 1, beta(ref+1), beta(ref+2)."""
    model, _ = rewritten(attention_model(causal=True, past=True), DEFAULT)
    assert len(expose_betas(model)) == 1  # one shared beta
    ref = DEFAULT.ref_keys
    feeds = attention_feeds(q_len=5, kv_len=5, past_len=ref - 3)
    y, beta = run(model, feeds)
    expected = [1.0, 1.0, 1.0, DEFAULT.beta(ref + 1), DEFAULT.beta(ref + 2)]
    assert beta.shape == (5, 1)
    np.testing.assert_allclose(beta[:, 0], expected, atol=1e-6, rtol=1e-6)
    assert beta[3, 0] > 1.0
    np.testing.assert_allclose(y, attention_reference(feeds, DEFAULT, causal=True), atol=ATOL, rtol=RTOL)
    feeds = attention_feeds(q_len=2, kv_len=2, past_len=4 * ref)  # same model, other N
    y, beta = run(model, feeds)
    np.testing.assert_allclose(beta[:, 0], DEFAULT.beta([4 * ref + 1, 4 * ref + 2]), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(y, attention_reference(feeds, DEFAULT, causal=True), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("q_len, kv_len", [(6, 6), (4, 6), (6, 4)])
def test_onnx_attention_causal_without_cache(q_len, kv_len):
    """No past: the causal frontier is top-left (offset 0), so row i sees min(i + 1, kv_len) keys."""
    profile = QueryScaleProfile(ref_keys=3, top_k=1)
    model, _ = rewritten(attention_model(causal=True, past=False), profile)
    feeds = attention_feeds(q_len=q_len, kv_len=kv_len)
    np.testing.assert_allclose(run(model, feeds)[0], attention_reference(feeds, profile, causal=True),
                               atol=ATOL, rtol=RTOL)


def test_onnx_attention_3d_gqa_causal_with_cache():
    model, counts = rewritten(attention_model(causal=True, past=True, rank=3, q_heads=4, kv_heads=2), SMALL)
    assert counts["OnnxAttentionQueryScale"] == 1
    feeds = attention_feeds(q_len=4, kv_len=4, past_len=100, rank=3, q_heads=4, kv_heads=2)
    np.testing.assert_allclose(run(model, feeds)[0],
                               attention_reference(feeds, SMALL, causal=True, q_heads=4, kv_heads=2),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rank", [4, 3])
def test_onnx_attention_nonpad_kv_seqlen_per_batch(causal, rank):
    """opset 24 external cache: batch rows with 200 and 40 valid keys get different betas."""
    model, _ = rewritten(attention_model(causal=causal, past=False, rank=rank, nonpad=True), SMALL)
    feeds = attention_feeds(q_len=Q_LEN, kv_len=200, rank=rank, batch=2)
    feeds["nonpad"] = np.array([200, 40], np.int64)
    np.testing.assert_allclose(run(model, feeds)[0],
                               attention_reference(feeds, SMALL, causal=causal, nonpad=feeds["nonpad"]),
                               atol=ATOL, rtol=RTOL)


def test_onnx_attention_layers_share_beta_and_rewrite_is_idempotent():
    model, counts = rewritten(attention_model(causal=True, past=True, layers=2), SMALL)
    assert counts["OnnxAttentionQueryScale"] == 2 and counts["beta_subgraphs"] == 1
    num_nodes = len(list(model.graph))
    assert insert_query_scale(model, SMALL)["already_scaled"] == 2 and len(list(model.graph)) == num_nodes
    feeds = attention_feeds(q_len=Q_LEN, kv_len=Q_LEN, past_len=300, layers=2)
    y0 = attention_reference(feeds, SMALL, causal=True)
    y1 = attention_reference(feeds, SMALL, causal=True, layer=1, q=y0)
    np.testing.assert_allclose(run(model, feeds)[0], y1, atol=ATOL, rtol=RTOL)


def test_sliding_window_attention_is_rejected():
    proto = attention_model(causal=True, past=False)
    proto.graph.node[0].attribute.append(helper.make_attribute("left_window_size", 16))
    with pytest.raises(QueryScaleRewriteError, match="sliding-window"):
        insert_query_scale(ir.from_proto(proto), SMALL)


# ----------------------------------------------------------------------------------------------------------------
# com.microsoft GroupQueryAttention

GQA_HEADS, GQA_KV_HEADS = 4, 2


def gqa_model(layers: int = 2) -> onnx.ModelProto:
    """``layers`` chained GroupQueryAttention nodes: q [b, s, 4*D], k/v [b, s, 2*D], past [b, 2, past, D]."""
    nodes, inputs = [], [_vi("Q", F, ["b", "s", GQA_HEADS * HEAD_DIM]), _vi("seqlens_k", TensorProto.INT32, ["b"]),
                         _vi("total", TensorProto.INT32, [])]
    for layer in range(layers):
        names = [f"Q{layer}" if layer else "Q", f"K{layer}", f"V{layer}", f"past_k{layer}", f"past_v{layer}",
                 "seqlens_k", "total"]
        outs = [f"Q{layer + 1}" if layer + 1 < layers else "Y", f"present_k{layer}", f"present_v{layer}"]
        nodes.append(helper.make_node("GroupQueryAttention", names, outs, domain="com.microsoft",
                                      num_heads=GQA_HEADS, kv_num_heads=GQA_KV_HEADS))
        inputs += [_vi(f"{x}{layer}", F, ["b", "s", GQA_KV_HEADS * HEAD_DIM]) for x in "KV"]
        inputs += [_vi(f"past_{x}{layer}", F, ["b", GQA_KV_HEADS, "past", HEAD_DIM]) for x in "kv"]
    value_info = [_vi(f"Q{layer}", F, ["b", "s", GQA_HEADS * HEAD_DIM]) for layer in range(1, layers)]
    graph = helper.make_graph(nodes, "gqa", inputs, [_vi("Y", F, ["b", "s", GQA_HEADS * HEAD_DIM])],
                              value_info=value_info)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def gqa_reference(feeds, profile, layer, q, first_prompt):
    """numpy float64 GroupQueryAttention (ORT semantics) with beta per batch and row; q [b, s, 4*D]."""
    batch, q_len, _ = q.shape
    qh = _heads(q.astype(np.float64), GQA_HEADS)
    kh, vh = (_heads(feeds[f"{x}{layer}"].astype(np.float64), GQA_KV_HEADS) for x in "KV")
    out = np.zeros_like(qh)
    for b in range(batch):
        total = int(feeds["seqlens_k"][b]) + 1
        past = 0 if first_prompt else total - q_len
        k = np.repeat(np.concatenate([feeds[f"past_k{layer}"][b, :, :past], kh[b]], 1), GQA_HEADS // GQA_KV_HEADS, 0)
        v = np.repeat(np.concatenate([feeds[f"past_v{layer}"][b, :, :past], vh[b]], 1), GQA_HEADS // GQA_KV_HEADS, 0)
        rows, cols = np.arange(q_len)[:, None], np.arange(k.shape[1])[None, :]
        beta = profile.beta(np.minimum(past + rows + 1, total))  # [q_len, 1]
        scores = (beta * qh[b]) @ k.swapaxes(-1, -2) * SCALE
        out[b] = _softmax(np.where((cols <= past + rows) & (cols < total), scores, -np.inf)) @ v
    return out.transpose(0, 2, 1, 3).reshape(q.shape)


@pytest.mark.parametrize("case", ["decode_batch2", "subsequent_prompt", "first_prompt_padded"])
def test_group_query_attention(case):
    """ORT CPU GQA: decode at batch 2 (seqlens_k 10 and 7), a 3-token subsequent prompt, a right-padded prompt."""
    profile = QueryScaleProfile(ref_keys=4, top_k=1)
    model, counts = rewritten(gqa_model(), profile)
    assert counts["GroupQueryAttentionQueryScale"] == 2 and counts["beta_subgraphs"] == 1
    batch, q_len, past, seqlens, total = {"decode_batch2": (2, 1, 10, [10, 7], 11),
                                          "subsequent_prompt": (1, 3, 10, [12], 13),
                                          "first_prompt_padded": (2, 8, 0, [7, 5], 8)}[case]
    rng = np.random.default_rng(3)
    feeds = {"Q": 3.0 * rng.standard_normal((batch, q_len, GQA_HEADS * HEAD_DIM)),
             "seqlens_k": np.array(seqlens, np.int32), "total": np.array(total, np.int32)}
    for layer in range(2):
        feeds |= {f"{x}{layer}": rng.standard_normal((batch, q_len, GQA_KV_HEADS * HEAD_DIM)) for x in "KV"}
        feeds |= {f"past_{x}{layer}": rng.standard_normal((batch, GQA_KV_HEADS, past, HEAD_DIM)) for x in "kv"}
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    y0 = gqa_reference(feeds, profile, 0, feeds["Q"], first_prompt=case == "first_prompt_padded")
    y1 = gqa_reference(feeds, profile, 1, y0, first_prompt=case == "first_prompt_padded")
    out = run(model, feeds, ["Y"])[0]
    for b, valid in enumerate(np.array(seqlens) + 1):  # padded rows of a first prompt are garbage in ORT too
        rows = min(valid, q_len) if case == "first_prompt_padded" else q_len
        np.testing.assert_allclose(out[b, :rows], y1[b, :rows], atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------------------------------
# what torch.onnx (dynamo) really emits


@pytest.mark.parametrize("form, opset, rule, num_subgraphs", [
    ("explicit", 18, "DecomposedAttentionQueryScale", 1),
    ("sdpa", 18, "DecomposedAttentionQueryScale", 2),  # torch reshapes K to 3-D: its length dim is lost -> 2
    ("sdpa", 23, "OnnxAttentionQueryScale", 1),
])
def test_torch_dynamo_export_forms(form, opset, rule, num_subgraphs):
    """Two layers, each over cat(past_l, k_l) with one dynamic past length; beta(past + q_len) for both."""
    torch = pytest.importorskip("torch")

    def attend(q, k, v, beta=1.0):
        if form == "sdpa" and beta == 1.0:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.softmax(beta * q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v

    class TwoLayers(torch.nn.Module):
        def forward(self, q, past0, k0, past1, k1, beta=1.0):
            keys0, keys1 = torch.cat([past0, k0], 2), torch.cat([past1, k1], 2)
            return attend(q + attend(q, keys0, keys0, beta), keys1, keys1, beta)

    gen = torch.Generator().manual_seed(0)
    q, k0, k1 = (torch.randn(1, HEADS, Q_LEN, HEAD_DIM, generator=gen) * s for s in (3.0, 1.0, 1.0))
    past = torch.export.Dim("past", min=2, max=1 << 17)
    dummy = torch.randn(1, HEADS, 64, HEAD_DIM)
    program = torch.onnx.export(TwoLayers(), (q, dummy, k0, dummy.clone(), k1), dynamo=True, opset_version=opset,
                                dynamic_shapes=({}, {2: past}, {}, {2: past}, {}), verbose=False)
    model = ir.from_proto(program.model_proto)
    counts = insert_query_scale(model, SMALL)
    assert counts[rule] == 2 and counts["beta_subgraphs"] == num_subgraphs
    for past_len in (200, 5000):
        args = (q, torch.randn(1, HEADS, past_len, HEAD_DIM, generator=gen), k0,
                torch.randn(1, HEADS, past_len, HEAD_DIM, generator=gen), k1)
        with torch.no_grad():
            expected = TwoLayers()(*args, beta=SMALL.beta(past_len + Q_LEN)).numpy()
        names = [i.name for i in program.model_proto.graph.input]
        (out,) = run(model, {name: t.numpy() for name, t in zip(names, args)})
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# files


def test_rewrite_file_round_trip_with_external_data(tmp_path):
    """q = x @ Wq with Wq an external initializer; rewrite src -> dst, check, run, and rewrite dst again (no-op)."""
    proto = decomposed_two_layer()
    rng = np.random.default_rng(1)
    wq = rng.standard_normal((16, HEAD_DIM)).astype(np.float32)  # 512 bytes: goes to external data
    proto.graph.initializer.append(onnx.numpy_helper.from_array(wq, "Wq"))
    proto.graph.node.insert(0, helper.make_node("MatMul", ["x", "Wq"], ["q"]))
    q_input = next(i for i in proto.graph.input if i.name == "q")
    proto.graph.input.remove(q_input)
    proto.graph.input.append(_vi("x", F, [1, HEADS, "q_len", 16]))
    proto.graph.value_info.append(q_input)
    src, dst = tmp_path / "src" / "drafter.onnx", tmp_path / "dst" / "drafter.onnx"
    src.parent.mkdir()
    ir.save(ir.from_proto(proto), src, external_data="drafter.onnx.data")
    assert (src.parent / "drafter.onnx.data").stat().st_size == wq.nbytes

    counts = rewrite_file(src, dst, SMALL)
    assert counts["DecomposedAttentionQueryScale"] == 2 and counts["beta_subgraphs"] == 1
    assert (dst.parent / "drafter.onnx.data").exists()
    onnx.checker.check_model(str(dst))
    saved = onnx.load(str(dst), load_external_data=False)
    assert json.loads({p.key: p.value for p in saved.metadata_props}[PROFILE_METADATA_KEY]) == SMALL.to_dict()
    assert saved.graph.initializer[0].data_location == TensorProto.EXTERNAL

    feeds = decomposed_feeds(700)
    feeds["x"] = rng.standard_normal((1, HEADS, Q_LEN, 16)).astype(np.float32)
    feeds["q"] = feeds["x"] @ wq
    session = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    np.testing.assert_allclose(out, decomposed_reference(feeds, SMALL), atol=ATOL, rtol=RTOL)

    again = rewrite_file(dst, dst, SMALL)  # the tag survives serialization: nothing inserted
    assert again["already_scaled"] == 2 and again["beta_subgraphs"] == 0
    assert len(onnx.load(str(dst), load_external_data=False).graph.node) == len(saved.graph.node)
