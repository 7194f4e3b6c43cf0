"""scripts/bench_scale.py's pieces that do not need real-size weights: shapes, phase accounting."""
import logging
import time

import numpy as np
import pytest

from export.validate import DRAFTER_ATOL, DRAFTER_RTOL, drafter_bound
from runtime.models.dflash import DFlashConfig
from scripts.bench_scale import DFLASH_8B, QWEN3_0_6B, QWEN3_8B_CUT, PeakRss, _PhaseLog, dflash_config


def test_the_scale_shapes_are_the_published_ones():
    import json

    real = DFlashConfig.from_dict(json.loads(DFLASH_8B.read_text()))
    h, inter, n = real.hidden_size, real.intermediate_size, real.num_hidden_layers
    kv = real.num_key_value_heads * real.head_dim
    layer = 2 * h * real.num_attention_heads * real.head_dim + 2 * h * kv + 3 * h * inter
    assert 1.0e9 < n * layer + 5 * h * h < 1.1e9  # the "about 1 B parameters" of Qwen3-8B-DFlash-b16
    small = DFlashConfig.from_dict(dflash_config(1024, 16, 8, 128, 3072, QWEN3_0_6B["num_hidden_layers"]))
    assert small.hidden_size == QWEN3_0_6B["hidden_size"] and small.block_size == real.block_size == 16
    assert len(small.target_layer_ids) == 5 and max(small.target_layer_ids) < QWEN3_0_6B["num_hidden_layers"] - 1


def test_the_8b_cut_target_keeps_qwen3_8b_layers_and_the_drafter_taps_fit():
    cut = QWEN3_8B_CUT
    h, inter, heads, kv = cut["hidden_size"], cut["intermediate_size"], cut["num_attention_heads"], \
        cut["num_key_value_heads"]
    assert (h, inter, heads, kv, cut["head_dim"], cut["vocab_size"]) == (4096, 12288, 32, 8, 128, 151936)
    layer = 2 * h * heads * 128 + 2 * h * kv * 128 + 3 * h * inter
    params = cut["num_hidden_layers"] * layer + 2 * cut["vocab_size"] * h  # untied tables, as Qwen3-8B's
    assert 2.7e9 < params < 2.9e9 and not cut["tie_word_embeddings"]
    taps = dflash_config(h, heads, kv, 128, inter, cut["num_hidden_layers"])["dflash_config"]["target_layer_ids"]
    assert taps == [1, 2, 3, 4, 5] and max(taps) < cut["num_hidden_layers"]


def test_phases_follow_the_export_progress_lines(monkeypatch):
    """Phase bookkeeping on a controlled resident-set reading (a real allocation's effect on a test process's RSS
    depends on the allocator's state: CI saw a 64 MB array add 0.02 GB)."""
    assert 0 < PeakRss.rss() < 1 << 40  # the real reading: this process's VmRSS in bytes
    level = {"bytes": 1 << 30}
    monkeypatch.setattr(PeakRss, "rss", staticmethod(lambda: level["bytes"]))
    meter = PeakRss(period=0.005)
    log = logging.getLogger("sharpdraft.export.test_bench_scale")
    log.setLevel(logging.INFO)
    handler = _PhaseLog(meter)
    log.addHandler(handler)
    try:
        log.info("exporting drafter ...")
        level["bytes"] = 3 << 30  # a 2 GB spike inside the phase, seen by the sampling thread
        deadline = time.monotonic() + 10
        while meter.peak < 3 << 30 and time.monotonic() < deadline:
            time.sleep(0.005)
        log.info("query-scale rewrite: {...}")  # not a phase line
        level["bytes"] = 1 << 30
        log.info("validating the drafter graph (ORT vs torch) ...")
    finally:
        log.removeHandler(handler)
    phases = meter.close()
    names = [p["phase"] for p in phases]
    assert names == ["start", "exporting drafter", "validating the drafter graph (ORT vs torch)"]
    assert [p["peak_rss_gb"] for p in phases] == [1.0, 3.0, 1.0]


def test_the_drafter_bound_widens_with_the_key_count():
    from export.validate import ROPE_ULP

    ref = np.array([10.0, -40.0])
    assert drafter_bound(ref, 100) == pytest.approx(DRAFTER_ATOL + 40 * (DRAFTER_RTOL + 100 * ROPE_ULP))
    n = 4 * 8192  # past 8,192 keys: the summation term doubles at 4x, the rotary term grows with the position
    assert drafter_bound(ref, n) == pytest.approx(2 * DRAFTER_ATOL + 40 * (2 * DRAFTER_RTOL + n * ROPE_ULP))
    assert drafter_bound(ref, [100, n]) == drafter_bound(ref, n)  # per-row counts: the largest
