"""Generate from a prompt through an engines/ folder, speculative and target-only side by side.

    python -m runtime.generate --engine engines/ --prompt "Write a Python function that ..." --max-new-tokens 128

Prints the text, mean accepted length (MAL), tokens/s of both runs and the speedup, and checks that the
speculative token ids equal the target-only greedy ids (lossless). Exit code 3 if they differ. Each configuration
runs ``--repeats`` times in rotated order and the median run by tokens/s is reported (a 2-core machine's timing of
one run swings by +-15%). Then runs the same
prompt sampled (``--temperature``, default 0.8; 0 skips it) and reports its MAL beside the greedy MAL.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from runtime.benchmarking import rotated_runs
from runtime.draft_length import DEFAULT_CONFIDENCE, DraftCost
from runtime.draft_length import click_option as draft_confidence_option
from runtime.ort_threads import apply as apply_thread_pool
from runtime.ort_threads import click_option as thread_pool_option
from runtime.ort_threads import shared_thread_pool
from runtime.prompt_lookup import DEFAULT_SPEC as PROMPT_LOOKUP_DEFAULT
from runtime.prompt_lookup import click_option as prompt_lookup_option

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, and explain how it works."


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path), show_default=True)
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True)
@click.option("--raw", is_flag=True, help="use the prompt as plain text (default: the tokenizer's chat template)")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default="auto", type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--backend", default="onnxruntime", show_default=True, type=click.Choice(["onnxruntime", "torch"]),
              help="torch: rebuild the pair from the manifest's sources in PyTorch (drafter on the fused op)")
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(min=0),
              help="also run a sampled speculative generation at this temperature (0: skip)")
@click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="nucleus of the sampled run (the tail below it is cut, as chat front-ends do: at 1.0 a 135M "
                   "model's 1e-6 tail tokens are drawn now and then and derail the text)")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=-1))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="timed runs per configuration, in rotated order; the median run by tokens/s is reported "
                   "(1 with --online-adapt, whose drafter changes as it runs)")
@click.option("--json-out", type=click.Path(path_type=Path), default=None, help="also write the figures as JSON")
@click.option("--online-adapt", type=click.Choice(["lora", "full"]), default=None,
              help="torch backend: adapt the drafter online to the target's verified tokens (runtime/online_adapt.py)")
@click.option("--adapt-rank", default=8, show_default=True, type=click.IntRange(min=1), help="LoRA rank")
@click.option("--adapt-lr", default=1e-4, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--adapt-interval", default=1, show_default=True, type=click.IntRange(min=1),
              help="verify rounds per gradient step")
@prompt_lookup_option(
    "also draft by prompt lookup: a row whose last MIN..MAX tokens occurred before verifies what followed them "
    "instead of the drafter's guess (runtime/prompt_lookup.py); 'off' for the drafter alone",
    default=PROMPT_LOOKUP_DEFAULT)
@draft_confidence_option(DEFAULT_CONFIDENCE)
@thread_pool_option()
def main(engine_dir, prompt, raw, max_new_tokens, device, backend, temperature, top_p, top_k, seed, repeats,
         json_out, online_adapt, adapt_rank, adapt_lr, adapt_interval, prompt_lookup, draft_confidence, thread_pool):
    from runtime.engine import SpecEngine
    from runtime.manifest import EngineDirError
    from runtime.sampling import SamplingParams

    try:
        adapt = None
        if online_adapt is not None:
            from runtime.online_adapt import AdaptConfig

            adapt = AdaptConfig(online_adapt, adapt_rank, adapt_lr, adapt_interval)
        if backend == "onnxruntime":
            apply_thread_pool(thread_pool)
        engine = SpecEngine.from_dir(engine_dir, device=device, backend=backend, prompt_lookup=prompt_lookup,
                                     draft_confidence=draft_confidence, online_adapt=adapt)
        adapter = engine.adapter
        tok = engine.tokenizer
        ids = tok.encode(prompt) if raw else tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)
        engine.generate(ids[:8] or [0], 4)  # warm-up: first runs allocate

        def one_token_steps():  # int8-activation target: its plain 1-token steps, as ORT GenAI decodes
            saved, engine.target.min_q = engine.target.min_q, 1
            try:
                return engine.generate_target_only(ids, max_new_tokens)
            finally:
                engine.target.min_q = saved

        runs = {"base": lambda: engine.generate_target_only(ids, max_new_tokens),
                "spec": lambda: engine.generate(ids, max_new_tokens)}
        if getattr(engine.target, "min_q", 1) > 1:
            runs["plain"] = one_token_steps
        timed = rotated_runs(runs, 1 if adapter is not None else repeats)
        base, spec, plain = timed["base"], timed["spec"], timed.get("plain")
        sampled = None
        if temperature > 0:
            sampled = engine.generate(ids, params=SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                                 top_p=top_p, top_k=top_k, seed=seed))
    except (EngineDirError, ValueError, RuntimeError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    reps = len(timed["all"]["spec"])
    text = tok.decode(spec.token_ids, skip_special_tokens=True)
    s, b = spec.stats, base.stats
    speedup = s.tokens_per_s / b.tokens_per_s if b.tokens_per_s else 0.0
    click.echo(f"--- prompt ({len(ids)} tokens) ---\n{prompt}\n--- completion ({len(spec.token_ids)} tokens, "
               f"finish_reason={spec.finish_reason}) ---\n{text}\n---")
    m = engine.manifest
    qs = m.query_scale
    drafter_precision = m.graphs["drafter"].precision or "fp32"
    verified = (f"up to {m.drafter.num_draft_tokens} draft tokens verified per round, the length with the most "
                "expected tokens per second under the measured round cost"
                if isinstance(draft_confidence, DraftCost) and engine.drafter is not None else
                f"up to {m.drafter.num_draft_tokens} draft tokens verified per round, cut where the "
                f"drafter's cumulative confidence falls below {draft_confidence.threshold}"
                if draft_confidence is not None and engine.drafter is not None else
                f"{engine.default_draft_tokens} of {m.drafter.num_draft_tokens} draft tokens verified per round")
    pool = shared_thread_pool()
    threads = (f" (ONNX Runtime: one shared pool of {pool} threads)" if pool else
               " (ONNX Runtime: a pool per session)" if backend == "onnxruntime" else "")
    click.echo(f"backend: {backend}{threads}; drafter: {m.drafter.family.value} ({drafter_precision} graph), "
               f"{verified}, query scale {'on' if qs.profile.enabled else 'off'} (ref_keys {qs.profile.ref_keys}, "
               f"from the {qs.source})")
    click.echo(f"mean accepted length (MAL): {s.mean_accepted_length:.3f} over {s.rounds} rounds; acceptance per "
               f"draft position: {[round(a, 2) for a in s.acceptance_per_position]}")
    if engine.prompt_lookup is not None:
        click.echo(f"prompt lookup ({prompt_lookup.spec}): {s.lookup_rounds} of the rounds verified a copy, "
                   f"{s.lookup_accepted} of their draft tokens accepted")
    click.echo(f"speculative: {s.tokens_per_s:.1f} tokens/s (draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s)")
    precision = m.target.precision
    click.echo(f"target-only: {b.tokens_per_s:.1f} tokens/s (the same {precision} target graph, no drafter)")
    if plain is not None:
        click.echo(f"target-only with 1-token steps (as ONNX Runtime GenAI decodes; rounds differently, "
                   f"docs/quantized-target.md): {plain.stats.tokens_per_s:.1f} tokens/s")
    click.echo(f"speedup over target-only: {speedup:.2f}x" + (
        f" (over its 1-token steps: {s.tokens_per_s / plain.stats.tokens_per_s:.2f}x)"
        if plain is not None and plain.stats.tokens_per_s else "") + (
        f"; median of {reps} rotated runs each (speculative {_spread(timed['all']['spec'])}, target-only "
        f"{_spread(timed['all']['base'])} tokens/s)" if reps > 1 else ""))
    if adapter is not None:
        click.echo(f"online adaptation: {json.dumps(adapter.stats())}")
    if s.rounds >= 4 and s.mean_accepted_length < 1.05:
        click.echo("note: the target accepted (almost) no draft token, so speculation only costs time here. The "
                   "drafter does not predict this target: check it was trained for this target and tokenizer "
                   "(docs/drafter-quality.md says how the shipped drafters were trained and measured)")
    lossless = all(r.token_ids == base.token_ids for r in timed["all"]["spec"] + timed["all"]["base"])
    click.echo(f"lossless (speculative ids == target-only greedy ids): {lossless}")
    if sampled is not None:
        ss = sampled.stats
        click.echo(f"--- sampled (temperature {temperature}, top_p {top_p}, top_k {top_k}, seed {seed}; "
                   f"{len(sampled.token_ids)} tokens) ---\n{sampled.text}\n---")
        click.echo(f"MAL sampled {ss.mean_accepted_length:.3f} vs greedy {s.mean_accepted_length:.3f} "
                   f"({engine.verification} verification); {ss.tokens_per_s:.1f} tokens/s")
    if json_out:
        json_out.write_text(json.dumps({"prompt_tokens": len(ids), "speculative": s.to_dict(),
                                        "target_only": b.to_dict(), "speedup": speedup, "lossless": lossless,
                                        "repeats": reps, "tokens_per_s_runs": {
                                            k: [r.stats.tokens_per_s for r in v] for k, v in timed["all"].items()},
                                        "target_only_one_token_steps": None if plain is None else plain.stats.to_dict(),
                                        "sampled": None if sampled is None else {
                                            "temperature": temperature, "top_p": top_p, "top_k": top_k,
                                            "seed": seed, **sampled.stats.to_dict()}}, indent=1))
    if not lossless:
        sys.exit(3)


def _spread(results: list) -> str:
    v = sorted(r.stats.tokens_per_s for r in results)
    return f"{v[0]:.1f}-{v[-1]:.1f}"


if __name__ == "__main__":
    main()
