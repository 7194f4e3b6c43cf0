"""Per-query-row beta for causal drafters: ``insert_query_scale(..., num_keys_from="score_mask")``.

The graph counts, per query row, the keys the attention's own mask leaves visible. Oracles: the torch model run with
``runtime/models/hf_query_scale.py`` (attention ``sharpdraft_eager``), each row's solo run, the frozen graph, and
numpy float64 attention with :func:`plugins.rule.beta`.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from export.rewrite import MODE_METADATA_KEY, QueryScaleRewriteError, insert_query_scale
from export.rules import is_query_scale_mul
from plugins.rule import QueryScaleProfile
from runtime.models.hf_query_scale import ATTN_IMPLEMENTATION, query_scale, visible_keys

PROFILE = QueryScaleProfile(ref_keys=16, top_k=8)  # rows at N = 14..18 straddle ref_keys
SWITCH = "query_scale_enabled"
LOGIT_ATOL = 2e-4
F, B, I64 = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64


# ----------------------------------------------------------------------------------------------------------------
# the tiny Llama target exported as a causal drafter graph (flat KV, HF's own mask)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from export.graphs import TargetForExport, export_target

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("causal") / "frozen.onnx"
    export_target(model, [0], path, kv_io="concat")  # HF forward (sdpa) -> decomposed MatMul/Softmax, opset 18
    reference = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32,
                                                     attn_implementation=ATTN_IMPLEMENTATION).eval()
    frozen = ir.load(path)
    ir.external_data.load_to_model(frozen)  # weights in memory: copies and sessions are built from bytes
    return {"frozen": frozen, "torch": TargetForExport(reference, [0]).eval(),
            "layers": model.config.num_hidden_layers, "kv_heads": model.config.num_key_value_heads,
            "head_dim": model.config.head_dim, "vocab": model.config.vocab_size}


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _expose_betas(model: ir.Model) -> str:
    """Make the (one, shared) beta feeding every query-scale Mul a graph output; returns its name."""
    betas = {id(n.inputs[1]): n.inputs[1] for n in model.graph if is_query_scale_mul(n)}
    assert len(betas) == 1, "all layers read one mask, so one beta"
    (beta,) = betas.values()
    model.graph.outputs.append(beta)
    return beta.name


@pytest.fixture(scope="module")
def graphs(tiny):
    """Sessions: frozen, scaled (beta exposed), scaled with a per-row switch."""
    scaled = _copy(tiny["frozen"])
    counts = insert_query_scale(scaled, PROFILE, num_keys_from="score_mask")
    beta_name = _expose_betas(scaled)
    switched = _copy(tiny["frozen"])
    insert_query_scale(switched, PROFILE, row_switch_input=SWITCH, num_keys_from="score_mask")
    return {"counts": counts, "scaled_ir": scaled, "beta": beta_name, "frozen": _session(tiny["frozen"]),
            "scaled": _session(scaled), "switched": _session(switched)}


def _feeds(tiny, valid: list[int], slots: int, q_len: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    """Batch of len(valid) rows over a right-padded cache of ``slots`` positions (row b: ``valid[b]`` real keys,
    then zeros of attention_mask on the padding), then q_len new tokens at positions valid[b] .. valid[b]+q_len-1."""
    rng = np.random.default_rng(seed)
    batch = len(valid)
    feeds = {"input_ids": rng.integers(0, tiny["vocab"], (batch, q_len)).astype(np.int64),
             "position_ids": np.stack([np.arange(v, v + q_len) for v in valid]).astype(np.int64),
             "attention_mask": np.zeros((batch, slots + q_len), dtype=np.int64)}
    for b, v in enumerate(valid):
        feeds["attention_mask"][b, :v] = 1
    feeds["attention_mask"][:, slots:] = 1
    for i in range(tiny["layers"]):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = rng.standard_normal(
                (batch, tiny["kv_heads"], slots, tiny["head_dim"])).astype(np.float32)
    return feeds


def _solo(tiny, feeds, b: int, valid: int) -> dict[str, np.ndarray]:
    """Row b alone, its cache cut to its ``valid`` real keys (no padding at all)."""
    solo = {k: v[b:b + 1] for k, v in feeds.items()}
    for k in solo:
        if k.startswith("past_"):
            solo[k] = np.ascontiguousarray(solo[k][:, :, :valid])
    solo["attention_mask"] = np.ones((1, valid + feeds["input_ids"].shape[1]), dtype=np.int64)
    return solo


def _run(session, feeds, outputs=("logits",)):
    names = {i.name for i in session.get_inputs()}
    return session.run(list(outputs), {k: v for k, v in feeds.items() if k in names})


def _torch_logits(tiny, feeds, profile, row_switch=None) -> np.ndarray:
    past = [torch.from_numpy(feeds[f"past_{kind}.{i}"]) for i in range(tiny["layers"]) for kind in ("key", "value")]
    args = [torch.from_numpy(feeds[k]) for k in ("input_ids", "position_ids", "attention_mask")]
    with torch.no_grad(), query_scale(profile, row_switch=row_switch):
        logits, _, _ = tiny["torch"](*args, past)
    return logits.numpy()


def _row_n(valid: int, q_len: int = 5) -> np.ndarray:
    return valid + 1 + np.arange(q_len)


# ----------------------------------------------------------------------------------------------------------------
# (0) what the exported graph looks like, and what the rewrite made of it


def test_exported_llama_mask_is_one_shared_where_built_additive_mask(tiny, graphs):
    """Every layer's scores are ``Add(MatMul(Q, K^T), M)`` with the same M = Where(visible_bool, 0, finfo.min);
    the rewrite reads the bool directly (no float compare) and builds one N/beta subgraph for all 4 layers."""
    masks = set()
    for node in tiny["frozen"].graph:
        if node.op_type == "Softmax":
            add = node.inputs[0].producer()
            assert add.op_type == "Add" and add.inputs[0].producer().op_type == "MatMul"
            masks.add(add.inputs[1])
    assert len(masks) == 1
    (mask,) = masks
    where = mask.producer()
    assert where.op_type == "Where" and where.inputs[0].dtype == ir.DataType.BOOL
    fill = [float(ir.convenience.get_const_tensor(v).numpy()) for v in where.inputs[1:]]
    assert fill == [0.0, float(np.finfo(np.float32).min)]

    assert graphs["counts"] == {"DecomposedAttentionQueryScale": tiny["layers"], "OnnxAttentionQueryScale": 0,
                                "GroupQueryAttentionQueryScale": 0, "beta_subgraphs": 1, "already_scaled": 0}
    model = graphs["scaled_ir"]
    assert model.metadata_props[MODE_METADATA_KEY] == "score_mask"
    inserted = [n for n in model.graph if (n.name or "").startswith("sharpdraft/")]
    reduce_sum = [n for n in inserted if n.op_type == "ReduceSum"]
    assert len(reduce_sum) == 1 and not [n for n in inserted if n.op_type in ("Greater", "Shape")]
    cast = reduce_sum[0].inputs[0].producer()
    assert cast.op_type == "Cast" and cast.inputs[0].name == where.inputs[0].name  # N counts the bool itself


# ----------------------------------------------------------------------------------------------------------------
# (a) one call, rows at N = ref-2 .. ref+2


def test_rows_straddling_ref_keys_match_torch_reference(tiny, graphs):
    ref = PROFILE.ref_keys
    feeds = _feeds(tiny, valid=[ref - 3], slots=ref - 3)  # past ref-3, q_len 5: rows see N = ref-2 .. ref+2
    n = _row_n(ref - 3)
    assert list(n) == list(range(ref - 2, ref + 3))
    logits, beta = _run(graphs["scaled"], feeds, ("logits", graphs["beta"]))
    (frozen,) = _run(graphs["frozen"], feeds)

    np.testing.assert_allclose(beta.reshape(-1), PROFILE.beta(n), atol=1e-6, rtol=1e-6)
    assert np.all(beta.reshape(-1)[:3] == 1.0) and np.all(np.diff(beta.reshape(-1)[2:]) > 0.02)

    expected = _torch_logits(tiny, feeds, PROFILE)
    np.testing.assert_allclose(logits, expected, atol=LOGIT_ATOL, rtol=1e-4)
    np.testing.assert_allclose(frozen, _torch_logits(tiny, feeds, None), atol=LOGIT_ATOL, rtol=1e-4)
    # beta = 1 for rows at N <= ref: those rows equal the frozen model; beta > 1 after: they move
    np.testing.assert_allclose(logits[:, :3], frozen[:, :3], atol=1e-5, rtol=1e-5)
    moved = np.abs(logits - frozen).max(axis=(0, 2))
    assert np.all(moved[3:] > 50 * LOGIT_ATOL), moved


# ----------------------------------------------------------------------------------------------------------------
# (b) ragged batch == each row's solo run


def test_ragged_batch_rows_equal_their_solo_runs(tiny, graphs):
    slots, valid = 15, [15, 12]  # row 1: 3 padding slots between its past and its new tokens
    feeds = _feeds(tiny, valid, slots, seed=1)
    logits, beta = _run(graphs["scaled"], feeds, ("logits", graphs["beta"]))
    assert beta.shape == (2, 1, 5, 1)
    for b, v in enumerate(valid):
        np.testing.assert_allclose(beta[b].reshape(-1), PROFILE.beta(_row_n(v)), atol=1e-6, rtol=1e-6)
        (solo,) = _run(graphs["scaled"], _solo(tiny, feeds, b, v))
        np.testing.assert_allclose(logits[b:b + 1], solo, atol=LOGIT_ATOL, rtol=1e-4)
    # the padding is really excluded: counting the key length would give row 1 other betas
    assert np.abs(PROFILE.beta(_row_n(slots)) - beta[1].reshape(-1)).max() > 0.02
    np.testing.assert_allclose(logits, _torch_logits(tiny, feeds, PROFILE), atol=LOGIT_ATOL, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# (c) row switch


def test_row_switch_off_is_frozen(tiny, graphs):
    slots, valid = 15, [15, 14]
    feeds = _feeds(tiny, valid, slots, seed=2)
    (scaled,) = _run(graphs["scaled"], feeds)
    (frozen,) = _run(graphs["frozen"], feeds)
    assert np.abs(scaled - frozen).max() > 50 * LOGIT_ATOL  # the switch has something to switch
    (mixed,) = _run(graphs["switched"], feeds | {SWITCH: np.array([1.0, 0.0], dtype=np.float32)})
    np.testing.assert_allclose(mixed[0], scaled[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(mixed[1], frozen[1], atol=1e-5, rtol=1e-5)
    (off,) = _run(graphs["switched"], feeds | {SWITCH: np.zeros(2, dtype=np.float32)})
    np.testing.assert_allclose(off, frozen, atol=1e-5, rtol=1e-5)
    switch = torch.tensor([1.0, 0.0])
    np.testing.assert_allclose(mixed, _torch_logits(tiny, feeds, PROFILE, switch), atol=LOGIT_ATOL, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# (d) idempotency, errors


def test_rewrite_is_idempotent_and_mode_is_checked(tiny, graphs):
    model = _copy(graphs["scaled_ir"])
    nodes = len(list(model.graph))
    again = insert_query_scale(model, PROFILE, num_keys_from="score_mask")
    assert again["already_scaled"] == tiny["layers"] and again["beta_subgraphs"] == 0
    assert again["DecomposedAttentionQueryScale"] == 0 and len(list(model.graph)) == nodes
    with pytest.raises(QueryScaleRewriteError, match="already query-scaled with N from 'score_mask'"):
        insert_query_scale(model, PROFILE)  # the key-length mode on a score-mask rewrite


def test_bad_mode_arguments_raise():
    model = ir.from_proto(_two_layer_graph("additive", "keep"))
    with pytest.raises(ValueError, match="num_keys_from must be one of"):
        insert_query_scale(model, PROFILE, num_keys_from="rows")
    with pytest.raises(ValueError, match="only used with num_keys_from='key_mask'"):
        insert_query_scale(model, PROFILE, "mask0", num_keys_from="score_mask")
    with pytest.raises(ValueError, match="row_switch_input needs a per-row N"):
        insert_query_scale(model, PROFILE, row_switch_input=SWITCH)


def test_attention_without_mask_raises():
    """softmax(q k^T * s) v with no mask in the score chain (what an is_causal SDPA export looks like)."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    shape = [1, 2, "q_len", 8]
    graph = helper.make_graph(nodes, "g", [_vi(x, F, shape) for x in "qkv"], [_vi("out", F, shape)],
                              initializer=[onnx.numpy_helper.from_array(np.array(0.35, np.float32), "scale")])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    with pytest.raises(QueryScaleRewriteError, match="no mask .* in the score chain"):
        insert_query_scale(model, PROFILE, num_keys_from="score_mask")
    assert insert_query_scale(model, PROFILE)["DecomposedAttentionQueryScale"] == 1  # key-length mode still works


def test_onnx_attention_node_raises_in_score_mask_mode():
    nodes = [helper.make_node("Attention", ["q", "k", "v", "mask"], ["out"], is_causal=0)]
    shape = [1, 2, 3, 8]
    graph = helper.make_graph(nodes, "g", [_vi(x, F, shape) for x in "qkv"] + [_vi("mask", F, [1, 1, 3, 3])],
                              [_vi("out", F, shape)])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
    with pytest.raises(QueryScaleRewriteError, match="Attention node .*needs the decomposed MatMul/Softmax form"):
        insert_query_scale(model, PROFILE, num_keys_from="score_mask")


# ----------------------------------------------------------------------------------------------------------------
# mask forms, per-layer masks (sliding window), numpy oracle


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


HEADS, D = 2, 8


def _two_layer_graph(mask0: str, mask1: str) -> onnx.ModelProto:
    """Layer l: softmax(mask_l(q_l k_l^T * s)) v_l, q_1 = q + out_0; each layer reads its own mask input.

    mask kinds: "additive" (float input [1, 1, q, k] added), "keep" (Where(cond, S, -inf)), "hide"
    (Where(cond, -inf, S): cond True = hidden).
    """
    nodes = [helper.make_node("Constant", [], ["scale"], value=onnx.numpy_helper.from_array(
                 np.array(D ** -0.5, np.float32), "scale")),
             helper.make_node("Constant", [], ["ninf"], value=onnx.numpy_helper.from_array(
                 np.array(-np.inf, np.float32), "ninf")),
             helper.make_node("Identity", ["q"], ["q0"])]
    inputs = [_vi("q", F, [1, HEADS, "q_len", D])]
    for layer, kind in enumerate((mask0, mask1)):
        p = f"l{layer}_"
        nodes += [helper.make_node("Transpose", [f"k{layer}"], [p + "kt"], perm=[0, 1, 3, 2]),
                  helper.make_node("MatMul", [f"q{layer}", p + "kt"], [p + "s"]),
                  helper.make_node("Mul", [p + "s", "scale"], [p + "ss"])]
        if kind == "additive":
            nodes.append(helper.make_node("Add", [p + "ss", f"mask{layer}"], [p + "sm"]))
            inputs.append(_vi(f"mask{layer}", F, [1, 1, "q_len", "keys"]))
        else:
            branches = [p + "ss", "ninf"] if kind == "keep" else ["ninf", p + "ss"]
            nodes.append(helper.make_node("Where", [f"mask{layer}", *branches], [p + "sm"]))
            inputs.append(_vi(f"mask{layer}", B, [1, 1, "q_len", "keys"]))
        nodes += [helper.make_node("Softmax", [p + "sm"], [p + "p"], axis=-1),
                  helper.make_node("MatMul", [p + "p", f"v{layer}"], [f"out{layer}"])]
        inputs += [_vi(f"k{layer}", F, [1, HEADS, "keys", D]), _vi(f"v{layer}", F, [1, HEADS, "keys", D])]
    nodes.append(helper.make_node("Add", ["q", "out0"], ["q1"]))
    graph = helper.make_graph(nodes, "g", inputs, [_vi("out1", F, [1, HEADS, "q_len", D])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("mask0, mask1, hidden", [
    ("additive", "keep", -np.inf), ("additive", "hide", float(np.finfo(np.float32).min)), ("hide", "keep", None),
])
def test_mask_forms_and_per_layer_windows_match_numpy(mask0, mask1, hidden):
    """Layer 0: causal with a hole; layer 1: causal sliding window of 4 (its own mask -> its own N = min(., 4)).

    Counting the hidden keys instead (a polarity slip) would give N = 18 on layer 1 and N <= 5 on layer 0."""
    q_len, keys, past, window = 4, 22, 18, 4
    rng = np.random.default_rng(3)
    pos = past + np.arange(q_len)[:, None]  # query positions; key j at position j
    causal = np.arange(keys)[None] <= pos
    visible0 = causal.copy()
    visible0[:, 3:5] = False  # a hole (padding)
    visible1 = causal & (np.arange(keys)[None] > pos - window)
    model = ir.from_proto(_two_layer_graph(mask0, mask1))
    counts = insert_query_scale(model, PROFILE, num_keys_from="score_mask")
    assert counts["DecomposedAttentionQueryScale"] == 2 and counts["beta_subgraphs"] == 2
    feeds = {"q": 3 * rng.standard_normal((1, HEADS, q_len, D))}
    for layer in range(2):
        feeds[f"k{layer}"] = rng.standard_normal((1, HEADS, keys, D))
        feeds[f"v{layer}"] = rng.standard_normal((1, HEADS, keys, D))
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    for layer, (kind, vis) in enumerate(((mask0, visible0), (mask1, visible1))):
        if kind == "additive":
            feeds[f"mask{layer}"] = np.where(vis, 0.0, hidden).astype(np.float32)[None, None]
        else:
            feeds[f"mask{layer}"] = (vis if kind == "keep" else ~vis)[None, None]
    (out,) = _session(model).run(None, feeds)

    f = {k: v.astype(np.float64) for k, v in feeds.items() if v.dtype != bool}
    beta0 = PROFILE.beta(visible0.sum(-1))[:, None]  # N = 17..20 (two keys of the hole excluded)
    beta1 = PROFILE.beta(visible1.sum(-1))[:, None]  # N = 4: beta 1
    assert np.all(beta0[1:] > 1) and np.all(beta1 == 1)
    out0 = _softmax(np.where(visible0, (beta0 * f["q"]) @ f["k0"].swapaxes(-1, -2) * D ** -0.5, -np.inf)) @ f["v0"]
    q1 = f["q"] + out0
    expected = _softmax(np.where(visible1, (beta1 * q1) @ f["k1"].swapaxes(-1, -2) * D ** -0.5, -np.inf)) @ f["v1"]
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# the torch reference on its own


def test_visible_keys_bool_additive_and_causal_default_agree():
    q_len, kv_len = 3, 7
    bool_mask = torch.ones(2, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    bool_mask[1, ..., 1:3] = False
    additive = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    expected = torch.tensor([[5.0, 6.0, 7.0], [3.0, 4.0, 5.0]]).view(2, 1, q_len, 1)
    assert torch.equal(visible_keys(bool_mask, q_len, kv_len), expected)
    assert torch.equal(visible_keys(additive, q_len, kv_len), expected)
    assert torch.equal(visible_keys(additive.half(), q_len, kv_len), expected)  # fp16 finfo.min is only -65504
    assert torch.equal(visible_keys(None, q_len, kv_len), expected[:1])
    assert torch.equal(visible_keys(None, q_len, kv_len, causal=False), torch.full((1, 1, q_len, 1), 7.0))
