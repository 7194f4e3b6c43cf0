"""--target-precision int4 on the tiny pair: the builder graph, its validation, the shared-buffer runtime, errors."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from export.genai_target import GenaiBuildError, builder_taps
from export.pipeline import ExportConfig, ExportError, run_export
from runtime.engine import SpecEngine
from runtime.sampling import SamplingParams
from runtime.shared_tables import load_shared_table

pytest.importorskip("onnxruntime_genai")


def test_builder_taps_follow_the_residual_stream_convention():
    # sharpdraft tap id i = hidden_states[i + 1] = the stream entering layer i + 1 (the builder's index)
    assert builder_taps([1, 14, 27], 30) == [2, 15, 28]
    with pytest.raises(GenaiBuildError, match="cannot be tapped"):
        builder_taps([28, 29], 30)  # layer 29's output is hidden_states[30], after the final norm


def test_manifest_describes_the_shared_kv_graph(tiny_int4_engines):
    m = json.loads((tiny_int4_engines / "manifest.json").read_text())
    g = m["graphs"]["target"]
    assert (g["kv_io"], g["precision"], g["min_q_len"]) == ("shared", "int4", 2)
    assert g["inputs"][:2] == ["input_ids", "attention_mask"] and "aux_hidden_states" in g["outputs"]
    assert g["builder"]["accuracy_level"] == 4 and "target/genai_config.json" in g["sha256"]
    v = m["validation"]["target"]
    assert v["max_abs_diff_cached_vs_full"] <= v["atol"] and v["max_abs_diff_after_rollback"] <= v["atol"]
    # each tap matches its own transformers layer better than both neighbours (no off-by-one)
    assert all(c > max(n) for c, n in zip(v["tap_cosine"], v["tap_cosine_neighbours"]))
    assert json.loads((tiny_int4_engines / "target" / "BUILD.json").read_text())["precision"] == "int4"


def test_dequantized_lm_head_is_the_int4_rounding_of_the_fp32_weights(tiny_int4_engines, tiny_target_dir):
    from safetensors.torch import load_file

    from export.genai_target import find_shared_weights

    # the int8 drafter carries these rows itself (export/drafter_quant.py), so the manifest no longer lists the head
    spec = find_shared_weights(tiny_int4_engines / "target" / "model.onnx")["lm_head_weight"]
    assert spec["quantized"]["op"] == "MatMulNBits"
    w = load_file(str(tiny_target_dir / "model.safetensors"))["lm_head.weight"].numpy()
    deq = load_shared_table(tiny_int4_engines / "target" / "model.onnx", spec)
    assert deq.shape == w.shape and deq.dtype == np.float32
    blocks = np.abs(w.reshape(w.shape[0], -1, 32)).max(-1, keepdims=True)  # block 32 along hidden
    err = np.abs(deq - w).reshape(blocks.shape[0], -1, 32)
    assert (err <= blocks / 7 + 1e-6).all()  # within one int4 step of the block's symmetric scale
    assert 0 < err.mean() < np.abs(w).mean() / 4  # quantized, not a copy, and close


def test_speculative_equals_target_only_on_the_int4_graph(tiny_int4_engines):
    engine = SpecEngine.from_dir(tiny_int4_engines, check_invariants=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (1, 7, 40, 300)]
    for ids in prompts:
        spec = engine.generate(ids, 24)
        assert spec.token_ids == engine.generate_target_only(ids, 24).token_ids
    # a ragged batch: greedy rows equal their solo target-only runs; a sampled row beside them runs
    reqs = [(p, SamplingParams(max_new_tokens=16)) for p in prompts] + [
        (prompts[2], SamplingParams(max_new_tokens=16, temperature=0.8, seed=1))]
    outs = engine.generate_batch(reqs)
    for (ids, _), out in zip(reqs[:-1], outs):
        assert out.token_ids == engine.generate_target_only(ids, 16).token_ids
    assert len(outs[-1].token_ids) == 16


def test_shared_cache_rollback_is_a_length_change(tiny_int4_engines):
    engine = SpecEngine.from_dir(tiny_int4_engines)
    t = engine.target
    cache = t.new_cache()
    t.prefill(cache, list(range(10, 60)))
    buffers = [b.ctypes.data for b in cache.kv_buffers]
    logits, _ = t.forward([cache], [[5, 6, 7, 8]])
    assert cache.length == 54 and [b.ctypes.data for b in cache.kv_buffers] == buffers  # written in place
    cache.truncate(51)
    again, _ = t.forward([cache], [[6, 7, 8]])  # rolled back one token, then the block's tail re-verified
    fresh = t.new_cache()
    t.prefill(fresh, list(range(10, 60)) + [5])
    ref, _ = t.forward([fresh], [[6, 7, 8]])
    np.testing.assert_allclose(again[0, :3], ref[0, :3], atol=1e-4)


def test_checkpoint_tapping_the_last_layer_is_refused_with_one_line(tmp_path, tiny_target_dir):
    from tests.conftest import write_tiny_dflash

    ck = write_tiny_dflash(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 3]  # layer 3 is the tiny target's last
    (ck / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "e"
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "dflash", "--checkpoint", str(ck),
                        "--target", str(tiny_target_dir), "--out", str(out), "--target-precision", "int4"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "cannot be tapped" in r.stderr and "--target-precision fp32" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # refused before any graph is built
    assert not out.exists() and not list(tmp_path.glob(".e.tmp-*"))


def test_an_architecture_the_builder_does_not_know_ends_in_one_error(tmp_path, tiny_dflash_dir, tiny_target_dir):
    import shutil

    bad = tmp_path / "target"
    shutil.copytree(tiny_target_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["SmolFutureForCausalLM"]  # transformers loads it by model_type; the builder refuses
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "e"
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "dflash", "--checkpoint",
                        str(tiny_dflash_dir), "--target", str(bad), "--out", str(out), "--target-precision", "int4"],
                       capture_output=True, text=True)
    last = r.stderr.strip().splitlines()[-1]  # progress lines before it (INFO), then one error line
    assert r.returncode == 1 and last.startswith("sharpdraft-export: error: the ONNX Runtime GenAI model builder")
    assert "not currently supported" in last and "--target-precision fp32" in last
    assert "Traceback" not in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".e.*"))


def test_a_corrupt_target_weights_file_is_an_export_error(tmp_path, tiny_dflash_dir, tiny_target_dir):
    import shutil

    bad = tmp_path / "target"
    shutil.copytree(tiny_target_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ExportError, match="corrupt"):
        run_export(ExportConfig(family="dflash", out=tmp_path / "e", checkpoint=tiny_dflash_dir, target=str(bad)))
    assert not (tmp_path / "e").exists()


def test_bad_precision_options_are_refused_before_any_work(tmp_path):
    with pytest.raises(ExportError, match="--target-precision"):
        ExportConfig(family="dflash", out=tmp_path / "e", target_precision="int2")
    with pytest.raises(ExportError, match="--target-kv-io"):
        ExportConfig(family="dflash", out=tmp_path / "e", target_precision="int4", target_kv_io="concat")
    with pytest.raises(ExportError, match="--accuracy-level"):
        ExportConfig(family="dflash", out=tmp_path / "e", accuracy_level=7)


def test_torch_backend_refuses_a_quantized_folder(tiny_int4_engines):
    from runtime.manifest import EngineDirError

    with pytest.raises(EngineDirError, match="torch backend rebuilds the fp32 target"):
        SpecEngine.from_dir(tiny_int4_engines, backend="torch")


@pytest.mark.parametrize("family", ["pard", "eagle3"])
def test_other_families_run_lossless_on_an_int4_target(tmp_path, family, tiny_target_dir, tiny_pard_dir,
                                                       tiny_eagle3_dir):
    """PARD reads no target features (no aux output); EAGLE-3 reads three layers through aux_hidden_states."""
    ck = tiny_pard_dir if family == "pard" else tiny_eagle3_dir
    out = tmp_path / "e"
    m = run_export(ExportConfig(family=family, out=out, checkpoint=ck, target=str(tiny_target_dir), ref_keys=64,
                                target_precision="int4"))
    assert m["graphs"]["target"]["kv_io"] == "shared"
    assert ("aux_hidden_states" in m["graphs"]["target"]["outputs"]) == (family == "eagle3")
    engine = SpecEngine.from_dir(out, check_invariants=True)
    g = torch.Generator().manual_seed(1)
    for n in (5, 60):
        ids = torch.randint(0, 49152, (n,), generator=g).tolist()
        assert engine.generate(ids, 20).token_ids == engine.generate_target_only(ids, 20).token_ids
