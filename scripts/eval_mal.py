"""Measure greedy MAL and speed of an engines/ folder on held-out documents (never used in training).

For each held-out document (hamlet, othello, macbeth, argparse.py, typing.py, subprocess.py; training/corpus.py)
the prompt is the ``--context`` tokens ending at token 3500 of the document, so every context length continues
from the same point; plus ``--chat`` held-out HumanEval chat prompts. Each prompt generates ``--new-tokens`` greedy
tokens speculatively and target-only (same run, same engines), checks they are identical, and reports MAL,
acceptance per draft position, and tokens/s of both.

  python scripts/eval_mal.py --engine engines/ --context 256 --json-out runs/eval_256.json

With ``--temperature > 0`` every prompt is generated sampled (seeded per prompt) with the chosen ``--verification``
scheme, and target-only decoding runs sampled too (same parameters) for the speed ratio; outputs then differ by
design (the distribution, not the tokens, is preserved: tests/runtime/test_sampling.py).

  python scripts/eval_mal.py --engine engines/ --temperature 0.8 --verification exact_match
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import click

from runtime.benchmarking import geomean_ratio
from runtime.draft_length import DraftConfidence, DraftCost
from runtime.draft_length import click_option as draft_confidence_option
from runtime.engine import SpecEngine
from runtime.prompt_lookup import PromptLookup
from runtime.prompt_lookup import click_option as prompt_lookup_option
from runtime.sampling import VERIFICATION_SCHEMES, SamplingParams
from training.corpus import END_TOKEN, heldout_prompts, mean_by_kind


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path))
@click.option("--context", default=256, help="prompt length in tokens for the document prompts")
@click.option("--new-tokens", default=128)
@click.option("--chat", default=4, help="number of held-out HumanEval chat prompts")
@click.option("--temperature", default=0.0, type=click.FloatRange(min=0), help="0: greedy (lossless check)")
@click.option("--top-p", default=1.0, type=click.FloatRange(0, 1, min_open=True))
@click.option("--verification", default=None, type=click.Choice(VERIFICATION_SCHEMES),
              help="sampled verification scheme (default: the drafter's)")
@click.option("--seed", default=0, help="base seed; prompt i uses seed + i")
@click.option("--end-token", default=END_TOKEN, help="document prompts end at this token of each document")
@click.option("--compare-query-scale", is_flag=True,
              help="also run every prompt with the query scale switched off (frozen drafter), same engines")
@click.option("--draft-tokens", type=click.IntRange(min=0), default=None,
              help="draft tokens verified per round (default: the engines folder's verify default); the drafter's "
                   "maximum measures its quality over the whole block")
@prompt_lookup_option(
    "also draft by prompt lookup (runtime/prompt_lookup.py), e.g. 3:5:7; off by default")
@draft_confidence_option()
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(engine_dir: Path, context: int, new_tokens: int, chat: int, temperature: float, top_p: float,
         verification: str | None, seed: int, end_token: int, compare_query_scale: bool, draft_tokens: int | None,
         prompt_lookup: PromptLookup | None, draft_confidence: DraftConfidence | None, json_out: Path | None):
    engine = SpecEngine.from_dir(engine_dir, prompt_lookup=prompt_lookup, draft_confidence=draft_confidence,
                                 verification=verification or None)
    prompts = heldout_prompts(engine.tokenizer, context, chat, end_token)
    engine.generate(prompts[next(iter(prompts))][:8], 4)  # warm-up
    rows = []
    for i, (name, ids) in enumerate(prompts.items()):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, top_p=top_p, seed=seed + i,
                                num_draft_tokens=draft_tokens)
        spec = engine.generate(ids, params=params)
        base = engine.generate_target_only(ids, params=params)
        if params.greedy and spec.token_ids != base.token_ids:
            raise SystemExit(f"{name}: speculative output differs from target-only greedy (lossless broken)")
        s = spec.stats
        row = {"prompt": name, "prompt_tokens": len(ids), "new_tokens": len(spec.token_ids),
               "mal": round(s.mean_accepted_length, 4), "acceptance": s.acceptance_per_position,
               "spec_tok_s": round(s.tokens_per_s, 2), "target_tok_s": round(base.stats.tokens_per_s, 2),
               "rounds": s.rounds, "lookup_rounds": s.lookup_rounds, "lookup_accepted": s.lookup_accepted}
        extra = ""
        if compare_query_scale:
            frozen = engine.generate(ids, params=dataclasses.replace(params, query_scale=False))
            if params.greedy and frozen.token_ids != base.token_ids:
                raise SystemExit(f"{name}: frozen speculative output differs from target-only greedy")
            row["mal_frozen"] = round(frozen.stats.mean_accepted_length, 4)
            row["frozen_tok_s"] = round(frozen.stats.tokens_per_s, 2)
            extra = f" (frozen {row['mal_frozen']:.3f})"
        rows.append(row)
        click.echo(f"{name:28s} ctx {len(ids):5d}  MAL {s.mean_accepted_length:.3f}{extra}  "
                   f"{s.tokens_per_s:6.1f} vs {base.stats.tokens_per_s:6.1f} tokens/s")
    doc_rows = [r for r in rows if not r["prompt"].startswith("chat")]
    summary = {"engine": str(engine_dir), "context": context, "new_tokens": new_tokens,
               "temperature": temperature, "top_p": top_p, "verification": engine.verification,
               "draft_tokens": draft_tokens if draft_tokens is not None else engine.default_draft_tokens,
               "query_scale": engine.manifest.to_dict()["query_scale"],
               "prompt_lookup": dataclasses.asdict(engine.prompt_lookup) if engine.prompt_lookup else None,
               "draft_confidence": ("cost" if isinstance(draft_confidence, DraftCost) else
                                    draft_confidence.threshold if draft_confidence else None),
               "mal_documents": round(statistics.mean(r["mal"] for r in doc_rows), 4),
               "mal_by_kind": mean_by_kind(rows, "mal"),
               "mal_all": round(statistics.mean(r["mal"] for r in rows), 4),
               "speedup_geomean": round(geomean_ratio((r["spec_tok_s"], r["target_tok_s"]) for r in rows), 4),
               "rows": rows}
    if compare_query_scale:
        summary["mal_by_kind_frozen"] = mean_by_kind(rows, "mal_frozen")
        summary["mal_documents_frozen"] = round(statistics.mean(r["mal_frozen"] for r in doc_rows), 4)
        summary["mal_all_frozen"] = round(statistics.mean(r["mal_frozen"] for r in rows), 4)
    click.echo("mean MAL by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["mal_by_kind"].items()))
    click.echo(f"mean MAL: documents {summary['mal_documents']:.3f}, all {summary['mal_all']:.3f}; "
               f"speedup (geo-mean) {summary['speedup_geomean']:.3f}x")
    if compare_query_scale:
        click.echo(f"frozen drafter MAL: documents {summary['mal_documents_frozen']:.3f}, "
                   f"all {summary['mal_all_frozen']:.3f}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
