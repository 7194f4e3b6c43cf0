"""Speed benchmark: sharpdraft speculative decoding against what users would run otherwise, side by side in one run.

Configurations, run one after another on every prompt (their order rotates from prompt to prompt, so drift of a
noisy machine hits them alike):

- ``sharpdraft``: speculative decoding through an engines/ folder (ONNX Runtime target + drafter, greedy, the
  folder's defaults: draft vocabulary, ``verify_draft_tokens``);
- ``sharpdraft-k{K}`` (``--draft-tokens``): the same, verifying K draft tokens per round;
  ``sharpdraft-full-vocab`` (``--vocab-ab``): the drafter's LM head over the whole vocabulary;
- ``ort-target-only``: the same target graph without a drafter (the lossless reference: every sharpdraft
  configuration must emit the same tokens, checked on every prompt);
- ``hf-generate``: transformers ``generate`` on the same target (fp32, its default SDPA attention, greedy);
- ``hf-prompt-lookup``: transformers ``generate(prompt_lookup_num_tokens=10)``, its training-free speculation.

Prompts: for each kind (``prose`` = hamlet, macbeth, othello; ``code`` = argparse.py, subprocess.py, typing.py; the
first ``--docs-per-kind`` of them; all held out from training, training/corpus.py) and each context C, the C tokens
ending at token ``--end-token`` of the document, then ``--new-tokens`` tokens (EOS ignored, so every configuration
emits the same count). Reported per prompt: tokens/s with and without prefill, prefill seconds, MAL, draft / verify
ms per step, and for the ONNX Runtime configurations the time per decode step inside ONNX Runtime calls and outside
them (the runtime's own overhead: batching, cache writes, sampling, bookkeeping). Ratios are taken per prompt and
geo-meaned over a kind's documents.

The query-scale overhead is measured on the same drafter: its graph as exported (with the in-graph beta) against
the same graph with the beta nodes removed (``export.rewrite.remove_query_scale``), drafting one block from the
same cache at each context, alternating the two, ``--qs-reps`` times each (median ratio).

  python scripts/bench_speed.py --engine engines --contexts 512,1024,2048,6144 --new-tokens 64 --out runs/bench/speed

Writes ``bench_speed.json``, ``speed_vs_context.png`` (tokens/s and ratios) and ``overhead_vs_context.png``
(per-step time outside ONNX Runtime, and the query-scale ratio) under ``--out``.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np

from runtime.benchmarking import figure, geomean_ratio, rotated, save_figure
from runtime.benchmarking import run_timed as run_ort
from training.corpus import HELDOUT_DOCUMENTS as KINDS

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


def run_hf(model, ids: list[int], new_tokens: int, lookup: bool) -> dict:
    """transformers ``generate`` (greedy, EOS ignored); prefill = time to the first generated token (a streamer
    timestamps what generate emits)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then each step's new token(s)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    cfg = copy.deepcopy(model.generation_config)
    cfg.update(do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None,
               max_new_tokens=new_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS if lookup else None)
    clock = Clock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([ids]), generation_config=cfg, streamer=clock)
        total = time.perf_counter() - t0
    toks = out[0, len(ids):].tolist()
    prefill_s = clock.times[1] - t0
    decode_s = max(total - prefill_s, 1e-9)
    return {"token_ids": toks, "new_tokens": len(toks), "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4), "tokens_per_s": round(len(toks) / total, 3),
            "decode_tokens_per_s": round((len(toks) - 1) / decode_s, 3)}


def _draft_contexts(drafter, feats: np.ndarray, ids: list[int], full: bool) -> list:
    """One row's drafter context: the whole prompt (``full``) or its last position only."""
    kind = getattr(drafter, "context", "target_features")
    f = feats if full else feats[-1:]
    if kind == "tokens":
        return [np.asarray(ids, np.int64)]
    if kind == "features_and_tokens":
        return [(f, np.asarray(ids, np.int64))]
    return [f]


def query_scale_overhead(engine, ids: list[int], reps: int, threads: int | None = None) -> dict:
    """Draft-call time of the exported drafter graph (beta in-graph) vs the same graph without the beta nodes.

    The drafter cache holds the prompt (its context features are zeros: timing does not depend on values, and
    no target prefill is needed); each timed call re-drafts after its last position (cache truncated back to
    ``len(ids) - 1``), so both graphs see N = len(ids) + block keys. Calls alternate between the graphs.
    """
    import onnx_ir as ir
    import onnxruntime as ort

    from export.rewrite import remove_query_scale
    from runtime.backends.ort import providers, session_options

    drafter, m = engine.drafter, engine.manifest.to_dict()
    graph = ir.load(engine.engine_dir / m["graphs"]["drafter"]["file"])
    ir.external_data.load_to_model(graph)  # weights in memory: the session is built from bytes
    removed = remove_query_scale(graph)
    frozen = ort.InferenceSession(ir.to_proto(graph).SerializeToString(), session_options(threads),
                                  providers=providers("cpu"))
    taps = m["drafter"].get("target_layer_ids") or m["drafter"].get("aux_layer_ids") or []
    feats = np.zeros((len(ids), len(taps) * m["target"]["hidden_size"]), np.float32)
    bonus = ids[-1]
    cache = drafter.new_cache()
    drafter.draft([cache], [bonus], _draft_contexts(drafter, feats, ids, full=True))
    scaled_session = drafter.session
    times = {"scaled": [], "frozen": []}
    try:
        for i in range(2 * reps + 2):
            which = "scaled" if i % 4 in (0, 3) else "frozen"  # ABBA: neither graph always runs first
            drafter.session = scaled_session if which == "scaled" else frozen
            cache.truncate(len(ids) - 1)
            t0 = time.perf_counter()
            drafter.draft([cache], [bonus], _draft_contexts(drafter, feats, ids, full=False))
            if i >= 2:  # first pair: warm-up
                times[which].append(time.perf_counter() - t0)
    finally:
        drafter.session = scaled_session
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"beta_muls_removed": removed, "scaled_ms": round(1000 * med["scaled"], 3),
            "frozen_ms": round(1000 * med["frozen"], 3), "ratio": round(med["scaled"] / med["frozen"], 4),
            "ratio_min": round(min(times["scaled"]) / min(times["frozen"]), 4)}


def summarise(result: dict) -> dict:
    """Per ``kind@context``: mean tokens/s per configuration, and per sharpdraft configuration its MAL, per-step
    breakdown and tokens/s ratios against each baseline (ratio per prompt, geo-mean over the kind's documents),
    the per-step overhead outside ONNX Runtime (median over prompts) and the query-scale ratio."""
    groups: dict[str, list[dict]] = {}
    for key, entry in result["prompts"].items():
        groups.setdefault(key.split("/")[0], []).append(entry)
    spec = [c for c in result["configs"] if c.startswith("sharpdraft")]
    bases = [c for c in result["configs"] if not c.startswith("sharpdraft")]
    out = {}
    for group, entries in groups.items():
        runs = [e["runs"] for e in entries]
        g = {"prompts": len(entries), "lossless": all(e["lossless"] for e in entries)}
        for c in result["configs"]:
            g[c] = {"decode_tokens_per_s": round(statistics.mean(r[c]["decode_tokens_per_s"] for r in runs), 3),
                    "tokens_per_s": round(statistics.mean(r[c]["tokens_per_s"] for r in runs), 3),
                    "prefill_s": round(statistics.mean(r[c]["prefill_s"] for r in runs), 4)}
            if "overhead_ms_per_step" in runs[0][c]:
                g[c]["overhead_ms_per_step"] = round(statistics.median(r[c]["overhead_ms_per_step"] for r in runs), 3)
                g[c]["step_ms"] = round(statistics.median(r[c]["step_ms_median"] for r in runs), 3)
            if c in spec:
                g[c]["mal"] = round(statistics.mean(r[c]["mal"] for r in runs), 4)
                g[c]["draft_ms_per_step"] = round(statistics.mean(r[c]["draft_ms_per_step"] for r in runs), 3)
                g[c]["verify_ms_per_step"] = round(statistics.mean(r[c]["verify_ms_per_step"] for r in runs), 3)
                for base in bases:
                    g[c][f"speedup_vs_{base}"] = round(geomean_ratio(
                        (r[c]["decode_tokens_per_s"], r[base]["decode_tokens_per_s"]) for r in runs), 3)
                    g[c][f"e2e_speedup_vs_{base}"] = round(geomean_ratio(
                        (r[c]["tokens_per_s"], r[base]["tokens_per_s"]) for r in runs), 3)
        g["query_scale_ratio"] = round(statistics.median(e["query_scale"]["ratio"] for e in entries), 4)
        g["query_scale_ratio_min"] = round(statistics.median(e["query_scale"]["ratio_min"] for e in entries), 4)
        out[group] = g
    return out


def _save(fig, axes, path: Path) -> Path:
    for ax in axes:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def _plots(result: dict, out: Path) -> list[Path]:
    summ, ctxs = result["summary"], result["contexts"]
    bases = [c for c in result["configs"] if not c.startswith("sharpdraft")]
    fig, axes = figure(2, (12, 4.2))
    for kind, ls in zip(result["kinds"], ("-", "--")):
        for j, c in enumerate(result["configs"]):
            axes[0].plot(ctxs, [summ[f"{kind}@{x}"][c]["decode_tokens_per_s"] for x in ctxs], ls, marker="o",
                         color=f"C{j}", label=f"{c} ({kind})")
        for j, base in enumerate(bases):
            axes[1].plot(ctxs, [summ[f"{kind}@{x}"]["sharpdraft"][f"speedup_vs_{base}"] for x in ctxs], ls,
                         marker="o", color=f"C{result['configs'].index(base)}", label=f"vs {base} ({kind})")
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="decode tokens/s (prefill excluded)",
                title="tokens/s, one run, same prompts", ylim=(0, None))
    axes[1].axhline(1.0, color="grey", ls=":")
    axes[1].set(xscale="log", xlabel="context tokens", ylabel="sharpdraft decode tokens/s ratio",
                title="sharpdraft speedup (geo-mean over documents)")
    p1 = _save(fig, axes, out / "speed_vs_context.png")
    fig, axes = figure(2, (12, 4.2))
    for kind, ls in zip(result["kinds"], ("-", "--")):
        for c in ("sharpdraft", "ort-target-only"):
            axes[0].plot(ctxs, [summ[f"{kind}@{x}"][c]["overhead_ms_per_step"] for x in ctxs], ls, marker="o",
                         color=f"C{result['configs'].index(c)}", label=f"{c} ({kind})")
        axes[1].plot(ctxs, [summ[f"{kind}@{x}"]["query_scale_ratio"] for x in ctxs], ls, marker="o", color="C0",
                     label=kind)
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="ms per decode step outside ONNX Runtime",
                title="runtime overhead per step (median)", ylim=(0, None))
    axes[1].axhline(1.02, color="red", ls=":", label="goal 1.02")
    axes[1].set(xscale="log", xlabel="context tokens", ylabel="drafter call time, beta / no beta",
                title="query-scale overhead (median)")
    p2 = _save(fig, axes, out / "overhead_vs_context.png")
    return [p1, p2]


def _table(result: dict) -> str:
    bases = [c for c in result["configs"] if not c.startswith("sharpdraft")]
    spec = [c for c in result["configs"] if c.startswith("sharpdraft")]
    head = (f"{'group':<12} {'config':<22} {'MAL':>5} {'tok/s':>6} {'draft':>6} {'verify':>6} "
            + " ".join(f"{'x ' + b:>17}" for b in bases) + f" {'ovh ms':>6}")
    lines = [head]
    for group, g in result["summary"].items():
        for c in spec:
            e = g[c]
            lines.append(f"{group:<12} {c:<22} {e['mal']:>5.2f} {e['decode_tokens_per_s']:>6.2f} "
                         f"{e['draft_ms_per_step']:>6.1f} {e['verify_ms_per_step']:>6.1f} "
                         + " ".join(f"{e['speedup_vs_' + b]:>17.3f}" for b in bases)
                         + f" {e['overhead_ms_per_step']:>6.2f}")
        lines.append(f"{group:<12} {'baselines tok/s':<22} " + ", ".join(
            f"{b} {g[b]['decode_tokens_per_s']:.2f}" for b in bases)
            + f"; target-only step {g['ort-target-only']['step_ms']:.1f} ms, overhead "
            f"{g['ort-target-only']['overhead_ms_per_step']:.2f} ms; query-scale ratio {g['query_scale_ratio']:.3f}")
    return "\n".join(lines)


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=ROOT / "engines", show_default=True, help="engines/ folder (sharpdraft-export)")
@click.option("--contexts", default="512,1024,2048,6144", show_default=True, help="context lengths, comma separated")
@click.option("--kinds", default="prose,code", show_default=True, help=f"prompt kinds among {sorted(KINDS)}")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(2, 4096))
@click.option("--end-token", default=7700, show_default=True, type=int, help="prompts end at this token")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads and torch threads "
              "(default: $SHARPDRAFT_THREADS, else the CPU count, for ONNX Runtime; torch's own default)")
@click.option("--qs-reps", default=60, show_default=True, type=click.IntRange(2, 10_000),
              help="draft calls per graph for the query-scale overhead")
@click.option("--docs-per-kind", default=1, show_default=True, type=click.IntRange(1, 3),
              help="held-out documents per kind (prose: hamlet, macbeth, othello; code: argparse, subprocess, typing)")
@click.option("--draft-tokens", default="", help="extra sharpdraft configurations verifying only the first k draft "
              "tokens per block, e.g. 2,3,4 (configuration sharpdraft-k2, ...)")
@click.option("--vocab-ab", is_flag=True, help="add sharpdraft-full-vocab: the drafter's LM head over the whole "
              "vocabulary (when the engines folder has a draft vocabulary)")
@click.option("--no-hf", is_flag=True, help="skip the transformers configurations (sweeps of sharpdraft settings)")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench/speed"),
              show_default=True)
def main(engine_dir: Path, contexts: str, kinds: str, new_tokens: int, end_token: int, threads: int | None,
         qs_reps: int, docs_per_kind: int, draft_tokens: str, vocab_ab: bool, no_hf: bool, out: Path) -> None:
    """Tokens/s of sharpdraft vs ONNX Runtime target-only vs transformers generate (plain / prompt lookup)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from runtime.engine import SpecEngine
    from training.corpus import document_prompts as _prompts

    ctxs = sorted({int(c) for c in contexts.split(",")})
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = [k for k in kind_list if k not in KINDS]
    if unknown:
        raise click.BadParameter(f"unknown kinds {unknown}; choose from {sorted(KINDS)}", param_hint="--kinds")
    if threads:
        torch.set_num_threads(threads)
    engine = SpecEngine.from_dir(engine_dir, threads=threads)
    if engine.drafter is None:
        raise click.UsageError(f"{engine_dir} has no drafter graph")
    target_src = engine.manifest.target.source
    from runtime.models.target import resolve_target

    hf = None if no_hf else AutoModelForCausalLM.from_pretrained(resolve_target(target_src),
                                                                 dtype=torch.float32).eval()
    prompts = {}
    for kind in kind_list:
        for name, ids in _prompts(engine.tokenizer, ctxs, end_token, list(KINDS[kind][:docs_per_kind])).items():
            doc, ctx = name.rsplit("@", 1)
            prompts[f"{kind}@{ctx}/{doc}"] = ids
    variants = {"sharpdraft": {}}
    for k in (int(x) for x in draft_tokens.split(",") if x.strip()):
        variants[f"sharpdraft-k{k}"] = {"num_draft_tokens": k}
    if vocab_ab and getattr(engine.drafter, "draft_ids", None) is not None:
        variants["sharpdraft-full-vocab"] = {"draft_vocab": False}
    configs = [*variants, "ort-target-only"] + ([] if no_hf else ["hf-generate", "hf-prompt-lookup"])
    # warm-up: sessions, allocators, torch kernels
    warm = next(iter(prompts.values()))[:64]
    run_ort(engine, warm, 4, True)
    run_ort(engine, warm, 4, False)
    if hf is not None:
        run_hf(hf, warm, 4, False)
    result = {"engine": str(engine_dir), "manifest_query_scale": engine.manifest.to_dict()["query_scale"],
              "family": engine.manifest.drafter.family.value, "threads": threads, "new_tokens": new_tokens,
              "contexts": ctxs, "kinds": kind_list, "configs": configs,
              "kv_io": engine.manifest.to_dict()["graphs"]["target"].get("kv_io", "concat"), "prompts": {}}
    out.mkdir(parents=True, exist_ok=True)
    for i, (key, ids) in enumerate(tqdm(prompts.items(), desc="prompts", file=sys.stderr)):
        order = rotated(configs, i)
        runs = {}
        for c in order:
            if c.startswith("hf-"):
                runs[c] = run_hf(hf, ids, new_tokens, lookup=c == "hf-prompt-lookup")
            else:
                runs[c] = run_ort(engine, ids, new_tokens, speculative=c in variants, **variants.get(c, {}))
        base = runs["ort-target-only"]["token_ids"]
        entry = {"prompt_tokens": len(ids), "order": list(order), "runs": runs,
                 "lossless": all(runs[v]["token_ids"] == base for v in variants),
                 "query_scale": query_scale_overhead(engine, ids, qs_reps, threads)}
        if hf is not None:
            entry["hf_agrees_with_ort"] = runs["hf-generate"]["token_ids"] == base
        result["prompts"][key] = entry
        (out / "bench_speed.json").write_text(json.dumps(result, indent=1))  # partial results survive a stop
        if not entry["lossless"]:
            raise SystemExit(f"{key}: speculative output differs from target-only greedy (lossless check failed)")
    result["summary"] = summarise(result)
    (out / "bench_speed.json").write_text(json.dumps(result, indent=1))
    pngs = _plots(result, out)
    print(_table(result))
    print("wrote", out / "bench_speed.json", *pngs)


if __name__ == "__main__":
    main()
