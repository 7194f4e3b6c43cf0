"""scripts/bench_serve.py against the tiny engines: a level runs through the openai SDK, counts tokens and reads
MAL from the vLLM-named counters; the summary divides by target-only."""
import pytest

pytest.importorskip("openai")


def test_one_level_against_a_real_server(tiny_engines, tokenizer):
    from runtime.async_engine import AsyncEngine
    from runtime.engine import SpecEngine
    from runtime.serve import serve_in_thread
    from scripts.bench_serve import prompts_for, run_level, summarise

    engine = SpecEngine.from_dir(tiny_engines, device="cpu")
    prompts = prompts_for(tokenizer, 64, 1)
    assert {name.split("/")[0] for name, _ in prompts} == {"prose", "code", "chat"}
    with serve_in_thread(AsyncEngine(engine, max_running=4, max_waiting=8), "bench") as url:
        spec = run_level(url, "bench", prompts, 2, 3, 6, True, 120)
        base = run_level(url, "bench", prompts, 2, 3, 6, False, 120)
    assert spec["requests"] == base["requests"] == 3 and spec["errors"] == base["errors"] == 0
    assert spec["output_tokens"] == base["output_tokens"] == 18  # ignore_eos: exactly max_tokens each
    assert spec["mal"] is not None and spec["mal"] >= 1.0 and base["mal"] is None
    assert spec["ttft_mean_s"] > 0 and spec["tpot_mean_s"] > 0
    ratio = summarise({"levels": {"2": {"speculative": spec, "target-only": base}}})
    assert ratio["2"]["speculative"] == pytest.approx(spec["output_tokens_per_s"] / base["output_tokens_per_s"],
                                                      abs=1e-3)
