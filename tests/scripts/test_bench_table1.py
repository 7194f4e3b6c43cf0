"""scripts/bench_table1.py end to end on the tiny engines (child process per configuration, lossless check, online
adaptation rows on the torch backend, chat prompts, --reuse)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = str(ROOT / "scripts" / "bench_table1.py")


def test_bench_table1_on_tiny_engines(tiny_engines, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "bench"
    args = [sys.executable, BENCH, "--engine", f"scaled={tiny_engines}", "--frozen-engine", f"again={tiny_engines}",
            "--contexts", "64,128", "--new-tokens", "6", "--end-token", "400", "--docs", "argparse.py,hamlet_gut",
            "--chat", "1", "--online", "lora,full", "--adapt-rank", "2", "--threads", "1", "--out", str(out)]
    r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_table1.json").read_text())
    assert res["configs"] == ["target-only", "frozen", "scaled", "again", "target-only-torch", "frozen-torch",
                              "lora-online", "full-online"]
    assert res["drafter_params"] > 0
    t = res["trainable_params"]
    assert t["frozen"] == t["scaled"] == 0 and 0 < t["lora-online"] < t["full-online"] == res["drafter_params"]
    for c in ("frozen", "scaled", "again", "frozen-torch", "lora-online", "full-online"):
        for ctx in ("64", "128"):
            s = res["summary"][c][ctx]
            assert 1.0 <= s["mal"] and s["speedup_geomean"] > 0 and len(s["acceptance"]) >= 1
            assert "mal_chat" in s and "mal_documents" in s
        rows = res["runs"][c]["rows"]
        assert {n.split("@")[0] for n in rows} == {"argparse.py", "hamlet_gut", "chat:hamlet_gut"}
        assert all(row["new_tokens"] == 6 for row in rows.values())
    # the frozen-engine row ran the same folder with the scale off: the same outputs and MAL as "frozen"
    assert res["runs"]["again"]["query_scale_on"] is False
    assert res["summary"]["again"]["64"]["mal"] == res["summary"]["frozen"]["64"]["mal"]
    assert res["runs"]["lora-online"]["backend"] == "torch" and res["runs"]["lora-online"]["online"]["steps"] > 0
    assert res["runs"]["frozen-torch"]["backend"] == "torch" and res["runs"]["frozen-torch"]["online"] is None
    assert t["frozen-torch"] == 0
    assert res["runs"]["target-only"]["peak_rss_mb"] > 0
    for name in ("mal_vs_context.png", "acceptance_vs_position.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "| frozen | 0 |" in r.stdout and "| lora-online |" in r.stdout
    # --reuse: every configuration is kept from the run above; only the summary is rebuilt
    again = subprocess.run([*args, "--reuse"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reusing") == 8
    assert json.loads((out / "bench_table1.json").read_text())["summary"] == res["summary"]


def test_bench_refuses_unknown_document_mode_and_label(tiny_engines, tmp_path):
    r = subprocess.run([sys.executable, BENCH, "--engine", f"s={tiny_engines}", "--docs", "nosuch.py",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "unknown held-out documents" in r.stderr
    r = subprocess.run([sys.executable, BENCH, "--engine", f"s={tiny_engines}", "--online", "qlora",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "unknown online modes" in r.stderr
    r = subprocess.run([sys.executable, BENCH, "--engine", f"lora-online={tiny_engines}", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "reserved" in r.stderr


def test_online_rows_refuse_a_quantized_folder_before_running_anything(tiny_int4_engines, tmp_path):
    """The torch backend rebuilds the fp32 target: an int4 folder for the online rows is refused up front, with what
    to do, and nothing has run."""
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, BENCH, "--engine", f"s={tiny_int4_engines}", "--online", "lora",
                        "--contexts", "64", "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "--target-precision fp32" in r.stderr and "--online-engine" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_rounds_rotate_and_only_keeps_the_baseline(tiny_engines, tmp_path):
    """--rounds 2 runs each configuration twice, the second round in a rotated order, timings merged by median;
    --only runs the named configurations plus their target-only."""
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, BENCH, "--engine", f"scaled={tiny_engines}", "--contexts", "64",
                        "--new-tokens", "4", "--end-token", "400", "--docs", "argparse.py", "--only", "scaled",
                        "--rounds", "2", "--threads", "1", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_table1.json").read_text())
    assert res["configs"] == ["target-only", "scaled"] and res["rounds"] == 2
    assert res["orders"] == [["target-only", "scaled"], ["scaled", "target-only"]]
    assert (out / "run_scaled.r1.json").is_file() and res["runs"]["scaled"]["rounds"] == 2
    assert "(round 2)" in r.stdout
    bad = subprocess.run([sys.executable, BENCH, "--engine", f"scaled={tiny_engines}", "--only", "lora-online",
                          "--out", str(tmp_path / "b2")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "unknown configurations" in bad.stderr


def test_merge_rounds_takes_medians_and_refuses_differing_tokens():
    from scripts import bench_table1 as bt

    def run(t, toks, rss):
        row = {k: t for k in bt.TIMINGS} | {"token_ids": toks, "mal": 2.0}
        return {"rows": {"p@64": row}, "peak_rss_mb": rss}

    merged = bt.merge_rounds("x", [run(1.0, [1, 2], 10), run(3.0, [1, 2], 30), run(2.5, [1, 2], 20)])
    assert merged["rows"]["p@64"]["decode_s"] == 2.5 and merged["peak_rss_mb"] == 30 and merged["rounds"] == 3
    with pytest.raises(SystemExit, match="rounds gave different tokens"):
        bt.merge_rounds("x", [run(1.0, [1, 2], 10), run(1.0, [1, 3], 10)])
    assert bt.rotations(list("abcd"), 2) == [list("abcd"), list("cdab")]
