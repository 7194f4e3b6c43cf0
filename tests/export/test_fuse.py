"""--fused-attention: the drafter's attentions become sharpdraft::QueryScaledAttention nodes (TensorRT plugin form),
and that graph, run with the node implemented by the torch reference (ONNX Runtime Python op), equals the portable
graph (beta subgraph + Mul on Q), which is itself validated against the torch drafter."""
import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from export.fuse import DOMAIN, OP_TYPE, FusionError, fuse_attention, fuse_file, node_attributes, profile_of
from export.families.dflash.graph import export_drafter
from export.rewrite import rewrite_file
from export.families.dflash.validate import validate_fused_drafter
from export.validate import ValidationError
from plugins.rule import QueryScaleProfile
from runtime.models.dflash import load_dflash

pytest.importorskip("onnxruntime_extensions")
PROFILE = QueryScaleProfile(ref_keys=64)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory, tiny_dflash_dir):
    d = tmp_path_factory.mktemp("fuse")
    drafter = load_dflash(tiny_dflash_dir)
    io = export_drafter(drafter, d / "frozen.onnx")
    rewrite_file(d / "frozen.onnx", d / "portable.onnx", PROFILE, num_keys_input="attention_mask",
                 row_switch_input="query_scale_enabled")
    io["inputs"].append("query_scale_enabled")
    n = fuse_file(d / "frozen.onnx", d / "fused.onnx", PROFILE)
    g = torch.Generator().manual_seed(3)
    embed = (torch.randn(drafter.config.vocab_size, drafter.config.hidden_size, generator=g) * 0.5).numpy()
    head = (torch.randn(drafter.config.vocab_size, drafter.config.hidden_size, generator=g) * 0.5).numpy()
    return {"dir": d, "drafter": drafter, "io": io, "n": n, "embed": embed, "head": head}


def test_every_attention_becomes_one_fused_node(graphs):
    cfg = graphs["drafter"].config
    model = onnx.load(str(graphs["dir"] / "fused.onnx"))
    fused = [n for n in model.graph.node if n.domain == DOMAIN]
    assert graphs["n"] == cfg.num_hidden_layers == len(fused)
    assert all(n.op_type == OP_TYPE for n in fused)
    assert not any(n.op_type == "Softmax" for n in model.graph.node)
    assert {o.domain: o.version for o in model.opset_import}[DOMAIN] == 1
    attrs = node_attributes(fused[0])
    got = profile_of(attrs)  # ONNX float attributes are float32
    assert (got.ref_keys, got.top_k, got.enabled) == (PROFILE.ref_keys, PROFILE.top_k, PROFILE.enabled)
    assert got.cap == pytest.approx(PROFILE.cap, rel=1e-7) and got.slope == pytest.approx(PROFILE.slope, rel=1e-7)
    assert attrs["scale"] == pytest.approx(cfg.head_dim ** -0.5)
    assert attrs["plugin_namespace"] == b"sharpdraft" and attrs["aot"] == 1 and attrs["causal"] == 0
    shapes = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    value_info = {v.name: v for v in list(shapes.graph.value_info) + list(shapes.graph.input)}
    k = value_info[fused[0].input[1]].type.tensor_type.shape.dim
    assert k[1].dim_value == cfg.num_key_value_heads  # K is taken before GQA's repeat_interleave


def test_fused_graph_equals_portable_graph_on_ragged_rows(graphs):
    cfg = graphs["drafter"].config
    report = validate_fused_drafter(graphs["dir"] / "fused.onnx", graphs["dir"] / "portable.onnx", graphs["io"], cfg,
                                    PROFILE, graphs["embed"], graphs["head"])
    for p in report["points"]:
        assert p["max_abs_diff_logits"] < 1e-3
    far = [p for p in report["points"] if max(p["num_keys"]) >= 4 * PROFILE.ref_keys]
    assert far and all(p["beta_effect_on_logits"] > 10 * p["bound"] for p in far)  # a wrong beta would be caught


def test_validation_catches_a_wrong_profile_in_the_node(graphs, tmp_path):
    model = onnx.load(str(graphs["dir"] / "fused.onnx"))
    for node in model.graph.node:
        if node.domain == DOMAIN:
            for a in node.attribute:
                if a.name == "ref_keys":
                    a.i = 128  # the portable graph uses 64
    onnx.save(model, str(tmp_path / "bad.onnx"), save_as_external_data=True, location="bad.onnx.data")
    with pytest.raises(ValidationError, match="fused drafter graph"):
        validate_fused_drafter(tmp_path / "bad.onnx", graphs["dir"] / "portable.onnx", graphs["io"],
                               graphs["drafter"].config, PROFILE, graphs["embed"], graphs["head"])


def test_already_scaled_graph_is_refused_with_the_reason(graphs):
    model = ir.load(graphs["dir"] / "portable.onnx")
    with pytest.raises(FusionError, match="already scaled"):
        fuse_attention(model, PROFILE)


def _additive_mask_attention() -> ir.Model:
    """softmax(q @ k^T * 0.25 + mask) @ v with an additive (causal-style) float mask: not fusable."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", f, [], [0.25])),
             helper.make_node("Mul", ["s", "c"], ["s2"]),
             helper.make_node("Add", ["s2", "bias"], ["s3"]),
             helper.make_node("Softmax", ["s3"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [vi("q", f, [1, 2, 3, 16]), vi("k", f, [1, 2, 5, 16]),
                                       vi("v", f, [1, 2, 5, 16]), vi("bias", f, [1, 1, 3, 5]),
                                       vi("attention_mask", TensorProto.INT64, [1, 5])],
                          [vi("y", f, [1, 2, 3, 16])])
    return ir.from_proto(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


def test_additive_mask_is_not_fused_and_says_why():
    with pytest.raises(FusionError, match="additive or causal masks are not fused"):
        fuse_attention(_additive_mask_attention(), PROFILE)
    model = _additive_mask_attention()
    with pytest.raises(FusionError, match="not an input"):
        fuse_attention(model, PROFILE, key_mask_input="key_padding")


def test_export_cli_option_writes_and_validates_the_fused_graph(tmp_path, tiny_target_dir, tiny_dflash_dir):
    from export.pipeline import ExportConfig, run_export
    from runtime.manifest import load_manifest

    out = tmp_path / "engines"
    manifest = run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir,
                                       target=str(tiny_target_dir), ref_keys=64, fused_attention=True))
    entry = manifest["graphs"]["drafter_fused"]
    assert entry["file"] == "drafter_fused/model.onnx" and entry["fused_attentions"] == 2
    assert "query_scale_enabled" not in entry["inputs"]
    assert len(manifest["validation"]["drafter_fused"]["points"]) == 3
    load_manifest(out)  # checksums of every file, the fused graph's included
    assert json.loads((out / "manifest.json").read_text())["graphs"]["drafter_fused"]["fused_op"] == \
        "sharpdraft::QueryScaledAttention"
    assert np.isfinite([p["max_abs_diff_logits"] for p in manifest["validation"]["drafter_fused"]["points"]]).all()
    from export.cli import _fused_line
    from runtime.manifest import GraphEntry

    line = _fused_line(GraphEntry.from_dict(entry, "graphs.drafter_fused"),  # what the CLI prints after "validation:"
                       manifest["validation"]["drafter_fused"])
    assert entry["fused_windows"] == [0, 0] and "2 attentions" in line and "windows: full, full" in line
    assert "the runtime runs the portable drafter graph" in line and "N = 100:" in line
