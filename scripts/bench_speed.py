"""Speed benchmark: sharpdraft speculative decoding against what users would run otherwise, side by side in one run.

Configurations, run one after another on every prompt (their order rotates from prompt to prompt, so drift of a
noisy machine hits them alike):

- ``sharpdraft``: speculative decoding through an engines/ folder (ONNX Runtime target + drafter, greedy);
- ``ort-target-only``: the same target graph without a drafter (the lossless reference: ``sharpdraft`` must emit
  the same tokens, checked on every prompt);
- ``hf-generate``: transformers ``generate`` on the same target (fp32, its default SDPA attention, greedy);
- ``hf-prompt-lookup``: transformers ``generate(prompt_lookup_num_tokens=10)``, its training-free speculation.

Prompts: for each kind (``prose`` = hamlet, ``code`` = argparse.py; held out from training, scripts/corpus.py) and
each context C, the C tokens ending at token ``--end-token`` of the document, then ``--new-tokens`` tokens
(EOS ignored, so every configuration emits the same count). Reported per prompt: tokens/s with and without
prefill, prefill seconds, MAL, draft / verify seconds, and for the ONNX Runtime configurations the time per decode
step spent inside ONNX Runtime calls and outside them (the runtime's own overhead: batching, cache writes,
sampling, bookkeeping). Ratios are taken per prompt, then geo-meaned.

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ("sharpdraft", "ort-target-only", "hf-generate", "hf-prompt-lookup")
KINDS = {"prose": "hamlet_gut", "code": "argparse.py"}
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


def run_ort(engine, ids: list[int], new_tokens: int, speculative: bool) -> dict:
    """One request through ``engine`` step by step; per step the wall time and the time inside ONNX Runtime."""
    from runtime.sampling import SamplingParams

    graphs = [engine.target] + ([engine.drafter] if engine.drafter is not None else [])
    seq = engine.add_request(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, speculative=speculative))
    steps = []
    while engine.has_unfinished:
        ort0, t0 = sum(g.ort_s for g in graphs), time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, sum(g.ort_s for g in graphs) - ort0))
    (prefill_s, _), decode = steps[0], steps[1:]
    s = seq.stats
    n = len(seq.out)
    decode_s = sum(w for w, _ in decode)
    row = {"token_ids": list(seq.out), "new_tokens": n, "prefill_s": round(prefill_s, 4),
           "decode_s": round(decode_s, 4), "tokens_per_s": round(n / (prefill_s + decode_s), 3),
           "decode_tokens_per_s": round((n - 1) / decode_s, 3) if decode_s else None,
           "steps": len(decode),
           "step_ms_median": round(1000 * statistics.median(w for w, _ in decode), 3),
           "ort_ms_per_step": round(1000 * statistics.median(o for _, o in decode), 3),
           "overhead_ms_per_step": round(1000 * statistics.median(w - o for w, o in decode), 3)}
    if speculative:
        row |= {"mal": round(s.mean_accepted_length, 4), "rounds": s.rounds,
                "acceptance": [round(a, 4) for a in s.acceptance_per_position],
                "draft_ms_per_step": round(1000 * s.draft_s / len(decode), 3),
                "verify_ms_per_step": round(1000 * s.verify_s / len(decode), 3)}
    return row


def run_hf(model, ids: list[int], new_tokens: int, lookup: bool) -> dict:
    """transformers ``generate`` (greedy, EOS ignored); prefill timed as a 1-token generate of the same prompt."""
    import torch

    cfg = copy.deepcopy(model.generation_config)
    cfg.update(do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None,
               prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS if lookup else None)
    x = torch.tensor([ids])
    with torch.inference_mode():
        one = copy.deepcopy(cfg)
        one.update(max_new_tokens=1, prompt_lookup_num_tokens=None)
        t0 = time.perf_counter()
        model.generate(x, generation_config=one)
        prefill_s = time.perf_counter() - t0
        cfg.update(max_new_tokens=new_tokens)
        t0 = time.perf_counter()
        out = model.generate(x, generation_config=cfg)
        total = time.perf_counter() - t0
    toks = out[0, len(ids):].tolist()
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

    The drafter cache holds the prompt; each timed call re-drafts after its last position (cache truncated back
    to ``len(ids) - 1``), so both graphs see N = len(ids) + block keys. Calls alternate between the graphs.
    """
    import onnx_ir as ir
    import onnxruntime as ort

    from export.rewrite import remove_query_scale
    from runtime.ort_engines import providers, session_options
    from runtime.sampling import SamplingParams

    drafter = engine.drafter
    graph = ir.load(engine.engine_dir / engine.manifest["graphs"]["drafter"]["file"])
    ir.external_data.load_to_model(graph)  # weights in memory: the session is built from bytes
    removed = remove_query_scale(graph)
    frozen = ort.InferenceSession(ir.to_proto(graph).SerializeToString(), session_options(threads),
                                  providers=providers("cpu"))
    seq = engine.add_request(ids, SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.step()  # prefill: the target features of the prompt
    feats, bonus = seq.pending_ctx, seq.out[-1]
    cache = drafter.new_cache()
    drafter.draft([cache], [bonus], _draft_contexts(drafter, feats, ids, full=True))
    scaled_session = drafter.session
    times = {"scaled": [], "frozen": []}
    try:
        for i in range(2 * reps + 2):
            which = "scaled" if i % 2 == 0 else "frozen"
            drafter.session = scaled_session if which == "scaled" else frozen
            cache.truncate(len(ids) - 1)
            t0 = time.perf_counter()
            drafter.draft([cache], [bonus], _draft_contexts(drafter, feats, ids, full=False))
            if i >= 2:  # first pair: warm-up
                times[which].append(time.perf_counter() - t0)
    finally:
        drafter.session = scaled_session
        engine.abort(seq.request_id)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"beta_muls_removed": removed, "scaled_ms": round(1000 * med["scaled"], 3),
            "frozen_ms": round(1000 * med["frozen"], 3), "ratio": round(med["scaled"] / med["frozen"], 4)}


def _geo(xs: list[float]) -> float:
    return statistics.geometric_mean(xs)


def summarise(result: dict) -> dict:
    """Per kind and context: mean tokens/s per configuration, geo-mean ratios, overhead and MAL."""
    out = {}
    for key, rows in result["prompts"].items():
        r = rows["runs"]
        entry = {c: {"tokens_per_s": r[c]["tokens_per_s"], "decode_tokens_per_s": r[c]["decode_tokens_per_s"],
                     "prefill_s": r[c]["prefill_s"]} for c in r}
        sd = r["sharpdraft"]
        entry["mal"] = sd["mal"]
        entry["lossless"] = rows["lossless"]
        for base in ("ort-target-only", "hf-generate", "hf-prompt-lookup"):
            entry[f"speedup_vs_{base}"] = round(sd["decode_tokens_per_s"] / r[base]["decode_tokens_per_s"], 3)
            entry[f"e2e_speedup_vs_{base}"] = round(sd["tokens_per_s"] / r[base]["tokens_per_s"], 3)
        entry["overhead_ms_per_step"] = {c: r[c]["overhead_ms_per_step"] for c in ("sharpdraft", "ort-target-only")}
        entry["breakdown_ms_per_step"] = {"draft": sd["draft_ms_per_step"], "verify": sd["verify_ms_per_step"],
                                          "target_only_step": r["ort-target-only"]["step_ms_median"]}
        if "query_scale" in rows:
            entry["query_scale_ratio"] = rows["query_scale"]["ratio"]
        out[key] = entry
    return out


def _plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = result["summary"]
    ctxs = result["contexts"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for kind, ls in zip(result["kinds"], ("-", "--")):
        for c, color in zip(CONFIGS, ("C0", "C1", "C2", "C3")):
            axes[0].plot(ctxs, [summ[f"{kind}@{x}"][c]["decode_tokens_per_s"] for x in ctxs], ls, marker="o",
                         color=color, label=f"{c} ({kind})")
        for base, color in zip(CONFIGS[1:], ("C1", "C2", "C3")):
            axes[1].plot(ctxs, [summ[f"{kind}@{x}"][f"speedup_vs_{base}"] for x in ctxs], ls, marker="o",
                         color=color, label=f"vs {base} ({kind})")
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="decode tokens/s (prefill excluded)",
                title="tokens/s, one run, same prompts")
    axes[1].axhline(1.0, color="grey", ls=":")
    axes[1].set(xscale="log", xlabel="context tokens", ylabel="sharpdraft decode tokens/s ratio",
                title="sharpdraft speedup")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "speed_vs_context.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for kind, ls in zip(result["kinds"], ("-", "--")):
        for c, color in (("sharpdraft", "C0"), ("ort-target-only", "C1")):
            axes[0].plot(ctxs, [summ[f"{kind}@{x}"]["overhead_ms_per_step"][c] for x in ctxs], ls, marker="o",
                         color=color, label=f"{c} ({kind})")
        qs = [summ[f"{kind}@{x}"].get("query_scale_ratio") for x in ctxs]
        if all(q is not None for q in qs):
            axes[1].plot(ctxs, qs, ls, marker="o", color="C0", label=kind)
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="ms per decode step outside ONNX Runtime",
                title="runtime overhead per step", ylim=(0, None))
    axes[1].axhline(1.02, color="red", ls=":", label="goal 1.02")
    axes[1].set(xscale="log", xlabel="context tokens", ylabel="drafter call time, beta / no beta",
                title="query-scale overhead")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "overhead_vs_context.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=ROOT / "engines", show_default=True, help="engines/ folder (sharpdraft-export)")
@click.option("--contexts", default="512,1024,2048,6144", show_default=True, help="context lengths, comma separated")
@click.option("--kinds", default="prose,code", show_default=True, help=f"prompt kinds among {sorted(KINDS)}")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(2, 4096))
@click.option("--end-token", default=7700, show_default=True, type=int, help="prompts end at this token")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads and torch threads "
              "(default: ONNX Runtime's session default and torch's)")
@click.option("--qs-reps", default=20, show_default=True, type=click.IntRange(2, 10_000),
              help="draft calls per graph for the query-scale overhead")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench/speed"),
              show_default=True)
def main(engine_dir: Path, contexts: str, kinds: str, new_tokens: int, end_token: int, threads: int | None,
         qs_reps: int, out: Path) -> None:
    """Tokens/s of sharpdraft vs ONNX Runtime target-only vs transformers generate (plain / prompt lookup)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from runtime.engine import SpecEngine
    from scripts.bench_long_context import _prompts

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
    target_src = engine.manifest["target"]["source"]
    from runtime.models.target import resolve_target

    hf = AutoModelForCausalLM.from_pretrained(resolve_target(target_src), dtype=torch.float32).eval()
    prompts = {}
    for kind in kind_list:
        for name, ids in _prompts(engine.tokenizer, ctxs, end_token, [KINDS[kind]]).items():
            prompts[f"{kind}@{name.rsplit('@', 1)[1]}"] = ids
    # warm-up: sessions, allocators, torch kernels
    warm = next(iter(prompts.values()))[:64]
    run_ort(engine, warm, 4, True)
    run_ort(engine, warm, 4, False)
    run_hf(hf, warm, 4, False)
    result = {"engine": str(engine_dir), "manifest_query_scale": engine.manifest["query_scale"],
              "family": engine.manifest["drafter"]["family"], "threads": threads, "new_tokens": new_tokens,
              "contexts": ctxs, "kinds": kind_list, "configs": list(CONFIGS),
              "kv_io": engine.manifest["graphs"]["target"].get("kv_io", "concat"), "prompts": {}}
    out.mkdir(parents=True, exist_ok=True)
    for i, (key, ids) in enumerate(tqdm(prompts.items(), desc="prompts", file=sys.stderr)):
        order = CONFIGS[i % len(CONFIGS):] + CONFIGS[: i % len(CONFIGS)]
        runs = {}
        for c in order:
            if c.startswith("hf-"):
                runs[c] = run_hf(hf, ids, new_tokens, lookup=c == "hf-prompt-lookup")
            else:
                runs[c] = run_ort(engine, ids, new_tokens, speculative=c == "sharpdraft")
        entry = {"prompt_tokens": len(ids), "order": list(order), "runs": runs,
                 "lossless": runs["sharpdraft"]["token_ids"] == runs["ort-target-only"]["token_ids"],
                 "hf_agrees_with_ort": runs["hf-generate"]["token_ids"] == runs["ort-target-only"]["token_ids"],
                 "query_scale": query_scale_overhead(engine, ids, qs_reps, threads)}
        result["prompts"][key] = entry
        (out / "bench_speed.json").write_text(json.dumps(result, indent=1))  # partial results survive a stop
        if not entry["lossless"]:
            raise SystemExit(f"{key}: speculative output differs from target-only greedy (lossless check failed)")
    result["summary"] = summarise(result)
    (out / "bench_speed.json").write_text(json.dumps(result, indent=1))
    pngs = _plots(result, out)
    print(f"{'prompt':<12} {'MAL':>5} {'sd tok/s':>8} {'ort tok/s':>9} {'hf tok/s':>8} {'pl tok/s':>8} "
          f"{'x ort':>6} {'x hf':>6} {'x pl':>6} {'ovh sd':>7} {'ovh ort':>7} {'qs':>6}")
    for key, e in result["summary"].items():
        print(f"{key:<12} {e['mal']:>5.2f} {e['sharpdraft']['decode_tokens_per_s']:>8.2f} "
              f"{e['ort-target-only']['decode_tokens_per_s']:>9.2f} {e['hf-generate']['decode_tokens_per_s']:>8.2f} "
              f"{e['hf-prompt-lookup']['decode_tokens_per_s']:>8.2f} {e['speedup_vs_ort-target-only']:>6.3f} "
              f"{e['speedup_vs_hf-generate']:>6.3f} {e['speedup_vs_hf-prompt-lookup']:>6.3f} "
              f"{e['overhead_ms_per_step']['sharpdraft']:>7.2f} {e['overhead_ms_per_step']['ort-target-only']:>7.2f} "
              f"{e.get('query_scale_ratio', float('nan')):>6.3f}")
    print("wrote", out / "bench_speed.json", *pngs)


if __name__ == "__main__":
    main()
