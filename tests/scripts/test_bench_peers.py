"""scripts/bench_peers.py: the llama.cpp peer's timing loop, and the ratios its summary and headline report."""
from __future__ import annotations

import itertools
import math
import sys
import time

import click
import pytest

from scripts import bench_peers as bp


class FakeLlama:
    """Stands in for ``llama_cpp.Llama``: ``generate`` yields token ids forever (llama.cpp's loop does not stop at
    EOS by itself), remembering the prompt and whether ``reset`` came first."""

    def __init__(self):
        self.resets, self.prompts = 0, []

    def reset(self):
        self.resets += 1

    def generate(self, tokens, temp, top_k, repeat_penalty, reset):
        assert temp == 0.0 and top_k == 1 and repeat_penalty == 1.0 and reset
        self.prompts.append(list(tokens))
        for token in itertools.count(100):
            time.sleep(0.003)  # a token's worth of work, so the decode time is measurable
            yield token


def test_run_llamacpp_takes_exactly_new_tokens_from_a_fresh_prompt():
    llm = FakeLlama()
    row = bp.run_llamacpp(llm, [1, 2, 3], 5)
    assert row["token_ids"] == [100, 101, 102, 103, 104] and row["new_tokens"] == 5
    assert llm.resets == 1 and llm.prompts == [[1, 2, 3]]
    assert row["decode_tokens_per_s"] == pytest.approx(4 / row["decode_s"], rel=1e-2)
    assert row["prefill_s"] >= 0 and row["tokens_per_s"] > 0


def test_missing_llama_cpp_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when it is not installed
    with pytest.raises(click.UsageError, match="pip install llama-cpp-python"):
        bp.load_llamacpp(tmp_path / "model.gguf", 2048, 2)


def _run(decode: float) -> dict:
    return {"decode_tokens_per_s": decode, "tokens_per_s": decode / 2, "prefill_s": 1.0, "step_ms_median": 10.0}


def _result() -> dict:
    """Two kinds at 4096 (prose, code) and one chat prompt; speeds chosen so every ratio is known."""
    configs = ["ortgenai-int4", bp.LLAMACPP, "sharpdraft-int4", "sharpdraft-int4-target-only",
               "sharpdraft-int4-target-only-q1"]
    speeds = {"prose@4096/hamlet_gut": (40, 50, 60, 30, 45), "code@4096/argparse.py": (40, 60, 48, 30, 40),
              "chat/0": (100, 80, 90, 70, 100)}
    prompts = {}
    for key, vals in speeds.items():
        runs = {c: _run(v) for c, v in zip(configs, vals)}
        runs["sharpdraft-int4"].update(mal=2.0, acceptance=[0.6, 0.4], draft_ms_per_step=3.0, verify_ms_per_step=12.0)
        prompts[key] = {"runs": runs, "lossless": True}
    return {"contexts": [4096], "configs": configs, "prompts": prompts}


def test_summary_and_headline_report_llamacpp_and_the_1_token_path():
    result = _result()
    result["summary"] = bp.summarise(result)
    prose = result["summary"]["prose@4096"]["sharpdraft-int4"]
    assert prose[f"x_{bp.LLAMACPP}"] == pytest.approx(60 / 50)
    assert prose["x_sharpdraft-int4-target-only-q1"] == pytest.approx(60 / 45, abs=1e-3)
    assert prose["x_sharpdraft-int4-target-only"] == pytest.approx(2.0)
    assert prose["break_even_mal"] == pytest.approx((3.0 + 12.0) / 10.0)
    head = bp.headline(result)["4096"]
    assert head["groups"] == 3 and head["lossless"] is True
    assert head["sharpdraft-int4"] == pytest.approx(round(math.prod([60 / 40, 48 / 40, 90 / 100]) ** (1 / 3), 3))
    assert head[f"x_{bp.LLAMACPP}"]["sharpdraft-int4"] == pytest.approx(
        round(math.prod([60 / 50, 48 / 60, 90 / 80]) ** (1 / 3), 3))
    assert head[f"x_{bp.LLAMACPP}"]["sharpdraft-int4-target-only"] == pytest.approx(
        round(math.prod([30 / 50, 30 / 60, 70 / 80]) ** (1 / 3), 3))
    assert f"geo-mean x {bp.LLAMACPP} at 4096" in bp._table({**result, "headline": bp.headline(result)})


def test_headline_without_llamacpp_has_no_llamacpp_entry():
    result = _result()
    result["configs"] = [c for c in result["configs"] if c != bp.LLAMACPP]
    for p in result["prompts"].values():
        del p["runs"][bp.LLAMACPP]
    result["summary"] = bp.summarise(result)
    assert f"x_{bp.LLAMACPP}" not in bp.headline(result)["4096"]
