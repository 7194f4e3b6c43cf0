"""The paper's Table 1 on our pair: MAL, acceptance per position, speed and memory vs context, per configuration.

SharpDraft (arXiv 2610.05106) compares query scaling with online adaptation of the drafter (LoRA and full) and the
frozen drafter; the field's other answer to long-context decay is a sliding-window drafter. This benchmark runs
them on the same prompts. Prompts: for each held-out document (training/corpus.py ``heldout``: hamlet, othello,
macbeth, argparse.py, typing.py, subprocess.py; never used in training or calibration) and each context length C,
the C tokens ending at token ``--end-token`` (every C continues from the same point); with ``--chat N``, also N
document-grounded chat prompts per C (a held-out passage in the chat template, "Summarise the passage above.", C
tokens in all). Configurations, each in its own child process (so peak memory is per configuration):

- ``target-only``: target greedy decoding through the first engines folder (the lossless reference);
- ``frozen``: speculative with the query scale switched off (first folder, ``query_scale=False``);
- one per ``--engine LABEL=DIR``: speculative with that folder's exported profile (e.g. ``paper`` = family preset,
  ``fitted`` = ``sharpdraft-calibrate --write-engine``, ``swa-beta`` = a sliding-window drafter's folder);
- one per ``--frozen-engine LABEL=DIR``: that folder with the scale off (``swa`` = the sliding-window drafter alone);
- with ``--online lora,full``: ``target-only-torch`` (the first folder's pair rebuilt in PyTorch, the reference of
  the next three), ``frozen-torch`` (the same drafter frozen on that backend, query scale off: what adaptation
  starts from), ``lora-online`` and ``full-online``: the frozen drafter adapted online to the target's verified
  tokens (runtime/online_adapt.py; ``--adapt-rank``, ``--adapt-lr``, ``--adapt-interval``), one adapter across all
  prompts in order, as a server would.

``--rounds R`` runs every configuration R times, each round in a rotated order (round r starts r * n / R
configurations further on), so slow drift of the machine does not favour the configurations that run first; timings
per prompt are the median over rounds, peak RSS the largest, and every round must give the same tokens.

Every speculative output is checked token for token against its backend's target-only (greedy: lossless). Writes
``bench_table1.json`` (per prompt and configuration: MAL, acceptance per position, tokens/s with and without
prefill, peak RSS, trainable parameters; ``--reuse`` keeps finished configurations of an interrupted run),
``mal_vs_context.png`` and ``acceptance_vs_position.png``, and prints the Table 1 analogue (method, trainable
parameters, peak memory, MAL per context, decode speedup vs target-only).

  python scripts/bench_table1.py --engine paper=runs/engines/dflash-paper \\
      --engine fitted=runs/engines/dflash-fitted --online lora,full --online-engine runs/engines/dflash-fp32 \\
      --chat 2 --contexts 512,1024,4096,8000

The online rows run on the torch backend, which rebuilds the fp32 target: ``--online-engine`` names an fp32 export
of the same drafter when the ``--engine`` folders hold the (default) int4 target.
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

from runtime.benchmarking import figure, geomean_ratio, rotations, save_figure

END_TOKEN = 7700
ONLINE = {"lora-online": "lora", "full-online": "full"}
TORCH_BASE = "target-only-torch"
FROZEN_TORCH = "frozen-torch"
TORCH_CONFIGS = (TORCH_BASE, FROZEN_TORCH, *ONLINE)
RESERVED = ("target-only", "frozen", *TORCH_CONFIGS)
TIMINGS = ("prefill_s", "decode_s", "draft_s", "verify_s", "tokens_per_s", "decode_tokens_per_s")
CHAT_TASK = "\n\nSummarise the passage above in a few sentences."


def chat_prompts(tokenizer, contexts: list[int], end_token: int, n: int) -> dict[str, list[int]]:
    """``{"chat:<doc>@<C>": ids}``: document-grounded chat prompts of C tokens (within a few: token boundaries),
    the user turn a held-out passage ending at ``end_token`` plus :data:`CHAT_TASK`, in the target's chat template.
    ``tokenizer``: a transformers tokenizer with a chat template."""
    from training.corpus import plays, stdlib_modules

    docs = list({**plays("heldout"), **stdlib_modules("heldout")}.items())[:n]
    frame = len(_chat(tokenizer, CHAT_TASK))  # template tokens around the passage
    out = {}
    for name, text in docs:
        ids = tokenizer.encode(text, add_special_tokens=False)[:end_token]
        for c in contexts:
            passage = tokenizer.decode(ids[-max(c - frame, 16):])
            out[f"chat:{name}@{c}"] = _chat(tokenizer, passage + CHAT_TASK)
    return out


def _chat(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _worker(engine_dir: Path, config: str, prompts: dict[str, list[int]], new_tokens: int, threads: int | None,
            query_scale: bool, adapt: dict) -> dict:
    from tqdm import tqdm

    from runtime.engine import SpecEngine
    from runtime.sampling import SamplingParams

    torch_backend = config in TORCH_CONFIGS
    online = None
    if config in ONLINE:
        from runtime.online_adapt import AdaptConfig

        online = AdaptConfig(ONLINE[config], adapt["rank"], adapt["lr"], adapt["interval"])
    engine = SpecEngine.from_dir(engine_dir, threads=threads, backend="torch" if torch_backend else "onnxruntime",
                                 online_adapt=online)
    adapter = engine.adapter
    speculative = config not in ("target-only", TORCH_BASE)
    first = next(iter(prompts.values()))
    engine.generate(first[:16], 4, speculative=speculative)  # warm-up
    rows = {}
    for name, ids in tqdm(prompts.items(), desc=config, file=sys.stderr):
        params = SamplingParams(max_new_tokens=new_tokens, query_scale=query_scale)
        res = engine.generate(ids, params=params, speculative=speculative)
        s = res.stats
        rows[name] = {"prompt_ids": ids, "token_ids": res.token_ids, "new_tokens": len(res.token_ids),
                      "prefill_s": round(s.prefill_s, 4), "decode_s": round(s.decode_s, 4),
                      "draft_s": round(s.draft_s, 4), "verify_s": round(s.verify_s, 4),
                      "tokens_per_s": round(s.tokens_per_s, 3),
                      "decode_tokens_per_s": round(len(res.token_ids) / max(s.decode_s, 1e-9), 3)}
        if speculative:
            rows[name] |= {"mal": round(s.mean_accepted_length, 4), "acceptance": s.acceptance_per_position,
                           "rounds": s.rounds}
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"config": config, "engine": str(engine_dir), "query_scale": engine.manifest.to_dict()["query_scale"],
            "query_scale_on": query_scale, "backend": "torch" if torch_backend else "onnxruntime",
            "max_new_tokens": new_tokens, "peak_rss_mb": round(peak_mb, 1), "rows": rows,
            "online": adapter.stats() if adapter is not None else None}


def merge_rounds(label: str, runs: list[dict]) -> dict:
    """One configuration's rounds as one run: per prompt the median of every timing in :data:`TIMINGS` over rounds,
    peak RSS the largest; MAL, acceptance and tokens come from round 0.

    Raises:
        SystemExit: two rounds gave different tokens for a prompt (greedy decoding must be deterministic).
    """
    merged = json.loads(json.dumps(runs[0]))
    for name, row in merged["rows"].items():
        for other in runs[1:]:
            if other["rows"][name]["token_ids"] != row["token_ids"]:
                raise SystemExit(f"{label} {name}: rounds gave different tokens (greedy must be deterministic)")
        for key in TIMINGS:
            row[key] = statistics.median(r["rows"][name][key] for r in runs)
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    merged["rounds"] = len(runs)
    return merged


def _baseline(config: str) -> str:
    """The target-only configuration a configuration is checked and timed against (same backend)."""
    return TORCH_BASE if config in TORCH_CONFIGS else "target-only"


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
    spec = [c for c in result["configs"] if c not in ("target-only", TORCH_BASE)]
    fig, axes = figure(2, (11, 4))
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
    p1 = save_figure(fig, out / "mal_vs_context.png")
    fig, ax = figure(1, (6, 4))
    longest = str(max(result["contexts"]))
    for c in spec:
        acc = result["summary"][c][longest]["acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=c)
    ax.set(xlabel="draft position", ylabel="acceptance rate", title=f"acceptance per position at {longest} tokens")
    ax.legend()
    p2 = save_figure(fig, out / "acceptance_vs_position.png")
    return [p1, p2]


def _summary(result: dict) -> dict:
    out = {}
    for c in result["configs"]:
        rows = result["runs"][c]["rows"]
        base = result["runs"][_baseline(c)]["rows"]
        out[c] = {}
        for ctx in result["contexts"]:
            names = [n for n in rows if n.endswith(f"@{ctx}")]
            entry = {"tokens_per_s": statistics.mean(rows[n]["tokens_per_s"] for n in names),
                     "speedup_geomean": geomean_ratio(
                         (rows[n]["tokens_per_s"], base[n]["tokens_per_s"]) for n in names),
                     "decode_speedup_geomean": geomean_ratio(
                         (rows[n]["decode_tokens_per_s"], base[n]["decode_tokens_per_s"]) for n in names),
                     "prefill_s": statistics.mean(rows[n]["prefill_s"] for n in names)}
            if "mal" in rows[names[0]]:
                entry["mal"] = statistics.mean(rows[n]["mal"] for n in names)
                for kind, pick in (("documents", lambda n: not n.startswith("chat:")),
                                   ("chat", lambda n: n.startswith("chat:"))):
                    sel = [rows[n]["mal"] for n in names if pick(n)]
                    if sel and len(sel) < len(names):
                        entry[f"mal_{kind}"] = statistics.mean(sel)
                width = max(len(rows[n]["acceptance"]) for n in names)
                entry["acceptance"] = [statistics.mean(rows[n]["acceptance"][j] for n in names
                                                       if j < len(rows[n]["acceptance"])) for j in range(width)]
            out[c][str(ctx)] = entry
    return out


def _trainable(result: dict, config: str) -> int:
    """Parameters trained for this configuration at serving time: the online adapter's (LoRA: its adapters; full:
    every drafter weight); 0 for the frozen drafter and query scaling (its drafter was trained offline)."""
    online = result["runs"][config].get("online")
    return int(online["trainable_parameters"]) if online else 0


def _engine_spec(spec: str, option: str) -> tuple[str, Path]:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise click.BadParameter(f"expected LABEL=DIR, got {spec!r}", param_hint=option)
    if label in RESERVED:
        raise click.BadParameter(f"label {label!r} is reserved", param_hint=option)
    return label, Path(path)


def _check_torch_folder(path: Path) -> None:
    """Refuse, before any row runs, a folder the torch-backend rows cannot rebuild (runtime/backends/pytorch.py's own
    check: a DFlash drafter and an fp32 target). Raises click.BadParameter naming --online-engine."""
    from runtime.manifest import EngineDirError, load_manifest
    from runtime.backends.pytorch import check_torch_backend

    try:
        check_torch_backend(load_manifest(path, verify_checksums=False, require_graphs=False))
    except EngineDirError as e:
        raise click.BadParameter(f"{path}: {e}; pass an fp32 export of the same drafter as --online-engine",
                                 param_hint="--online-engine") from e


@click.command()
@click.option("--engine", "engines", multiple=True,
              help="LABEL=DIR engines folder run with its exported query-scale profile (repeatable); the first also "
                   "runs target-only and frozen (and the online configurations)")
@click.option("--frozen-engine", "frozen_engines", multiple=True,
              help="LABEL=DIR engines folder run with the query scale off (repeatable), e.g. a sliding-window drafter")
@click.option("--contexts", default="512,1024,2048,4096,7168", show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--end-token", default=END_TOKEN, show_default=True, help="prompts end at this token of each document")
@click.option("--docs", default=None, help="comma-separated held-out document names (default: all six)")
@click.option("--chat", default=0, show_default=True, type=click.IntRange(0, 6),
              help="document-grounded chat prompts per context (the first N held-out documents)")
@click.option("--online", default="", help="comma-separated online adaptation modes to add: lora, full (torch backend)")
@click.option("--online-engine", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="engines folder of the same drafter exported with --target-precision fp32, for the torch-backend "
                   "rows (target-only-torch and the online ones); default: the first --engine")
@click.option("--adapt-rank", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--adapt-lr", default=1e-4, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--adapt-interval", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", type=int, default=None)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/table1"), show_default=True)
@click.option("--only", default=None,
              help="comma-separated configurations to run (their target-only baseline is added), e.g. the torch "
                   "rows at fewer contexts: frozen-torch,lora-online,full-online")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(min=1),
              help="run every configuration this many times, each round in a rotated order; timings are medians")
@click.option("--reuse", is_flag=True,
              help="keep a configuration's earlier run_<label>.json in --out when it covers the same prompts "
                   "(resume an interrupted benchmark, or re-summarise)")
@click.option("--worker", hidden=True, default=None)
@click.option("--worker-out", hidden=True, default=None)
@click.option("--scale-off", hidden=True, is_flag=True)
def main(engines, frozen_engines, contexts, new_tokens, end_token, docs, chat, online, online_engine, adapt_rank,
         adapt_lr, adapt_interval, threads, out, only, rounds, reuse, worker, worker_out, scale_off):
    adapt = {"rank": adapt_rank, "lr": adapt_lr, "interval": adapt_interval}
    if worker is not None:  # child process: one configuration, prompts from the parent's prompts.json
        label, _, path = worker.partition("=")
        prompts = json.loads((out / "prompts.json").read_text())
        res = _worker(Path(path), label, prompts, new_tokens, threads, not scale_off, adapt)
        (out / (worker_out or f"run_{label}.json")).write_text(json.dumps(res))
        return
    if not engines:
        raise click.UsageError("pass at least one --engine LABEL=DIR")
    modes = [m.strip() for m in online.split(",") if m.strip()]
    bad = sorted(set(modes) - {"lora", "full"})
    if bad:
        raise click.BadParameter(f"unknown online modes {bad}; choose from lora, full", param_hint="--online")
    contexts = sorted(int(c) for c in contexts.split(","))
    pairs = [_engine_spec(e, "--engine") for e in engines]
    frozen_pairs = [_engine_spec(e, "--frozen-engine") for e in frozen_engines]
    labels = [lb for lb, _ in pairs + frozen_pairs]
    if len(set(labels)) != len(labels):
        raise click.BadParameter(f"labels must be unique, got {labels}", param_hint="--engine")
    torch_dir = online_engine or pairs[0][1]
    if modes:  # refused here, not after the ONNX Runtime rows have run: the torch backend rebuilds the fp32 target
        _check_torch_folder(torch_dir)
    from transformers import AutoTokenizer

    from training.corpus import document_prompts

    tok = AutoTokenizer.from_pretrained(str(pairs[0][1] / "tokenizer"))

    class _Tok:
        def encode(self, text):
            return tok.encode(text, add_special_tokens=False)

    prompts = document_prompts(_Tok(), contexts, end_token, docs.split(",") if docs else None)
    if chat:
        prompts |= chat_prompts(tok, contexts, end_token, chat)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps(prompts))
    first = pairs[0][1]
    configs = [("target-only", first, True), ("frozen", first, False), *((lb, p, True) for lb, p in pairs),
               *((lb, p, False) for lb, p in frozen_pairs)]
    if modes:
        configs += [(TORCH_BASE, torch_dir, False), (FROZEN_TORCH, torch_dir, False)]
        configs += [(f"{m}-online", torch_dir, False) for m in modes]
    if only:
        keep = {c.strip() for c in only.split(",") if c.strip()}
        unknown = sorted(keep - {c for c, _, _ in configs})
        if unknown:
            raise click.BadParameter(f"unknown configurations {unknown}; this command has "
                                     f"{[c for c, _, _ in configs]}", param_hint="--only")
        keep |= {_baseline(c) for c in keep}  # the lossless check and the speedups need each one's target-only
        configs = [c for c in configs if c[0] in keep]
    per_round: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    orders = rotations(configs, rounds)
    for r, order in enumerate(orders):
        for label, path, scale in order:
            name = f"run_{label}.json" if r == 0 else f"run_{label}.r{r}.json"
            earlier = out / name
            if reuse and earlier.is_file():
                run = json.loads(earlier.read_text())
                if (run["engine"] == str(path) and run.get("max_new_tokens") == new_tokens
                        and run.get("query_scale_on", scale) == scale
                        and {n: row["prompt_ids"] for n, row in run["rows"].items()} == prompts):
                    per_round[label].append(run)
                    click.echo(f"{label}: reusing {earlier}")
                    continue
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--worker", f"{label}={path}", "--worker-out", name,
                   "--new-tokens", str(new_tokens), "--out", str(out), "--adapt-rank", str(adapt_rank),
                   "--adapt-lr", str(adapt_lr), "--adapt-interval", str(adapt_interval)]
            if threads:
                cmd += ["--threads", str(threads)]
            if not scale:
                cmd.append("--scale-off")
            done = subprocess.run(cmd)
            if done.returncode != 0:
                raise click.ClickException(
                    f"configuration {label} failed (exit {done.returncode}; its error is printed above); the "
                    f"finished configurations are kept in {out}: fix the cause and rerun with --reuse")
            per_round[label].append(json.loads(earlier.read_text()))
            click.echo(f"{label}{f' (round {r + 1})' if rounds > 1 else ''}: {time.perf_counter() - t0:.0f} s, "
                       f"peak RSS {per_round[label][-1]['peak_rss_mb']:.0f} MB")
    runs = {label: merge_rounds(label, rs) for label, rs in per_round.items()}
    for label, run in runs.items():
        base = runs[_baseline(label)]["rows"]
        for name, row in run["rows"].items():
            if row["token_ids"] != base[name]["token_ids"]:
                raise SystemExit(f"{label} {name}: output differs from {_baseline(label)} greedy (lossless broken)")
    manifest = json.loads((first / "manifest.json").read_text())
    result = {"family": manifest["drafter"]["family"], "contexts": contexts, "new_tokens": new_tokens,
              "end_token": end_token, "rounds": rounds,
              "orders": [[c for c, _, _ in order] for order in orders],
              "configs": [c for c, _, _ in configs], "adapt": adapt if modes else None,
              "drafter_params": _trainable_params(first), "runs": runs}
    result["summary"] = _summary(result)
    result["trainable_params"] = {c: _trainable(result, c) for c in result["configs"]}
    for run in runs.values():
        for row in run["rows"].values():
            row.pop("token_ids")
            row.pop("prompt_ids")
    (out / "bench_table1.json").write_text(json.dumps(result, indent=1))
    paths = _plots(result, out)
    click.echo("| method | trainable params (serving) | peak RSS MB | " + " | ".join(f"MAL @{c}" for c in contexts)
               + " | decode speedup | speedup incl. prefill |")
    click.echo("|" + "---|" * (len(contexts) + 5))
    for c in result["configs"]:
        s = result["summary"][c]
        mals = " | ".join(f"{s[str(x)]['mal']:.3f}" if "mal" in s[str(x)] else "-" for x in contexts)
        geo = statistics.geometric_mean(s[str(x)]["speedup_geomean"] for x in contexts)
        dec = statistics.geometric_mean(s[str(x)]["decode_speedup_geomean"] for x in contexts)
        click.echo(f"| {c} | {result['trainable_params'][c]:,} | {runs[c]['peak_rss_mb']:.0f} | {mals} | "
                   f"{dec:.3f}x | {geo:.3f}x |")
    click.echo(f"drafter parameters (trained offline): {result['drafter_params'] / 1e6:.2f} M; speedups are against "
               f"the same backend's target-only ({TORCH_BASE} for the online rows)")
    click.echo(f"wrote {out / 'bench_table1.json'}, {', '.join(p.name for p in paths)}")


if __name__ == "__main__":
    main()
