"""--dtype / --target-precision fp16 / --drafter-precision fp16 on the tiny pair, and the bf16 refusal."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from export.pipeline import ExportConfig, ExportError, run_export
from runtime.engine import SpecEngine

pytest.importorskip("onnxruntime_genai")


@pytest.fixture(scope="module")
def tiny_fp16_engines(tmp_path_factory, tiny_target_dir, tiny_dflash_dir):
    out = tmp_path_factory.mktemp("fp16") / "engines"
    run_export(ExportConfig(family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                            ref_keys=64, dtype="fp16"))
    return out


def test_fp16_folder_describes_half_graphs(tiny_fp16_engines):
    import onnx

    m = json.loads((tiny_fp16_engines / "manifest.json").read_text())
    t, d = m["graphs"]["target"], m["graphs"]["drafter"]
    assert (m["target"]["precision"], t["precision"], t["kv_io"], t["min_q_len"]) == ("fp16", "fp16", "shared", 2)
    assert t["builder"]["execution_provider"] == "cuda"  # the builder's fused-GQA layout, run here on CPU
    assert d["precision"] == "fp16" and d["quantization"]["dtype"] == "float16"
    g = onnx.load(str(tiny_fp16_engines / "target" / "model.onnx"), load_external_data=False)
    past = next(i for i in g.graph.input if i.name.startswith("past_key_values"))
    assert past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    dg = onnx.load(str(tiny_fp16_engines / "drafter" / "model.onnx"), load_external_data=False)
    half = [i for i in dg.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16]
    assert len(half) >= 8  # the layer weights are float16 ...
    assert all(i.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16 for i in dg.graph.input)  # ... io is not
    # the RMS norms' x^2 never passes through float16 (a Pow output is read in float32 only)
    users = {}
    for n in dg.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    for n in dg.graph.node:
        if n.op_type == "Pow":
            assert all(u.op_type != "Cast" for u in users[n.output[0]]), "x^2 cast to float16"
    q = m["validation"]["drafter_fp16"]
    assert q["slot_top1_agreement"][0] >= q["min_slot1_agreement"]


def test_fp16_pair_is_lossless_against_its_own_target(tiny_fp16_engines):
    engine = SpecEngine.from_dir(tiny_fp16_engines, check_invariants=True)
    assert engine.target.kv_dtype == np.float16
    g = torch.Generator().manual_seed(2)
    for n in (3, 50, 200):
        ids = torch.randint(0, 49152, (n,), generator=g).tolist()
        assert engine.generate(ids, 24).token_ids == engine.generate_target_only(ids, 24).token_ids


def test_fp16_tables_are_widened_to_float32(tiny_fp16_engines, tiny_target_dir):
    from safetensors.torch import load_file

    from export.genai_target import find_shared_weights
    from runtime.shared_tables import load_shared_table

    path = tiny_fp16_engines / "target" / "model.onnx"
    specs = find_shared_weights(path)
    weights = load_file(str(tiny_target_dir / "model.safetensors"))
    for name, key in (("embed_weight", "model.embed_tokens.weight"), ("lm_head_weight", "lm_head.weight")):
        w = weights.get(key, weights["model.embed_tokens.weight"]).numpy()  # tied targets store one table
        t = load_shared_table(path, specs[name])
        assert t.dtype == np.float32 and t.shape == w.shape
        np.testing.assert_allclose(t, w.astype(np.float16).astype(np.float32), rtol=0, atol=0)


def test_dtype_options_conflict_and_bf16_is_refused_with_its_reason(tmp_path, tiny_dflash_dir, tiny_target_dir):
    with pytest.raises(ExportError, match="--dtype sets both"):
        ExportConfig(family="dflash", out=tmp_path / "e", dtype="fp16", target_precision="int4")
    with pytest.raises(ExportError, match="pard drafters export in fp32"):
        ExportConfig(family="pard", out=tmp_path / "e", dtype="fp16")
    assert ExportConfig(family="dflash", out=tmp_path / "e", target_precision="fp16").drafter_graph_precision == "fp16"
    assert ExportConfig(family="pard", out=tmp_path / "e", target_precision="fp16").drafter_graph_precision == "fp32"
    out = tmp_path / "e"
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "dflash", "--checkpoint", str(tiny_dflash_dir),
                        "--target", str(tiny_target_dir), "--out", str(out), "--dtype", "bf16"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("sharpdraft-export: error: --target-precision bf16")
    assert "use fp16" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".e.*"))


def test_a_target_graph_onnx_runtime_cannot_run_is_one_export_error(monkeypatch, tmp_path):
    """As the fp16 Qwen3 graph with Q/K norms fused into GroupQueryAttention was on CPU (scripts/bench_scale.py)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    import export.validate
    from export.pipeline import _validate_target

    def fail(*a, **k):
        raise RuntimeException("Non-zero status code returned while running GroupQueryAttention node. Status Message: "
                               "GroupQueryAttention (CPU): q_norm_weight / k_norm_weight inputs are not supported.")

    monkeypatch.setattr(export.validate, "validate_shared_target", fail)
    cfg = ExportConfig(family="dflash", out=tmp_path / "e", target_precision="fp16")
    with pytest.raises(ExportError, match=r"cannot run the fp16 target graph on this machine \(GroupQueryAttention "
                                          r"\(CPU\): q_norm_weight .*export another --target-precision"):
        _validate_target(cfg, None, [], tmp_path / "model.onnx", {}, None)
