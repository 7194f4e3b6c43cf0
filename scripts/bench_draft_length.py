"""Draft-length policies side by side: fixed k against the drafter's confidence (runtime/draft_length.py).

For every prompt, each configuration generates the same greedy continuation through one engines folder; the order
of the configurations rotates from prompt to prompt and from repeat to repeat, so the machine's drift does not
favour the ones that run first. Speed is decode tokens/s (prefill excluded) over target-only decoding of the same
graph timed in the same rotation; the geo-mean ratio per prompt kind is the figure. Every speculative output is
checked against target-only greedy (lossless).

Configurations (``--configs``): ``target-only``; ``fixed`` (the folder's ``verify_draft_tokens``); ``fixed:K``;
``conf:T`` (``--draft-confidence T``: up to the drafter's K verified, cut where the product of its top-1
probabilities falls below T); ``conf:cost`` (the length with the most expected tokens per second under the round
cost fitted as it runs, runtime/draft_length.py ``DraftCost``). ``--prompt-lookup`` applies to every speculative configuration (the served
default 3:5:7; ``off`` for the drafter alone).

Prompts: the held-out documents (training/corpus.py ``heldout_prompts``, as scripts/eval_mal.py: the ``--context``
tokens ending at token 3,500), ``--chat`` held-out chat prompts, and the demo's own request (runtime/generate.py),
chat template applied.

  python scripts/bench_draft_length.py --engine engines/ --context 1024 --chat 4 --repeats 2 \\
      --configs target-only,fixed,fixed:3,conf:0.3,conf:0.4,conf:0.5 --json-out runs/bench/draft_length.json
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import click

from runtime.benchmarking import geomean_ratio, rotated
from runtime.draft_length import DraftConfidence
from runtime.ort_threads import click_option as thread_pool_option
from runtime.prompt_lookup import DEFAULT_SPEC, PromptLookup
from runtime.prompt_lookup import click_option as prompt_lookup_option
from training import corpus


def parse_config(name: str) -> dict:
    """``target-only`` | ``fixed`` | ``fixed:K`` | ``conf:T`` -> engine settings.

    Raises:
        ValueError: an unknown name or a bad K / T.
    """
    if name == "target-only":
        return {"speculative": False, "k": None, "confidence": None}
    if name == "fixed":
        return {"speculative": True, "k": None, "confidence": None}
    kind, _, value = name.partition(":")
    if kind == "fixed" and value.isdigit() and int(value) > 0:
        return {"speculative": True, "k": int(value), "confidence": None}
    if kind == "conf":
        return {"speculative": True, "k": None, "confidence": DraftConfidence.parse(value)}
    raise ValueError(f"unknown configuration {name!r}: use target-only, fixed, fixed:K or conf:T")


def prompt_kind(name: str) -> str:
    """"demo" for the demo's request, else the held-out prompt's kind (prose, code or chat; training/corpus.py)."""
    return "demo" if name == "demo" else corpus.prompt_kind(name)


def build_prompts(tok, context: int, chat: int) -> dict[str, list[int]]:
    """The eval_mal.py prompts (held-out documents at ``context`` tokens, ``chat`` chat prompts) and the demo's."""
    from runtime.generate import DEFAULT_PROMPT

    prompts = corpus.heldout_prompts(tok, context, chat)
    prompts["demo"] = tok.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}],
                                              add_generation_prompt=True, tokenize=True, return_dict=False)
    return prompts


def summarise(rows: list[dict], configs: list[str]) -> dict:
    """Per kind and configuration: geo-mean speedup over target-only, mean MAL, prompts."""
    out = {}
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        sel = [r for r in rows if kind in ("all", r["kind"])]
        out[kind] = {c: {"speedup": round(geomean_ratio((r["tok_s"][c], r["tok_s"]["target-only"]) for r in sel), 4),
                         "mal": round(statistics.mean(r["mal"][c] for r in sel), 4)}
                     for c in configs if c != "target-only"}
        out[kind]["prompts"] = len(sel)
    return out


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path))
@click.option("--context", default=1024, show_default=True)
@click.option("--chat", default=4, show_default=True, help="held-out chat prompts")
@click.option("--new-tokens", default=128, show_default=True)
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(min=1),
              help="timings are the median over repeats (each in a rotated order)")
@click.option("--configs", default="target-only,fixed,conf:0.3,conf:0.4,conf:0.5", show_default=True)
@prompt_lookup_option("prompt lookup for every speculative configuration", default=DEFAULT_SPEC)
@thread_pool_option()
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(engine_dir: Path, context: int, chat: int, new_tokens: int, repeats: int, configs: str,
         prompt_lookup: PromptLookup | None, thread_pool: str, json_out: Path | None):
    from runtime.engine import SpecEngine
    from runtime.ort_threads import apply
    from runtime.sampling import SamplingParams

    apply(thread_pool)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    try:
        settings = {c: parse_config(c) for c in names}
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--configs") from None
    if "target-only" not in names:
        names.insert(0, "target-only")
        settings["target-only"] = parse_config("target-only")
    engine = SpecEngine.from_dir(engine_dir, prompt_lookup=prompt_lookup)
    by_confidence = {}  # one engine per confidence setting, over the same backends
    prompts = build_prompts(engine.tokenizer, context, chat)
    engine.generate(next(iter(prompts.values()))[:8], 4)  # warm-up
    rows = []
    for p, (name, ids) in enumerate(prompts.items()):
        times: dict[str, list[float]] = {c: [] for c in names}
        row = {"prompt": name, "kind": prompt_kind(name), "prompt_tokens": len(ids), "mal": {}, "rounds": {}}
        ref = None
        for rep in range(repeats):
            for c in rotated(names, p + rep * max(1, len(names) // repeats)):
                s = settings[c]
                if s["confidence"] not in by_confidence:
                    by_confidence[s["confidence"]] = engine.with_options(draft_confidence=s["confidence"])
                params = SamplingParams(max_new_tokens=new_tokens, num_draft_tokens=s["k"],
                                        speculative=s["speculative"])
                out = by_confidence[s["confidence"]].generate(ids, params=params)
                if ref is None and c == "target-only":
                    ref = out.token_ids
                if ref is not None and out.token_ids != ref:
                    raise SystemExit(f"{name} {c}: output differs from target-only greedy (lossless broken)")
                st = out.stats  # decode tokens/s: the prefill's first token and time left out
                times[c].append((st.new_tokens - 1) / st.decode_s if st.decode_s > 0 else 0.0)
                row["mal"][c] = round(out.stats.mean_accepted_length, 4) if s["speculative"] else 1.0
                row["rounds"][c] = out.stats.rounds
        row["tok_s"] = {c: round(statistics.median(v), 2) for c, v in times.items()}
        row["new_tokens"] = len(ref)
        rows.append(row)
        click.echo(f"{name:16s} " + "  ".join(f"{c} {row['tok_s'][c]:.0f} t/s MAL {row['mal'][c]:.2f}"
                                              for c in names))
    summary = summarise(rows, names)
    for kind, cells in summary.items():
        click.echo(f"{kind:6s} ({cells['prompts']} prompts): " + "  ".join(
            f"{c} {v['speedup']:.3f}x MAL {v['mal']:.2f}" for c, v in cells.items() if c != "prompts"))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({
            "engine": str(engine_dir), "context": context, "new_tokens": new_tokens, "repeats": repeats,
            "prompt_lookup": dataclasses.asdict(prompt_lookup) if prompt_lookup else None, "configs": names,
            "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
