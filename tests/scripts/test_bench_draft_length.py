"""scripts/bench_draft_length.py: configuration names and the per-kind summary."""
from __future__ import annotations


import pytest

from runtime.draft_length import DraftConfidence
from scripts.bench_draft_length import parse_config, prompt_kind, summarise


def test_config_names():
    assert parse_config("target-only") == {"speculative": False, "k": None, "confidence": None}
    assert parse_config("fixed") == {"speculative": True, "k": None, "confidence": None}
    assert parse_config("fixed:3")["k"] == 3
    assert parse_config("conf:0.4")["confidence"] == DraftConfidence(0.4)
    for bad in ("fixed:0", "conf:2", "conf:x", "k3", "fixed:"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_summary_is_the_geo_mean_ratio_per_kind():
    rows = [{"prompt": "hamlet", "kind": prompt_kind("hamlet"), "tok_s": {"target-only": 100, "fixed": 200},
             "mal": {"target-only": 1.0, "fixed": 3.0}},
            {"prompt": "typing.py", "kind": prompt_kind("typing.py"), "tok_s": {"target-only": 100, "fixed": 50},
             "mal": {"target-only": 1.0, "fixed": 1.0}},
            {"prompt": "chat0", "kind": prompt_kind("chat0"), "tok_s": {"target-only": 10, "fixed": 20},
             "mal": {"target-only": 1.0, "fixed": 2.0}}]
    s = summarise(rows, ["target-only", "fixed"])
    assert s["prose"]["fixed"] == {"speedup": 2.0, "mal": 3.0} and s["code"]["fixed"]["speedup"] == 0.5
    assert s["all"]["fixed"]["speedup"] == pytest.approx(2 ** (1 / 3), abs=1e-4) and s["all"]["prompts"] == 3
    assert prompt_kind("demo") == "demo" and prompt_kind("chat3") == "chat"
