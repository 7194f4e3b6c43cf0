"""scripts/bench_threads.py on the tiny int4 pair: each setting in its own process, rotated, lossless; and the
per-role session settings it relies on."""
import json
import subprocess
import sys

import pytest

from runtime.backends.ort import session_options
from tests.conftest import ROOT


def _cfg(so) -> tuple[int, str]:
    return so.intra_op_num_threads, so.get_session_config_entry("session.intra_op.allow_spinning")


def test_role_defaults_and_overrides(monkeypatch):
    for k in ("SHARPDRAFT_THREADS", "SHARPDRAFT_ORT_SPIN", "SHARPDRAFT_TARGET_SPIN", "SHARPDRAFT_DRAFTER_THREADS",
              "SHARPDRAFT_TARGET_THREADS", "SHARPDRAFT_DRAFTER_SPIN"):
        monkeypatch.delenv(k, raising=False)
    assert _cfg(session_options(2, "target")) == (2, "1")  # the target's pool spins (ORT's own default)
    assert _cfg(session_options(2, "drafter")) == (1, "0")  # the drafter: the calling thread only
    assert _cfg(session_options(2)) == (2, "0")
    monkeypatch.setenv("SHARPDRAFT_DRAFTER_THREADS", "3")
    monkeypatch.setenv("SHARPDRAFT_ORT_SPIN", "0")
    assert _cfg(session_options(2, "drafter")) == (3, "0") and _cfg(session_options(2, "target")) == (2, "0")
    monkeypatch.setenv("SHARPDRAFT_TARGET_SPIN", "1")
    monkeypatch.setenv("SHARPDRAFT_TARGET_THREADS", "4")
    assert _cfg(session_options(2, "target")) == (4, "1")


def test_bench_threads_on_tiny_pair(tiny_int4_engines, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "threads.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_threads.py"), "--engine",
                        str(tiny_int4_engines), "--context", "64", "--new-tokens", "6", "--rounds", "2",
                        "--settings", "default,no-spin", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["summary"]) == {"default", "no-spin"} and len(res["runs"]["default"]) == 2
    for s in res["summary"].values():
        assert set(s) == {"hamlet_gut@64", "argparse.py@64", "chat"}
        assert all(v["lossless"] and v["speculative"] > 0 and v["mal"] >= 1 for v in s.values())
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_threads.py"), "--engine",
                          str(tiny_int4_engines), "--settings", "turbo"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "unknown settings" in bad.stderr
