"""scripts/bench_speed.py and scripts/bench_settings.py end to end on the tiny engines."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_speed_on_tiny_engines(tiny_engines, tmp_path):
    out = tmp_path / "speed"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--engine", str(tiny_engines),
                        "--contexts", "64,128", "--kinds", "prose,code", "--new-tokens", "6", "--end-token", "400",
                        "--draft-tokens", "1", "--threads", "1", "--qs-reps", "4", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_speed.json").read_text())
    assert res["configs"] == ["sharpdraft", "sharpdraft-k1", "ort-target-only", "hf-generate", "hf-prompt-lookup"]
    assert res["kv_io"] == "static"
    assert set(res["prompts"]) == {"prose@64/hamlet_gut", "prose@128/hamlet_gut", "code@64/argparse.py",
                                   "code@128/argparse.py"}
    for entry in res["prompts"].values():
        assert entry["lossless"]
        assert isinstance(entry["hf_agrees_with_ort"], bool)
        runs = entry["runs"]
        assert all(run["new_tokens"] == 6 for run in runs.values())
        assert runs["sharpdraft-k1"]["acceptance"] and len(runs["sharpdraft-k1"]["acceptance"]) == 1
        for c in ("sharpdraft", "ort-target-only"):
            assert 0 <= runs[c]["overhead_ms_per_step"] <= runs[c]["step_ms_median"]
        qs = entry["query_scale"]
        assert qs["beta_muls_removed"] == 2 and qs["ratio"] > 0  # the tiny drafter has 2 scaled attentions
    for group in ("prose@64", "prose@128", "code@64", "code@128"):
        g = res["summary"][group]
        assert g["lossless"] and g["sharpdraft"]["mal"] >= 1.0
        assert g["sharpdraft"]["speedup_vs_hf-generate"] > 0 and g["sharpdraft-k1"]["speedup_vs_ort-target-only"] > 0
    for name in ("speed_vs_context.png", "overhead_vs_context.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "baselines tok/s" in r.stdout


def test_bench_speed_refuses_unknown_kind(tiny_engines, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_speed.py"), "--engine", str(tiny_engines),
                        "--kinds", "poetry", "--no-hf", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "unknown kinds" in r.stderr


def test_bench_settings_on_tiny_engines(tiny_engines, tmp_path):
    out = tmp_path / "settings"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_settings.py"), "--engine", str(tiny_engines),
                        "--context", "64", "--prefill-tokens", "96", "--chunks", "32,0", "--rounds", "3",
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_settings.json").read_text())
    assert set(res["prefill_s"]) == {"32", "0"} and all(v > 0 for v in res["prefill_s"].values())
    assert len(res["threads"]) >= 2
    assert all(v["draft"] > 0 and v["verify"] > 0 and v["decode"] > 0 for v in res["threads"].values())
    assert (out / "settings.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_settings_compares_kv_forms(tiny_engines, concat_engines, tmp_path):
    out = tmp_path / "kv"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_settings.py"), "--engine", str(tiny_engines),
                        "--compare-engine", str(concat_engines), "--skip-threads", "--kv-contexts", "40,90",
                        "--rounds", "3", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    forms = json.loads((out / "bench_kv_forms.json").read_text())["kv_forms"]
    assert set(forms) == {"40", "90"}
    for per_form in forms.values():
        assert set(per_form) == {"static", "concat"}
        for t in per_form.values():
            for key in ("decode", "verify", "draft"):
                assert 0 < t[key + "_ort"] <= t[key]


@pytest.mark.parametrize("method", ["dynamic-int8", "nbits4"])
def test_bench_settings_int8_drafter(tiny_engines, tmp_path, method):
    out = tmp_path / "int8"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_settings.py"), "--engine", str(tiny_engines),
                        "--context", "64", "--skip-threads", "--int8-drafter", "--drafter-quant", method,
                        "--rounds", "5", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_int8_drafter.json").read_text())["int8_drafter"]
    assert res["method"] == method
    assert res["positions"] == 32 and set(res["draft_ms"]) == {"fp32", "int8"}
    assert all(v > 0 for v in res["draft_ms"].values())
    assert 0 <= res["same_all_slots"] <= res["same_slot1"] <= 1
    assert res["drafter_bytes"]["int8"] < res["drafter_bytes"]["fp32"]  # tiny graph: structure, not weights


def test_bench_peers_on_tiny_int4_engines(tmp_path, tiny_target_dir, tiny_dflash_dir):
    pytest.importorskip("onnxruntime_genai")
    from export.pipeline import ExportConfig, run_export

    eng = tmp_path / "int4"
    run_export(ExportConfig(family="dflash", out=eng, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                            ref_keys=64, target_precision="int4"))
    out = tmp_path / "peers"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--engine", str(eng),
                        "--contexts", "64", "--kinds", "prose,chat", "--chat-prompts", "1", "--new-tokens", "12",
                        "--no-fp32-peer", "--peer-dir", str(tmp_path / "built"), "--out", str(out),
                        "--prompt-lookup", "1:3:5"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_peers.json").read_text())
    assert "sharpdraft-int4+lookup" in res["configs"]
    lk = res["summary"]["prose@64"]["sharpdraft-int4+lookup"]
    assert lk["mal"] >= 1.0 and "x_sharpdraft-int4-target-only" in lk and lk["break_even_mal"] > 0
    assert set(res["summary"]) == {"prose@64", "chat"} and (out / "peers.png").read_bytes()[:4] == b"\x89PNG"
    head = res["headline"]["64"]  # geo-mean over prose@64 and chat of each configuration's ratio to ORT GenAI int4
    assert head["groups"] == 2 and head["lossless"] is True
    want = (res["summary"]["prose@64"]["sharpdraft-int4+lookup"]["x_ortgenai-int4"]
            * res["summary"]["chat"]["sharpdraft-int4+lookup"]["x_ortgenai-int4"]) ** 0.5
    assert head["sharpdraft-int4+lookup"] == pytest.approx(want, abs=2e-3) and "ortgenai-int4" not in head
    assert "geo-mean x ortgenai-int4 at 64 over 2 kinds" in r.stdout
    for entry in res["prompts"].values():
        assert entry["lossless"]
        # the runtime's 1-token path reproduces ORT GenAI's own generator on the same builder graph
        assert entry["first_difference"]["sharpdraft 1-token path vs ortgenai-int4"] is None
        assert all(run["decode_tokens_per_s"] > 0 for run in entry["runs"].values())
    g = res["summary"]["prose@64"]["sharpdraft-int4"]
    assert g["mal"] >= 1.0 and "x_ortgenai-int4" in g and g["break_even_mal"] > 0
