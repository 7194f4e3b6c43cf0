"""Command line of the PARD drafter recipe (the recipe itself: training/pard.py).

  python scripts/train_pard.py train --minutes 55          # resumable: rerun to continue
  python scripts/train_pard.py save --out drafters/pard-smollm2-135m
  python scripts/train_pard.py validate [--drafter drafters/pard-smollm2-135m]
"""
from __future__ import annotations

from pathlib import Path

import click

from training import pard
from training.pard import SEQ_LEN


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    pass


@cli.command()
@click.option("--work", default="runs/pard", type=click.Path(path_type=Path))
@click.option("--src", default="runs/dflash", type=click.Path(path_type=Path), help="DFlash shards to reuse")
@click.option("--minutes", default=40.0, help="wall-clock budget for this call (validation included)")
@click.option("--init", "init_mode", default="auto", type=click.Choice(["auto", "first", "last"]),
              help="target layers to initialise from; auto = lower validation loss at step 0")
@click.option("--labels", "labels_mode", default="argmax", type=click.Choice(["argmax", "tokens"]))
@click.option("--lr", default=1e-3)
@click.option("--warmup", default=30)
@click.option("--seqs-per-step", default=1)
@click.option("--trial-steps", default=30, help="steps per init candidate when --init auto")
@click.option("--save-minutes", default=4.0)
@click.option("--val-seqs", default=24, help="validation sequences checked at each checkpoint")
@click.option("--threads", default=2)
@click.option("--corpus", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="train on a token corpus (scripts/distill.py shards, e.g. corpora/smollm2-135m-int4) instead of "
                   "--src's feature shards; labels are the target's continuations (prompt positions ignored)")
@click.option("--max-len", default=SEQ_LEN, show_default=True, type=click.IntRange(min=16),
              help="each sequence is cut to its last this many tokens; the saved profile's ref_keys")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="start from a saved PARD drafter folder (fresh optimizer) instead of target layers")
def train(work: Path, src: Path, minutes: float, init_mode: str, labels_mode: str, lr: float, warmup: int,
          seqs_per_step: int, trial_steps: int, save_minutes: float, val_seqs: int, threads: int,
          corpus: Path | None, max_len: int, init_from: Path | None):
    """Train (or resume) the drafter for --minutes of wall time; checkpoints under --work."""
    pard.train(work=work, src=src, minutes=minutes, init_mode=init_mode, labels_mode=labels_mode, lr=lr, warmup=warmup,
               seqs_per_step=seqs_per_step, trial_steps=trial_steps, save_minutes=save_minutes, val_seqs=val_seqs,
               threads=threads, corpus=corpus, max_len=max_len, init_from=init_from)


@cli.command()
@click.option("--work", default="runs/pard", type=click.Path(path_type=Path))
@click.option("--out", default="drafters/pard-smollm2-135m", type=click.Path(path_type=Path))
def save(work: Path, out: Path):
    """Write config.json + model.safetensors (bf16, HF Llama keys + mask_embedding) + training_log.json."""
    pard.save(work=work, out=out)


@cli.command()
@click.option("--work", default="runs/pard", type=click.Path(path_type=Path))
@click.option("--src", default="runs/dflash", type=click.Path(path_type=Path))
@click.option("--drafter", default=None, type=click.Path(path_type=Path),
              help="a saved drafter folder (default: the training checkpoint)")
@click.option("--max-seqs", default=0, help="0 = all validation sequences")
@click.option("--labels", "labels_mode", default="argmax", type=click.Choice(["argmax", "tokens"]))
@click.option("--threads", default=2)
def validate(work: Path, src: Path, drafter: Path | None, max_seqs: int, labels_mode: str, threads: int):
    """Teacher-forced validation loss, proxy MAL and per-slot accuracy on the held-out (hash-split) sequences."""
    pard.validate_checkpoint(work=work, src=src, drafter=drafter, max_seqs=max_seqs, labels_mode=labels_mode,
                             threads=threads)


if __name__ == "__main__":
    cli()
