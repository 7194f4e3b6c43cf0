"""Thread and spinning settings of the two ONNX Runtime sessions, measured in the real loop.

The target and drafter sessions take turns on the same cores. Which of them may spin (keep its intra-op workers
busy-waiting after a run, ONNX Runtime's default) and how many threads each gets decides how much of a round is
lost to the other session's idle workers. Each setting below runs in its own child process (a spinning pool
outlives its session's last run, so settings must not share a process), on held-out prompts (prose and code at
``--context`` tokens, one chat prompt), speculative and target-only greedy, ``--new-tokens`` each; settings are
rotated ``--rounds`` times. Reported per setting: decode tokens/s of both (median over rounds), MAL, and that every
speculative output equals target-only.

Settings (``runtime/backends/ort.py session_options``; the environment variables it reads):
- ``default``: the runtime's defaults (target spins, drafter on 1 thread without spinning);
- ``no-spin``: spinning off everywhere, both sessions on all cores (the defaults before 2026-12-02);
- ``drafter-all-cores``: the target spins, the drafter on all cores without spinning;
- ``both-spin``: both spin on all cores.

  python scripts/bench_threads.py --engine engines/ --context 1024 --rounds 2 --out runs/bench/threads.json
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import click

from runtime.benchmarking import rotated

CORES = str(os.cpu_count() or 1)
SETTINGS = {
    "default": {},
    "no-spin": {"SHARPDRAFT_TARGET_SPIN": "0", "SHARPDRAFT_DRAFTER_SPIN": "0", "SHARPDRAFT_DRAFTER_THREADS": CORES},
    "drafter-all-cores": {"SHARPDRAFT_DRAFTER_THREADS": CORES},
    "both-spin": {"SHARPDRAFT_DRAFTER_SPIN": "1", "SHARPDRAFT_DRAFTER_THREADS": CORES},
}


def _worker(engine_dir: Path, context: int, new_tokens: int) -> dict:
    from runtime.engine import SpecEngine
    from training.corpus import chat_prompts, document_prompts

    engine = SpecEngine.from_dir(engine_dir)
    tok = engine.tokenizer

    class _Tok:
        def encode(self, text):
            return tok.encode(text, add_special_tokens=False)

    prompts = document_prompts(_Tok(), [context], 3500, ["hamlet_gut", "argparse.py"])
    prompts["chat"] = chat_prompts("heldout", tok, 1)[0]
    engine.generate(prompts["chat"][:16], 4)  # warm-up
    out = {}
    for name, ids in prompts.items():
        spec = engine.generate(ids, new_tokens)
        base = engine.generate_target_only(ids, new_tokens)
        n = len(spec.token_ids)
        out[name] = {"speculative": n / spec.stats.decode_s, "target_only": n / base.stats.decode_s,
                     "mal": spec.stats.mean_accepted_length, "lossless": spec.token_ids == base.token_ids}
    return out


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path, exists=True))
@click.option("--context", default=1024, show_default=True)
@click.option("--new-tokens", default=96, show_default=True)
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--settings", default=",".join(SETTINGS), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench/threads.json"), show_default=True)
@click.option("--worker", hidden=True, is_flag=True)
def main(engine_dir, context, new_tokens, rounds, settings, out, worker):
    if worker:
        click.echo(json.dumps(_worker(engine_dir, context, new_tokens)))
        return
    names = [s.strip() for s in settings.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise click.BadParameter(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}",
                                 param_hint="--settings")
    runs = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SHARPDRAFT_")} | SETTINGS[name]
            proc = subprocess.run([sys.executable, __file__, "--worker", "--engine", str(engine_dir), "--context",
                                   str(context), "--new-tokens", str(new_tokens)], env=env, capture_output=True,
                                  text=True, check=True)
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, reps in runs.items():
        summary[name] = {p: {key: round(statistics.median(rep[p][key] for rep in reps), 3)
                             for key in ("speculative", "target_only", "mal")} | {
                             "lossless": all(rep[p]["lossless"] for rep in reps)} for p in reps[0]}
        row = "  ".join(f"{p}: {v['speculative']:.1f} / {v['target_only']:.1f}" for p, v in summary[name].items())
        click.echo(f"{name:18s} speculative / target-only decode tok/s  {row}")
    if not all(v["lossless"] for s in summary.values() for v in s.values()):
        raise SystemExit("a speculative output differs from target-only (lossless broken)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"context": context, "new_tokens": new_tokens, "rounds": rounds,
                               "settings": {n: SETTINGS[n] for n in names}, "summary": summary, "runs": runs},
                              indent=1))
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
