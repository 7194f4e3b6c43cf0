"""Command line of the self-distilled corpus (what it makes and how: training/distill.py).

  python scripts/distill.py generate --engine runs/eng_int4 --minutes 50
  python scripts/distill.py features --engine runs/eng_int4 --features runs/distill/data
"""
from __future__ import annotations

from pathlib import Path

import click

from training import distill
from training.distill import DEFAULT_CORPUS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    pass


@cli.command()
@click.option("--engine", "engine_dir", default="runs/eng_int4", type=click.Path(exists=True, path_type=Path),
              help="an engines/ folder whose target is served (quantized, kv_io shared)")
@click.option("--corpus", default=DEFAULT_CORPUS, type=click.Path(path_type=Path), show_default=True)
@click.option("--features", "feat_dir", default=Path("runs/distill/data"), type=click.Path(path_type=Path),
              show_default=True, help="feature shards for scripts/train_dflash.py (build output)")
@click.option("--minutes", default=30.0, show_default=True)
@click.option("--slots", default=12, show_default=True, help="sequences decoded together")
@click.option("--seed", default=0, show_default=True)
@click.option("--doc-frac", default=0.35, show_default=True, help="fraction of items that are document continuations")
@click.option("--seq-len", default=1280, show_default=True, help="longest sequence (prompt + reply)")
@click.option("--new-tokens", default=256, show_default=True, help="most tokens generated per turn")
@click.option("--topk", default=32, show_default=True, help="target logits kept per position (0: labels only)")
@click.option("--threads", default=2)
def generate(engine_dir: Path, corpus: Path, feat_dir: Path, minutes: float, slots: int, seed: int, doc_frac: float,
             seq_len: int, new_tokens: int, topk: int, threads: int):
    """Greedy-decode training items with the served target; append token and feature shards (resumable)."""
    distill.generate(engine_dir=engine_dir, corpus=corpus, feat_dir=feat_dir, minutes=minutes, slots=slots, seed=seed,
                     doc_frac=doc_frac, seq_len=seq_len, new_tokens=new_tokens, topk=topk, threads=threads)


@cli.command()
@click.option("--engine", "engine_dir", default="runs/eng_int4", type=click.Path(exists=True, path_type=Path))
@click.option("--corpus", default=DEFAULT_CORPUS, type=click.Path(exists=True, path_type=Path), show_default=True)
@click.option("--features", "feat_dir", default=Path("runs/distill/data"), type=click.Path(path_type=Path),
              show_default=True)
@click.option("--topk", default=32, show_default=True, help="target logits kept per position (0: labels only)")
@click.option("--threads", default=2)
def features(engine_dir: Path, corpus: Path, feat_dir: Path, topk: int, threads: int):
    """Recompute feature shards from the token shards: one teacher-forced target pass per sequence (skips shards
    whose features exist)."""
    distill.features(engine_dir=engine_dir, corpus=corpus, feat_dir=feat_dir, topk=topk, threads=threads)


if __name__ == "__main__":
    cli()
