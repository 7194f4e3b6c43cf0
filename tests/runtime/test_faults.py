"""Fault injection against a real uvicorn server on loopback (scripts/fault_injection.py), bounded in time:
hang-ups at random points (streaming and not), malformed JSON, oversized bodies, invalid parameters, a burst past
capacity, an engine error mid-batch. Afterwards: nothing leaked (sequences, admissions, streams, threads) and a
normal request equals its solo target-only run."""
import asyncio
import threading
import time

import pytest

from runtime.async_engine import AsyncEngine
from runtime.engine import SpecEngine
from scripts.fault_injection import PROMPTS, run_faults
from tests.runtime.test_serve import uvicorn_server


@pytest.fixture()
def server(tiny_engines):
    engine = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    tok = engine.tokenizer
    expected = {p: tok.decode(engine.generate_target_only(tok.encode(p), 12).token_ids, skip_special_tokens=True)
                for p in PROMPTS}
    fault = {"armed": False, "fired": 0}
    forward = engine.target.forward

    def flaky_forward(*a, **k):
        if fault["armed"]:
            fault["armed"] = False
            fault["fired"] += 1
            raise RuntimeError("injected engine fault")
        return forward(*a, **k)

    engine.target.forward = flaky_forward
    aeng = AsyncEngine(engine, max_running=3, max_waiting=3)
    with uvicorn_server(aeng, log_level="error") as url:
        yield url, engine, aeng, expected, fault


def test_fault_mix_leaves_no_leaks_and_exact_outputs(server):
    url, engine, aeng, expected, fault = server
    threads_before = threading.active_count()
    t0 = time.monotonic()
    report = asyncio.run(run_faults(url, requests=40, seed=0, expected=expected,
                                    arm_engine_error=lambda: fault.update(armed=True)))
    assert time.monotonic() - t0 < 120
    sent, status = report["sent"], report["status"]
    assert report["drained"] and report["final_status"] == 200 and report["final_equal"], report
    assert report["mismatched"] == 0, report
    assert status.get(413, 0) == sent.get("oversized", 0) > 0
    assert status.get(400, 0) >= sent.get("malformed", 0) + sent.get("bad-params", 0)
    assert report["burst"].get(429, 0) >= 4 and "429 without Retry-After" not in report["burst"], report["burst"]
    assert fault["fired"] == 1  # the engine error hit a step; the server kept serving
    assert report["metrics_aborted"] >= 1 and not report["client_errors"], report
    # nothing leaked: no sequence, admission, stream or waiting entry left; no thread left behind
    assert not engine.sequences and aeng._pending == 0 and not aeng._streams and not aeng._waiting
    for _ in range(100):
        if threading.active_count() <= threads_before:
            break
        time.sleep(0.05)
    assert threading.active_count() <= threads_before
