"""--drafter-precision int8 (export/drafter_quant.py): MatMulNBits layers, the target's own int4 LM-head rows inside
the drafter graph, the real-text agreement check, the runtime reading such a graph, and the refusals."""
import json

import numpy as np
import onnx
import pytest

from export.drafter_quant import DrafterQuantError, proposal_agreement, quantize_drafter_graph
from export.pipeline import ExportConfig, ExportError
from runtime.engine import SpecEngine
from runtime.manifest import read_initializer

pytest.importorskip("onnxruntime_genai")


def _graph(folder):
    return onnx.load(str(folder / "drafter" / "model.onnx"), load_external_data=False)


def test_default_int4_export_quantizes_the_dflash_drafter(tiny_int4_engines):
    m = json.loads((tiny_int4_engines / "manifest.json").read_text())
    g = m["graphs"]["drafter"]
    q = g["quantization"]
    assert g["precision"] == "int8" and (q["bits"], q["block_size"], q["accuracy_level"]) == (8, 32, 4)
    assert "lm_head_weight" not in g["inputs"] and "lm_head_weight" not in m["shared_weights"]
    assert q["lm_head"] == {"source": "target", "bits": 4, "block_size": 32, "rows": m["target"]["vocab_size"]}
    graph = _graph(tiny_int4_engines)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("MatMulNBits") == q["quantized_matmuls"] + 1  # the layers + the LM head
    stored = {i.name for i in graph.graph.initializer}
    # no float MatMul left with a stored weight; attention (both operands computed) and beta stay as they were
    assert not [n for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in stored]
    assert [n for n in graph.graph.node if n.op_type == "Softmax"]
    v = m["validation"]["drafter_int8"]
    assert v["slot_top1_agreement"][0] >= v["min_slot1_agreement"] and v["rows"] == 48


def test_lm_head_rows_are_the_targets_own_int4_bytes(tiny_int4_engines):
    m = json.loads((tiny_int4_engines / "manifest.json").read_text())
    target = tiny_int4_engines / "target" / "model.onnx"
    tg = onnx.load(str(target), load_external_data=False)
    head = next(n for n in tg.graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits")
    drafter = tiny_int4_engines / "drafter" / "model.onnx"
    ours = next(n for n in _graph(tiny_int4_engines).graph.node if n.name == "draft_head")
    for theirs_name, ours_name in zip(head.input[1:3], ours.input[1:3]):
        theirs = np.asarray(read_initializer(target, theirs_name))
        mine = np.asarray(read_initializer(drafter, ours_name))
        assert np.array_equal(mine.reshape(theirs.shape), theirs)
    assert m["graphs"]["drafter"]["quantization"]["lm_head"]["rows"] == theirs.shape[0]


def test_int8_drafter_is_lossless_and_drafts_close_to_fp32(tiny_int4_engines, tiny_target_dir, tiny_dflash_dir,
                                                          tmp_path):
    from export.pipeline import run_export

    fp32 = tmp_path / "fp32"
    m = run_export(ExportConfig(family="dflash", out=fp32, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                                ref_keys=64, target_precision="int4", drafter_precision="fp32"))
    assert m["graphs"]["drafter"].get("precision") is None and "lm_head_weight" in m["graphs"]["drafter"]["inputs"]
    engines = {"int8": SpecEngine.from_dir(tiny_int4_engines, check_invariants=True),
               "fp32": SpecEngine.from_dir(fp32, check_invariants=True)}
    assert engines["int8"].drafter.head_in_graph and not engines["fp32"].drafter.head_in_graph
    prompt = engines["int8"].tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")
    outs = {name: e.generate(prompt, 24) for name, e in engines.items()}
    for name, e in engines.items():  # the target verifies every draft token: same ids with either drafter
        assert outs[name].token_ids == e.generate_target_only(prompt, 24).token_ids
    assert outs["int8"].token_ids == outs["fp32"].token_ids
    # both drafters score the same target ids: logits of the int8 graph are over the whole vocabulary as well
    cache = {n: e.drafter.new_cache() for n, e in engines.items()}
    _, feats = engines["int8"].target.forward([engines["int8"].target.new_cache()], [prompt])
    logits = {n: e.drafter.draft([cache[n]], [prompt[-1]], [feats[0, :-1]]) for n, e in engines.items()}
    assert logits["int8"].shape == logits["fp32"].shape
    assert float(np.abs(logits["int8"] - logits["fp32"]).max()) < 0.1 * float(np.abs(logits["fp32"]).max())


def test_the_full_vocabulary_switch_is_refused_when_the_head_is_in_the_graph(tiny_int4_engines):
    drafter = SpecEngine.from_dir(tiny_int4_engines).drafter
    drafter.set_draft_vocab(False)  # no draft vocabulary in this folder: nothing to switch, no error
    drafter.draft_ids = np.arange(10)  # as for a folder with one
    with pytest.raises(ValueError, match="--drafter-precision fp32"):
        drafter.set_draft_vocab(False)


def test_a_float_target_keeps_the_lm_head_a_runtime_input(tiny_engines, tmp_path):
    m = json.loads((tiny_engines / "manifest.json").read_text())
    src = tiny_engines / "drafter" / "model.onnx"
    info = quantize_drafter_graph(src, tmp_path / "model.onnx", m["shared_weights"]["lm_head_weight"],
                                  tiny_engines / "target" / "model.onnx", None)
    assert info["lm_head"] is None and info["quantized_matmuls"] > 0
    q = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert "lm_head_weight" in [i.name for i in q.graph.input]


def test_zero_point_heads_and_unknown_families_are_refused(tiny_int4_engines, tmp_path):
    from export.drafter_quant import _bake_lm_head

    # an asymmetric head (a 4th input: zero points) is refused before anything is read
    spec = {"op": "MatMulNBits", "inputs": ["data", {"initializer": "w"}, {"initializer": "s"}, {"initializer": "zp"}],
            "attributes": {"K": 64, "N": 10, "bits": 4, "block_size": 32}}
    with pytest.raises(DrafterQuantError, match="zero points"):
        _bake_lm_head(onnx.ModelProto(), spec, tiny_int4_engines / "target" / "model.onnx", None)
    with pytest.raises(ExportError, match="pard drafters export in fp32 only; drop the option"):
        ExportConfig(family="pard", out=tmp_path / "o", drafter_precision="int8")


def test_proposal_agreement_counts_per_slot(tiny_engines, tmp_path):
    src = tiny_engines / "drafter" / "model.onnx"
    sess_inputs = {i.name for i in onnx.load(str(src), load_external_data=False).graph.input}
    assert "lm_head_weight" in sess_inputs
    from export.families import get_family
    from runtime.models.target import load_target

    fam = get_family("dflash")
    m = json.loads((tiny_engines / "manifest.json").read_text())
    drafter = fam.load(m["drafter"]["checkpoint"])
    target, tok = load_target(m["target"]["source"])
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    context = fam.quantization_context(drafter, target, tok)
    del target  # the feeds are made after the target is released, as the export makes them

    def feeds(chunk_rows):
        return lambda: fam.quantization_feeds(drafter.config, context, embed, head, None, rows=6,
                                              chunk_rows=chunk_rows)

    same = proposal_agreement(src, src, feeds(4))  # a graph against itself agrees everywhere, exactly
    assert same["slot_top1_agreement"] == [1.0] * (drafter.config.block_size - 1)
    assert (same["rows"], same["chunks"]) == (6, 2)
    assert same["max_abs_diff_logits"] == 0.0 and same["max_abs_logit"] > 0
    # row chunks measure what one batch measures (the int8 graph differs from the fp32 one)
    quantize_drafter_graph(src, tmp_path / "int8" / "model.onnx", None, None, None)
    chunked = proposal_agreement(src, tmp_path / "int8" / "model.onnx", feeds(4))
    whole = proposal_agreement(src, tmp_path / "int8" / "model.onnx", next(iter(feeds(6)())))
    assert whole["chunks"] == 1 and chunked["chunks"] == 2 and chunked["rows"] == whole["rows"] == 6
    # MatMulNBits with int8 activations (accuracy_level 4) is not bit-identical across batch sizes on every CPU
    # (its kernel path depends on the row count: max |diff| 1.083 chunked vs 1.071 whole on one 2-core EPYC, equal on
    # another), so the per-slot counts may move by at most one row and the largest difference by a few %
    for c, w in zip(chunked["slot_top1_agreement"], whole["slot_top1_agreement"], strict=True):
        assert abs(c - w) <= 1 / whole["rows"] + 1e-9, (chunked["slot_top1_agreement"], whole["slot_top1_agreement"])
    assert 0 < chunked["max_abs_diff_logits"] == pytest.approx(whole["max_abs_diff_logits"], rel=0.05)
    assert chunked["max_abs_logit"] == pytest.approx(whole["max_abs_logit"], rel=1e-5)


def test_the_streamed_fp16_conversion_equals_the_in_memory_one(tiny_engines, tmp_path):
    """half_drafter_graph converts stored tensors one at a time from a memory map; on a copy of the same graph with
    every tensor inline, the converter does it all in memory: both must write the same graph and the same values."""
    from onnx import TensorProto, numpy_helper

    from export.drafter_quant import half_drafter_graph

    src = tiny_engines / "drafter" / "model.onnx"
    stored = [t for t in onnx.load(str(src), load_external_data=False).graph.initializer
              if t.data_location == TensorProto.EXTERNAL]
    assert len(stored) > 5  # else the streamed path is not exercised
    inline = tmp_path / "inline" / "model.onnx"
    inline.parent.mkdir()
    onnx.save(onnx.load(str(src)), str(inline))
    half_drafter_graph(src, tmp_path / "streamed" / "model.onnx")
    half_drafter_graph(inline, tmp_path / "memory" / "model.onnx")
    a, b = (onnx.load(str(tmp_path / d / "model.onnx")) for d in ("streamed", "memory"))
    assert [(n.op_type, list(n.input), list(n.output)) for n in a.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in b.graph.node]
    va = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    vb = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert va.keys() == vb.keys()
    assert sum(v.dtype == np.float16 for v in va.values()) >= len(stored) // 2
    for name in va:
        assert va[name].dtype == vb[name].dtype and np.array_equal(va[name], vb[name]), name
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in a.graph.value_info}
    for t in stored:
        assert shapes.get(t.name, list(t.dims)) == list(t.dims)
