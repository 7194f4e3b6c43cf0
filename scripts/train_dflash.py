"""Command line of the DFlash drafter recipe (the recipe itself: training/dflash.py).

  python scripts/train_dflash.py data --minutes 20
  python scripts/train_dflash.py train --minutes 40
  python scripts/train_dflash.py save --out drafters/dflash-smollm2-135m
"""
from __future__ import annotations

from pathlib import Path

import click

from training import dflash
from training.dflash import SEQ_LEN


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    pass


@cli.command()
@click.option("--work", default="runs/dflash", type=click.Path(path_type=Path))
@click.option("--minutes", default=20.0, help="wall-clock budget for this call")
@click.option("--distill-frac", default=0.5, help="fraction of shards that are self-distilled")
@click.option("--threads", default=2)
@click.option("--seed", default=0)
@click.option("--seq-len", default=SEQ_LEN, show_default=True, type=click.IntRange(256, 8192),
              help="tokens per sequence: teacher-forced windows have this length; self-distilled prompts leave "
                   "room for --new-tokens")
@click.option("--new-tokens", default=192, show_default=True, type=click.IntRange(16, 1024),
              help="greedy tokens the target appends to each self-distillation prompt")
@click.option("--long-prompts", is_flag=True,
              help="self-distillation prompts are document windows of one random length per shard, up to "
                   "seq-len - new-tokens (instead of 64-256 tokens or a chat prompt): labels along the target's "
                   "greedy chain at long context")
def data(work: Path, minutes: float, distill_frac: float, threads: int, seed: int, seq_len: int, new_tokens: int,
         long_prompts: bool):
    """Append feature shards (teacher-forced and self-distilled) until the time budget is spent."""
    dflash.make_data(work=work, minutes=minutes, distill_frac=distill_frac, threads=threads, seed=seed, seq_len=seq_len,
                     new_tokens=new_tokens, long_prompts=long_prompts)


@cli.command()
@click.option("--work", default="runs/dflash", show_default=True, type=click.Path(path_type=Path),
              help="run folder: feature shards under WORK/data (this script's `data` step or scripts/distill.py "
                   "features), checkpoints ckpt.pt / ckpt_best.pt written here; an existing ckpt.pt is resumed")
@click.option("--minutes", default=40.0, show_default=True,
              help="wall-clock budget of this call; the learning rate falls from --lr to --lr/10 over it (cosine)")
@click.option("--layers", default=2, show_default=True,
              help="new runs: drafter layers; with --init-from, more layers than the checkpoint's grow it "
                   "(grow_drafter)")
@click.option("--lr", default=1e-3, show_default=True,
              help="peak AdamW learning rate (a fresh run; continuations of shipped weights use 1e-4)")
@click.option("--seqs-per-step", default=4, show_default=True, help="training sequences per optimizer step")
@click.option("--anchors", default=32, show_default=True,
              help="draft blocks per sequence per step (random anchor positions, one dense masked forward)")
@click.option("--save-every", default=100, show_default=True,
              help="steps between checkpoints and validation (the best replayed validation goes to ckpt_best.pt)")
@click.option("--threads", default=2, show_default=True, help="torch CPU threads")
@click.option("--draft-vocab", "draft_vocab_path", default=None, type=click.Path(exists=True, path_type=Path),
              help="draft_vocab.json: score (and train) only these LM-head rows, as the runtime does; labels outside "
                   "it carry no loss. About 2x faster steps with 8,192 of 49,152 rows.")
@click.option("--slot-decay", default=4.0, show_default=True, type=click.FloatRange(min=0.1),
              help="CE weight of slot j is exp(-(j-1)/slot_decay); smaller favours the first slots")
@click.option("--init-from", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="start a new run (no checkpoint under --work yet) from these DFlash weights, e.g. the shipped "
                   "drafters/dflash-smollm2-135m-swa768-1full (the default) or drafters/dflash-smollm2-135m (full "
                   "attention), with a fresh optimizer; ignored when resuming")
@click.option("--sliding-window", default=None, type=click.IntRange(min=1),
              help="new runs (also with --init-from): sliding-window layers with this window (Qwen3.6 DFlash "
                   "style); see --full-layers")
@click.option("--full-layers", default=0, show_default=True, type=click.IntRange(min=0),
              help="with --sliding-window: how many of the last layers keep full attention (Qwen3.6: 1 of 5)")
@click.option("--gen-anchors", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="fraction of each sequence's anchors drawn from the target's own greedy continuation (records "
                   "with a prompt_len, scripts/distill.py), where the drafter drafts at inference; the rest uniform")
@click.option("--tables-from", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="an engines/ folder: train with the embedding and LM head its drafter is fed (a quantized "
                   "target's own int4 tables, dequantized as the runtime does) instead of the fp32 target's")
@click.option("--walk-anchors", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="fraction of each sequence's anchors taken from the rounds the draft-verify loop would make with "
                   "the current weights (walk_rounds over WALK_SPAN generated positions from a random start): the "
                   "positions after a rejection, where the loop drafts, not uniform ones; the rest as --gen-anchors")
@click.option("--kd", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="weight of the soft-target term (the target's top logits stored by scripts/distill.py) against "
                   "the argmax labels (block_loss); records without top logits use the labels alone")
@click.option("--kd-temp", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              help="softmax temperature of the soft-target term")
@click.option("--chain-mask/--no-chain-mask", default=False, show_default=True,
              help="train slot j >= 2 only where the tokens before its label are the target's own greedy chain "
                   "(greedy_chain_mask): as at inference; off, human-written prompt text gives labels the drafter "
                   "cannot see the cause of")
def train(work: Path, minutes: float, layers: int, lr: float, seqs_per_step: int, anchors: int, save_every: int,
          threads: int, draft_vocab_path: Path | None, slot_decay: float, init_from: Path | None,
          sliding_window: int | None, full_layers: int, gen_anchors: float, walk_anchors: float,
          tables_from: Path | None, kd: float, kd_temp: float, chain_mask: bool):
    """Train (or resume) the drafter on all shards under --work for --minutes of wall time.

    The drafter's ``sharpdraft_query_scale.ref_keys`` is set to the longest training sequence (its training
    length): beta stays 1 at every N it was trained at, and training runs with beta 1.
    """
    dflash.train(work=work, minutes=minutes, layers=layers, lr=lr, seqs_per_step=seqs_per_step, anchors=anchors,
                 save_every=save_every, threads=threads, draft_vocab_path=draft_vocab_path, slot_decay=slot_decay,
                 init_from=init_from, sliding_window=sliding_window, full_layers=full_layers, gen_anchors=gen_anchors,
                 walk_anchors=walk_anchors, tables_from=tables_from, kd=kd, kd_temp=kd_temp, chain_mask=chain_mask)


@cli.command()
@click.option("--work", default="runs/dflash", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="drafter folder to write (a shipped one, e.g. drafters/dflash-smollm2-135m-swa768-1full, is "
                   "overwritten: name it on purpose)")
@click.option("--best", is_flag=True, help="write ckpt_best.pt (the last call's best validation) instead of the "
                                          "latest checkpoint")
def save(work: Path, out: Path, best: bool):
    """Write the checkpoint in the public DFlash format (bf16 safetensors) plus training_log.json."""
    dflash.save(work=work, out=out, best=best)


@cli.command("validate")
@click.option("--work", default="runs/dflash", type=click.Path(path_type=Path),
              help="its data/ shards give the validation sequences (1 in 40, by a hash of their ids)")
@click.option("--weights", "weights", required=True, multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="DFlash checkpoint folders to measure on the same sequences (repeatable)")
@click.option("--draft-vocab", "draft_vocab_path", default=None, type=click.Path(exists=True, path_type=Path))
@click.option("--tables-from", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--slot-decay", default=2.0, show_default=True, type=click.FloatRange(min=0.1))
@click.option("--threads", default=2)
def validate_cmd(work: Path, weights: tuple[Path, ...], draft_vocab_path: Path | None, tables_from: Path | None,
                 slot_decay: float, threads: int):
    """Validation figures (loss, proxies, val_walk_mal) of several weights on one validation set, one JSON line each."""
    dflash.validate_weights(work=work, weights=weights, draft_vocab_path=draft_vocab_path, tables_from=tables_from,
                            slot_decay=slot_decay, threads=threads)


@cli.command("draft-vocab")
@click.option("--work", default="runs/dflash", type=click.Path(path_type=Path))
@click.option("--size", default=8192, show_default=True, type=click.IntRange(1, None))
@click.option("--out", default="drafters/dflash-smollm2-135m", type=click.Path(path_type=Path))
def draft_vocab(work: Path, size: int, out: Path):
    """Write ``draft_vocab.json``: the ``--size`` tokens the target emits most often as argmax labels over the
    training shards (runtime/draft_vocab.py: the drafter's LM head scores only those)."""
    dflash.make_draft_vocab(work=work, size=size, out=out)


if __name__ == "__main__":
    cli()
