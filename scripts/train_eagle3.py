"""Command line of the EAGLE-3 drafter recipe (the recipe itself: training/eagle3.py).

  python scripts/train_eagle3.py train --minutes 45       # resumable: rerun to continue
  python scripts/train_eagle3.py save --out drafters/eagle3-smollm2-135m
"""
from __future__ import annotations

from pathlib import Path

import click

from training import eagle3


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    pass


@cli.command()
@click.option("--data", "data_dir", default="runs/dflash/data", type=click.Path(path_type=Path))
@click.option("--work", default="runs/eagle3", type=click.Path(path_type=Path))
@click.option("--minutes", default=45.0, help="wall-clock budget for this call")
@click.option("--draft-vocab", default=8192)
@click.option("--steps", "ttt_steps", default=3, help="TTT steps: 1 teacher-forced + (steps - 1) unrolled")
@click.option("--val-steps", default=5)
@click.option("--lr", default=1e-3)
@click.option("--seqs-per-step", default=2)
@click.option("--save-minutes", default=8.0)
@click.option("--max-steps", default=0, help="stop after this many optimiser steps (0: no limit; for smoke tests)")
@click.option("--val-every", default=40, help="1 sequence in this many (by token-id hash) is validation")
@click.option("--threads", default=2)
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="start from this EAGLE-3 checkpoint folder (its weights and draft vocabulary; a fresh optimizer) "
                   "instead of the target's layer; ignored when --work holds a checkpoint to resume")
def train(data_dir: Path, work: Path, minutes: float, draft_vocab: int, ttt_steps: int, val_steps: int, lr: float,
          seqs_per_step: int, save_minutes: float, max_steps: int, val_every: int, threads: int,
          init_from: Path | None):
    """Train (or resume) on the feature shards for --minutes of wall time; checkpoint + validate every few minutes."""
    eagle3.train(data_dir=data_dir, work=work, minutes=minutes, draft_vocab=draft_vocab, ttt_steps=ttt_steps,
                 val_steps=val_steps, lr=lr, seqs_per_step=seqs_per_step, save_minutes=save_minutes,
                 max_steps=max_steps, val_every=val_every, threads=threads, init_from=init_from)


@cli.command()
@click.option("--data", "data_dir", default="runs/dflash/data", type=click.Path(path_type=Path))
@click.option("--work", default="runs/eagle3", type=click.Path(path_type=Path))
@click.option("--steps", default=7, help="chain depth evaluated")
@click.option("--threads", default=2)
def evaluate(data_dir: Path, work: Path, steps: int, threads: int):
    """Validation proxy of the checkpoint in both layouts (positions held = training; advanced = chain inference)."""
    eagle3.evaluate(data_dir=data_dir, work=work, steps=steps, threads=threads)


@cli.command()
@click.option("--work", default="runs/eagle3", type=click.Path(path_type=Path))
@click.option("--out", default="drafters/eagle3-smollm2-135m", type=click.Path(path_type=Path))
def save(work: Path, out: Path):
    """Write the checkpoint in the official EAGLE-3 layout (bf16 safetensors) and check it loads strictly."""
    eagle3.save(work=work, out=out)


if __name__ == "__main__":
    cli()
