"""--dtype / --target-precision fp16 / --drafter-precision fp16 on the tiny pair; --dtype bf16 (export/bf16.py)."""
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


def test_dtype_options_conflict(tmp_path):
    with pytest.raises(ExportError, match="--dtype sets both"):
        ExportConfig(family="dflash", out=tmp_path / "e", dtype="fp16", target_precision="int4")
    with pytest.raises(ExportError, match="pard drafters export in fp32"):
        ExportConfig(family="pard", out=tmp_path / "e", dtype="fp16")
    with pytest.raises(ExportError, match="eagle3 drafters export in fp32"):
        ExportConfig(family="eagle3", out=tmp_path / "e", dtype="bf16")
    assert ExportConfig(family="dflash", out=tmp_path / "e", target_precision="fp16").drafter_graph_precision == "fp16"
    assert ExportConfig(family="dflash", out=tmp_path / "e", target_precision="bf16").drafter_graph_precision == "bf16"
    assert ExportConfig(family="pard", out=tmp_path / "e", target_precision="fp16").drafter_graph_precision == "fp32"


@pytest.fixture(scope="module")
def tiny_bf16_engines(tmp_path_factory, tiny_target_dir, tiny_dflash_dir):
    out = tmp_path_factory.mktemp("bf16") / "engines"
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "dflash", "--checkpoint", str(tiny_dflash_dir),
                        "--target", str(tiny_target_dir), "--out", str(out), "--dtype", "bf16", "--ref-keys", "64"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_bf16_folder_holds_bf16_graphs_checked_by_emulation(tiny_bf16_engines, tiny_dflash_dir):
    import ml_dtypes
    import onnx
    from onnx import numpy_helper
    from safetensors.torch import load_file

    m = json.loads((tiny_bf16_engines / "manifest.json").read_text())
    t, d = m["graphs"]["target"], m["graphs"]["drafter"]
    assert (m["target"]["precision"], t["precision"], t["kv_io"], d["precision"]) == ("bf16", "bf16", "shared", "bf16")
    g = onnx.load(str(tiny_bf16_engines / "target" / "model.onnx"), load_external_data=False)
    past = next(i for i in g.graph.input if i.name.startswith("past_key_values"))
    assert past.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    dg = onnx.load(str(tiny_bf16_engines / "drafter" / "model.onnx"))
    bf = {i.name: i for i in dg.graph.initializer if i.data_type == onnx.TensorProto.BFLOAT16}
    assert len(bf) >= 8 and not any(i.data_type == onnx.TensorProto.FLOAT16 for i in dg.graph.initializer)
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT or i.type.tensor_type.elem_type
               == onnx.TensorProto.INT64 for i in dg.graph.input)  # io stays fp32 / int64
    onnx.checker.check_model(dg, full_check=True)  # every op takes bf16 where it is given bf16
    # each bf16 weight is its checkpoint value rounded once (not via fp16): some checkpoint tensor matches it
    weights = {k: v.float().numpy() for k, v in load_file(str(tiny_dflash_dir / "model.safetensors")).items()}
    rounded = [w.astype(ml_dtypes.bfloat16) for w in weights.values() if w.ndim == 2]
    matched = 0
    for init in bf.values():
        arr = numpy_helper.to_array(init)
        matched += any(r.shape == arr.shape and np.array_equal(r.view(np.uint16), arr.view(np.uint16))
                       or r.T.shape == arr.shape and np.array_equal(r.T.view(np.uint16), arr.view(np.uint16))
                       for r in rounded)
    assert matched >= 8
    v = m["validation"]
    assert "emulation" in v["target"] and v["target"]["top1_agreement_fp32"] >= 0.9
    q = v["drafter_bf16"]
    assert q["slot_top1_agreement"][0] >= q["min_slot1_agreement"] and "emulation" in d["quantization"]


def test_the_runtime_refuses_a_bf16_folder_in_one_line(tiny_bf16_engines):
    from runtime.manifest import EngineDirError

    with pytest.raises(EngineDirError, match="graph is bf16.*export --dtype fp16"):
        SpecEngine.from_dir(tiny_bf16_engines)
    r = subprocess.run([sys.executable, "-m", "runtime.generate", "--engine", str(tiny_bf16_engines), "--prompt", "hi",
                        "--max-new-tokens", "4"], capture_output=True, text=True)
    assert r.returncode != 0 and "graph is bf16" in r.stderr and "Traceback" not in r.stderr


def test_a_target_graph_onnx_runtime_cannot_run_is_one_export_error(monkeypatch, tmp_path):
    """As the fp16 Qwen3 graph with Q/K norms fused into GroupQueryAttention was on CPU (scripts/bench_scale.py)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    import export.validate
    from export.pipeline import _validate_target

    def fail(*a, **k):
        raise RuntimeException("Non-zero status code returned while running GroupQueryAttention node. Status Message: "
                               "GroupQueryAttention (CPU): q_norm_weight / k_norm_weight inputs are not supported.")

    monkeypatch.setattr(export.validate, "check_shared_target", fail)
    cfg = ExportConfig(family="dflash", out=tmp_path / "e", target_precision="fp16")
    with pytest.raises(ExportError, match=r"cannot run the fp16 target graph on this machine \(GroupQueryAttention "
                                          r"\(CPU\): q_norm_weight .*export another --target-precision"):
        _validate_target(cfg, {}, [], tmp_path / "model.onnx", {})
