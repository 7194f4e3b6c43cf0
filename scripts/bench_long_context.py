"""Long-context benchmark: MAL, acceptance per draft position and tokens/s vs context, frozen vs query-scaled.

For each held-out document (scripts/corpus.py ``heldout``: hamlet, othello, macbeth, argparse.py, typing.py,
subprocess.py; never used in training or calibration) and each context length C, the prompt is the C tokens ending
at token ``--end-token`` of the document (every C continues from the same point), followed by ``--new-tokens``
greedy tokens. Configurations, each in its own child process (so peak memory is per configuration):

- ``target-only``: target greedy decoding through the first engines folder (the lossless reference);
- ``frozen``: speculative with the query scale switched off (first folder, ``query_scale=False``);
- one per ``--engine LABEL=DIR``: speculative with that folder's exported profile (e.g. ``paper`` = family preset,
  ``fitted`` = ``sharpdraft-calibrate --write-engine``, ``train-length`` = the checkpoint's own profile).

Every speculative output is checked token for token against target-only (greedy, fp32: lossless). Writes
``bench_long_context.json`` (per prompt and per configuration: MAL, acceptance per position, tokens/s with and
without prefill, peak RSS; ``--reuse`` keeps finished configurations of an interrupted run), ``mal_vs_context.png`` and ``acceptance_vs_position.png``, and prints a table in the
style of the paper's Table 1 (trainable parameters, peak memory, geo-mean speedup vs target-only).

  python scripts/bench_long_context.py --engine paper=runs/engines/dflash-paper \\
      --engine fitted=runs/engines/dflash-fitted --contexts 512,1024,2048,4096,7168 --out runs/bench/dflash
"""
from __future__ import annotations

import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

END_TOKEN = 7700


def _prompts(tok, contexts: list[int], end_token: int, names: list[str] | None) -> dict[str, list[int]]:
    from scripts.corpus import plays, stdlib_modules

    docs = {k: v for k, v in {**plays("heldout"), **stdlib_modules("heldout")}.items() if not k.endswith("_gut_f")}
    if names:
        unknown = sorted(set(names) - set(docs))
        if unknown:
            raise SystemExit(f"unknown held-out documents {unknown}; choose from {sorted(docs)}")
        docs = {k: docs[k] for k in names}
    prompts = {}
    for name, text in docs.items():
        ids = tok.encode(text)[:end_token]
        if len(ids) < max(contexts):
            raise SystemExit(f"{name} has {len(ids)} tokens before --end-token, fewer than context {max(contexts)}")
        for c in contexts:
            prompts[f"{name}@{c}"] = ids[-c:]
    return prompts


def _worker(engine_dir: Path, config: str, prompts: dict[str, list[int]], new_tokens: int, threads: int | None):
    from tqdm import tqdm

    from runtime.engine import SpecEngine
    from runtime.sampling import SamplingParams

    engine = SpecEngine.from_dir(engine_dir, threads=threads)
    first = next(iter(prompts.values()))
    engine.generate(first[:16], 4)  # warm-up
    rows = {}
    for name, ids in tqdm(prompts.items(), desc=config, file=sys.stderr):
        params = SamplingParams(max_new_tokens=new_tokens, query_scale=config != "frozen")
        res = engine.generate(ids, params=params, speculative=config != "target-only")
        s = res.stats
        rows[name] = {"prompt_ids": ids, "token_ids": res.token_ids, "new_tokens": len(res.token_ids),
                      "prefill_s": round(s.prefill_s, 4), "decode_s": round(s.decode_s, 4),
                      "draft_s": round(s.draft_s, 4), "verify_s": round(s.verify_s, 4),
                      "tokens_per_s": round(s.tokens_per_s, 3),
                      "decode_tokens_per_s": round(len(res.token_ids) / max(s.decode_s, 1e-9), 3)}
        if config != "target-only":
            rows[name] |= {"mal": round(s.mean_accepted_length, 4), "acceptance": s.acceptance_per_position,
                           "rounds": s.rounds}
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"config": config, "engine": str(engine_dir), "query_scale": engine.manifest["query_scale"],
            "max_new_tokens": new_tokens, "peak_rss_mb": round(peak_mb, 1), "rows": rows}


def _trainable_params(engine_dir: Path) -> int:
    """Parameters stored in the drafter checkpoint the folder was exported from (all trained; the borrowed
    embedding / LM head are the target's and not counted)."""
    from safetensors import safe_open

    manifest = json.loads((engine_dir / "manifest.json").read_text())
    total = 0
    for f in Path(manifest["drafter"]["checkpoint"]).glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k in ("d2t", "t2d"):
                    continue
                total += math.prod(fh.get_slice(k).get_shape())
    return total


def _plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [c for c in result["configs"] if c != "target-only"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for c in spec:
        xs = result["contexts"]
        axes[0].plot(xs, [result["summary"][c][str(x)]["mal"] for x in xs], marker="o", label=c)
        axes[1].plot(xs, [result["summary"][c][str(x)]["decode_speedup_geomean"] for x in xs], marker="o", label=c)
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="mean accepted length (greedy)",
                title=f"{result['family']}: MAL vs context")
    axes[1].axhline(1.0, color="grey", ls=":")
    axes[1].set(xscale="log", xlabel="context tokens", ylabel="decode tokens/s vs target-only (geo-mean)",
                title="decode speedup (prefill excluded)")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    p1 = out / "mal_vs_context.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    longest = str(max(result["contexts"]))
    for c in spec:
        acc = result["summary"][c][longest]["acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=c)
    ax.set(xlabel="draft position", ylabel="acceptance rate", title=f"acceptance per position at {longest} tokens")
    ax.legend()
    fig.tight_layout()
    p2 = out / "acceptance_vs_position.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def _summary(result: dict) -> dict:
    base = result["runs"]["target-only"]["rows"]
    out = {}
    for c in result["configs"]:
        rows = result["runs"][c]["rows"]
        out[c] = {}
        for ctx in result["contexts"]:
            names = [n for n in rows if n.endswith(f"@{ctx}")]
            entry = {"tokens_per_s": statistics.mean(rows[n]["tokens_per_s"] for n in names),
                     "speedup_geomean": statistics.geometric_mean(rows[n]["tokens_per_s"] / base[n]["tokens_per_s"]
                                                                  for n in names),
                     "decode_speedup_geomean": statistics.geometric_mean(
                         rows[n]["decode_tokens_per_s"] / base[n]["decode_tokens_per_s"] for n in names),
                     "prefill_s": statistics.mean(rows[n]["prefill_s"] for n in names)}
            if c != "target-only":
                entry["mal"] = statistics.mean(rows[n]["mal"] for n in names)
                width = max(len(rows[n]["acceptance"]) for n in names)
                entry["acceptance"] = [statistics.mean(rows[n]["acceptance"][j] for n in names
                                                       if j < len(rows[n]["acceptance"])) for j in range(width)]
            out[c][str(ctx)] = entry
    return out


@click.command()
@click.option("--engine", "engines", multiple=True,
              help="LABEL=DIR engines folder with a query-scaled drafter (repeatable); the first also runs "
                   "target-only and frozen")
@click.option("--contexts", default="512,1024,2048,4096,7168", show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--end-token", default=END_TOKEN, show_default=True, help="prompts end at this token of each document")
@click.option("--docs", default=None, help="comma-separated held-out document names (default: all six)")
@click.option("--threads", type=int, default=None)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/long_context"), show_default=True)
@click.option("--reuse", is_flag=True,
              help="keep a configuration's earlier run_<label>.json in --out when it covers the same prompts "
                   "(resume an interrupted benchmark, or re-summarise)")
@click.option("--worker", hidden=True, default=None)
def main(engines, contexts, new_tokens, end_token, docs, threads, out, reuse, worker):
    if worker is not None:  # child process: one configuration, prompts from the parent's prompts.json
        label, _, path = worker.partition("=")
        prompts = json.loads((out / "prompts.json").read_text())
        res = _worker(Path(path), label, prompts, new_tokens, threads)
        (out / f"run_{label}.json").write_text(json.dumps(res))
        return
    if not engines:
        raise click.UsageError("pass at least one --engine LABEL=DIR")
    contexts = sorted(int(c) for c in contexts.split(","))
    pairs = []
    for spec in engines:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise click.BadParameter(f"expected LABEL=DIR, got {spec!r}", param_hint="--engine")
        if label in ("target-only", "frozen"):
            raise click.BadParameter(f"label {label!r} is reserved", param_hint="--engine")
        pairs.append((label, Path(path)))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pairs[0][1] / "tokenizer" / "tokenizer.json"))

    class _Tok:
        def encode(self, text):
            return tok.encode(text, add_special_tokens=False).ids

    prompts = _prompts(_Tok(), contexts, end_token, docs.split(",") if docs else None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps(prompts))
    configs = [("target-only", pairs[0][1]), ("frozen", pairs[0][1]), *pairs]
    runs = {}
    for label, path in configs:
        earlier = out / f"run_{label}.json"
        if reuse and earlier.is_file():
            run = json.loads(earlier.read_text())
            if (run["engine"] == str(path) and run.get("max_new_tokens") == new_tokens
                    and {n: r["prompt_ids"] for n, r in run["rows"].items()} == prompts):
                runs[label] = run
                click.echo(f"{label}: reusing {earlier}")
                continue
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--worker", f"{label}={path}", "--new-tokens", str(new_tokens),
               "--out", str(out)]
        if threads:
            cmd += ["--threads", str(threads)]
        subprocess.run(cmd, check=True)
        runs[label] = json.loads((out / f"run_{label}.json").read_text())
        click.echo(f"{label}: {time.perf_counter() - t0:.0f} s, peak RSS {runs[label]['peak_rss_mb']:.0f} MB")
    base = runs["target-only"]["rows"]
    for label, run in runs.items():
        for name, row in run["rows"].items():
            if row["token_ids"] != base[name]["token_ids"]:
                raise SystemExit(f"{label} {name}: output differs from target-only greedy (lossless broken)")
    manifest = json.loads((pairs[0][1] / "manifest.json").read_text())
    result = {"family": manifest["drafter"]["family"], "contexts": contexts, "new_tokens": new_tokens,
              "end_token": end_token, "configs": [c for c, _ in configs],
              "trainable_params": _trainable_params(pairs[0][1]), "runs": runs}
    result["summary"] = _summary(result)
    for run in runs.values():
        for row in run["rows"].values():
            row.pop("token_ids")
            row.pop("prompt_ids")
    (out / "bench_long_context.json").write_text(json.dumps(result, indent=1))
    paths = _plots(result, out)
    head = ("| config | " + " | ".join(f"MAL @{c}" for c in contexts)
            + " | speedup incl. prefill | decode speedup | peak RSS MB |")
    click.echo(head)
    click.echo("|" + "---|" * (len(contexts) + 4))
    for c in result["configs"]:
        s = result["summary"][c]
        mals = " | ".join("-" if c == "target-only" else f"{s[str(x)]['mal']:.3f}" for x in contexts)
        geo = statistics.geometric_mean(s[str(x)]["speedup_geomean"] for x in contexts)
        dec = statistics.geometric_mean(s[str(x)]["decode_speedup_geomean"] for x in contexts)
        click.echo(f"| {c} | {mals} | {geo:.3f} | {dec:.3f} | {runs[c]['peak_rss_mb']:.0f} |")
    click.echo(f"trainable drafter parameters: {result['trainable_params'] / 1e6:.2f} M")
    click.echo(f"wrote {out / 'bench_long_context.json'}, {', '.join(p.name for p in paths)}")


if __name__ == "__main__":
    main()
