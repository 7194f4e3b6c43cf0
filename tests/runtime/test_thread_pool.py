"""runtime/ort_threads.py: one ONNX Runtime pool shared by the target and drafter sessions (the entry points'
default) gives the same greedy output as a pool per session, refuses to start after a session exists, and the
--thread-pool option reaches it. The pool is process-wide, so each case runs in a subprocess."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

_SAME_OUTPUT = """
import json, sys
from runtime import ort_threads
pool = sys.argv[2]
if pool == "shared":
    assert ort_threads.use_shared_thread_pool(2) == 2 and ort_threads.use_shared_thread_pool() == 2
from runtime.engine import SpecEngine
from runtime.sampling import SamplingParams
engine = SpecEngine.from_dir(sys.argv[1])
opts = [engine.target.session.get_session_options(), engine.drafter.session.get_session_options()]
ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")
spec = engine.generate(ids, 12)
base = engine.generate_target_only(ids, 12)
print(json.dumps({"spec": spec.token_ids, "base": base.token_ids, "pool": ort_threads.shared_thread_pool(),
                  "per_session": [o.use_per_session_threads for o in opts]}))
"""


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env={**os.environ, **(env or {})})


def test_shared_pool_gives_the_per_session_output(tiny_int4_engines):
    pytest.importorskip("onnxruntime_genai")
    out = {}
    for pool in ("shared", "per-session"):
        r = _run(_SAME_OUTPUT, str(tiny_int4_engines), pool)
        assert r.returncode == 0, r.stderr[-3000:]
        out[pool] = json.loads(r.stdout.strip().splitlines()[-1])
    shared, own = out["shared"], out["per-session"]
    assert shared["pool"] == 2 and shared["per_session"] == [False, False]
    assert own["pool"] is None and own["per_session"] == [True, True]
    assert shared["spec"] == shared["base"] == own["spec"] == own["base"] and len(shared["spec"]) == 12


def test_shared_pool_after_a_session_is_refused():
    code = """
from runtime import ort_threads
ort_threads.session_options(1, "drafter")
try:
    ort_threads.use_shared_thread_pool()
except RuntimeError as e:
    print("refused:", e)
"""
    r = _run(code)
    assert r.returncode == 0 and "refused: use_shared_thread_pool() must run before" in r.stdout, r.stderr


def test_generate_cli_runs_on_the_shared_pool(tiny_int4_engines, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "g.json"
    r = subprocess.run([sys.executable, "-m", "runtime.generate", "--engine", str(tiny_int4_engines), "--prompt",
                        "Hello there", "--max-new-tokens", "8", "--temperature", "0", "--repeats", "1",
                        "--json-out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "SHARPDRAFT_ORT_THREAD_POOL": "shared"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["lossless"] is True
    assert "shared pool of" in r.stdout and "global thread pool" not in r.stderr  # no ORT warning per session
    bad = subprocess.run([sys.executable, "-m", "runtime.generate", "--engine", str(tiny_int4_engines),
                          "--thread-pool", "global"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--thread-pool" in bad.stderr
