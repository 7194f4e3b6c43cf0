"""scripts/bench_long_context.py end to end on the tiny engines (child process per configuration, lossless check)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_long_context_on_tiny_engines(tiny_engines, tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_long_context.py"),
                        "--engine", f"scaled={tiny_engines}", "--contexts", "64,128", "--new-tokens", "6",
                        "--end-token", "400", "--docs", "argparse.py,hamlet_gut", "--threads", "1",
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "bench_long_context.json").read_text())
    assert res["configs"] == ["target-only", "frozen", "scaled"]
    assert res["trainable_params"] > 0
    for c in ("frozen", "scaled"):
        for ctx in ("64", "128"):
            s = res["summary"][c][ctx]
            assert 1.0 <= s["mal"] and s["speedup_geomean"] > 0 and len(s["acceptance"]) >= 1
        rows = res["runs"][c]["rows"]
        assert set(rows) == {"argparse.py@64", "argparse.py@128", "hamlet_gut@64", "hamlet_gut@128"}
        assert all(row["new_tokens"] == 6 for row in rows.values())
    assert res["runs"]["target-only"]["peak_rss_mb"] > 0
    for name in ("mal_vs_context.png", "acceptance_vs_position.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "| frozen |" in r.stdout
    assert res["summary"]["scaled"]["64"]["decode_speedup_geomean"] > 0
    # --reuse: every configuration is kept from the run above; only the summary is rebuilt
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_long_context.py"),
                            "--engine", f"scaled={tiny_engines}", "--contexts", "64,128", "--new-tokens", "6",
                            "--end-token", "400", "--docs", "argparse.py,hamlet_gut", "--out", str(out), "--reuse"],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reusing") == 3
    assert json.loads((out / "bench_long_context.json").read_text())["summary"] == res["summary"]


def test_bench_refuses_unknown_document(tiny_engines, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_long_context.py"),
                        "--engine", f"s={tiny_engines}", "--docs", "nosuch.py", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "unknown held-out documents" in r.stderr
