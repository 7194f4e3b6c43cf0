"""scripts/profile_round.py: the per-round profile on the tiny int4 pair (lossless, the parts of a step add up,
break-even MAL is the round over the 1-token step, ORT's kernels named) and the kernel table's row exactness."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT


def test_loop_profile_on_tiny_int4_pair(tiny_int4_engines, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_round.py"), "loop", "--engine",
                        str(tiny_int4_engines), "--contexts", "64", "--draft-tokens", "1,2", "--new-tokens", "8",
                        "--repeats", "3", "--ort-profile", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "round_profile.json").read_text())
    s = res["summary"]["64"]
    assert set(s) == {"1-token", "block", "spec k=1", "spec k=2"}
    for name, row in s.items():
        assert row["step_ms"] > 0 and row["ort_ms"] > 0 and row["runtime_ms"] >= 0
        if name.startswith("spec"):
            assert row["lossless"] and 1 <= row["mal"] <= int(name[-1]) + 1
            assert row["break_even_mal"] == pytest.approx(row["step_ms"] / s["1-token"]["step_ms"], abs=2e-3)
    assert s["1-token"]["x_1token"] == 1.0
    prices = res["block_prices"]["64"]
    assert list(prices) == ["1", "2", "3"] and all(v > 0 for v in prices.values())
    prof = res["ort_profile"]
    assert set(prof) == {"verify (q = 3)", "draft", "1-token step"}
    assert "MatMulNBits" in prof["verify (q = 3)"]["ops"] and prof["draft"]["runs"] >= 1
    floor = res["floor"]
    assert floor["target_weight_bytes"] > 0 and floor["read_bandwidth"]["dram_gb_s"] > 0
    assert "| 64 | spec k=2 |" in (tmp_path / "round_profile.md").read_text()


def test_row_quantized_stack_is_row_exact_and_matches_fp32():
    """The per-row int8 MatMulInteger stack of the kernels table: row 0's result does not depend on the block, and
    it tracks the fp32 stack it quantizes (so the table times a real computation, not a broken graph)."""
    from scripts.profile_round import _stack, time_rows
    import onnxruntime as ort

    times, exact = time_rows(_stack("rowq-int8", layers=2), (1, 3), repeats=3, threads=1)
    assert exact and set(times) == {1, 3}
    x = np.random.default_rng(1).standard_normal((3, 576)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    outs = [ort.InferenceSession(_stack(kind, layers=2).SerializeToString(), so,
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})[0] for kind in
            ("fp32", "rowq-int8")]
    rel = np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max()
    assert rel < 0.05, rel
