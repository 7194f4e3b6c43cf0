"""The training data on disk, and the one train / validation split every recipe uses.

Two formats:

- **feature shards** (``WORK/data/shard_NNNNN.pt``, build outputs, never committed), written by the DFlash recipe's
  ``data`` step (training/dflash.py) and by ``distill.py features`` / ``generate`` (training/distill.py), read by
  all three recipes (DFlash; PARD and EAGLE-3 reuse them): ``torch.save`` of ``{"kind": str, "seq_len": int,
  "records": [record, ...]}``, a record per sequence holding ``ids`` int32 [S], ``labels`` int32 [S] (the target's
  argmax at each position: labels[p] predicts ids[p + 1]), ``taps`` bf16 [S, len(taps) * hidden] (the target's
  hidden_states[id + 1] for each tapped layer id), optionally ``prompt_len`` (where the target's own greedy
  continuation starts) and ``top_ids`` int32 / ``top_logits`` fp16 [S, K] (the target's K largest logits);
- **token shards** (``corpora/<name>/shard_NNNNN.safetensors``, committed: ids only), written by
  ``distill.py generate``: ``ids`` uint16 (all sequences concatenated), ``offsets`` int64 [n + 1], ``prompt_lens``
  int32 [n], metadata ``sources`` and ``items`` (JSON lists).

The split: a sequence is validation when the CRC32 of its token ids (their int32 bytes) is divisible by
``val_every`` (40: 1 in 40), so it is stable when shards are added later and the same sequence lands on the same
side in every recipe (:func:`is_validation`).
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

VAL_EVERY = 40  # 1 sequence in 40 is validation
MIN_TOKENS = 11  # the shortest record the DFlash and PARD recipes use (a DFlash block of 8 plus 3), so both see the
#                  same sequences; EAGLE-3 takes records from 8 tokens on


def is_validation(ids: torch.Tensor, val_every: int = VAL_EVERY) -> bool:
    """Whether the sequence with token ids ``ids`` (an int32 tensor, as stored) is a validation sequence: the CRC32
    of its bytes is divisible by ``val_every``."""
    return zlib.crc32(ids.numpy().tobytes()) % val_every == 0


def split(records, val_every: int = VAL_EVERY, min_len: int = 0) -> tuple[list[dict], list[dict]]:
    """``(train, validation)`` records of an iterable of records (dicts with ``ids``), by :func:`is_validation`;
    records with fewer than ``min_len`` ids are dropped."""
    train_recs, val_recs = [], []
    for r in records:
        if r["ids"].numel() < min_len:
            continue
        (val_recs if is_validation(r["ids"], val_every) else train_recs).append(r)
    return train_recs, val_recs


# ------------------------------------------------------------------------------------------- feature shards
def feature_shard_files(data_dir: Path) -> list[Path]:
    """The feature shards of a data folder (``shard_*.pt``), in order."""
    return sorted(Path(data_dir).glob("shard_*.pt"))


def read_feature_shard(path: Path, mmap: bool = False) -> dict:
    """A feature shard's ``{"kind", "seq_len", "records"}`` (``mmap``: tensors paged in on use)."""
    return torch.load(path, mmap=True) if mmap else torch.load(path)


def write_feature_shard(path: Path, kind: str, seq_len: int, records: list[dict]) -> None:
    """Write a feature shard atomically: a temp file beside it, renamed when complete (an interrupted call leaves
    no bad shard)."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"kind": kind, "seq_len": seq_len, "records": records}, tmp)
    tmp.replace(path)


def feature_records(data_dir: Path) -> Iterator[dict]:
    """Every record of every feature shard under ``data_dir``, shard by shard."""
    for f in feature_shard_files(data_dir):
        yield from read_feature_shard(f)["records"]


def load_feature_split(data_dir: Path, val_every: int = VAL_EVERY, min_len: int = 0
                       ) -> tuple[list[dict], list[dict]]:
    """All records of the feature shards under ``data_dir``, :func:`split` into ``(train, validation)``."""
    return split(feature_records(data_dir), val_every, min_len)


# ------------------------------------------------------------------------------------------- token shards
def write_token_shard(path: Path, seqs: list[list[int]], prompt_lens: list[int], sources: list[str],
                      item_ids: list[int]) -> None:
    """Write one token shard atomically (temp + rename): ids uint16, offsets int64, prompt_lens int32."""
    from runtime.models.checkpoint_io import save_safetensors

    ids = np.concatenate([np.asarray(s, np.int64) for s in seqs])
    if ids.max() >= 2 ** 16:
        raise ValueError("token ids do not fit uint16; store int32 for this vocabulary")
    offsets = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    tmp = path.with_name(f".{path.name}.tmp")
    save_safetensors({"ids": ids.astype(np.uint16), "offsets": offsets,
                      "prompt_lens": np.asarray(prompt_lens, np.int32)},
                     tmp, metadata={"sources": json.dumps(sources), "items": json.dumps(item_ids)}, mode_of=path)
    tmp.replace(path)


def read_token_shard(path: Path) -> tuple[list[list[int]], list[int], list[str]]:
    """(sequences, prompt lengths, sources) of a token shard written by :func:`write_token_shard`."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    t = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    off = t["offsets"]
    seqs = [t["ids"][off[i]:off[i + 1]].astype(np.int64).tolist() for i in range(len(off) - 1)]
    return seqs, t["prompt_lens"].tolist(), json.loads(meta["sources"])


def token_shard_files(corpus: Path) -> list[Path]:
    """The token shards of a corpus folder (``shard_*.safetensors``), in order."""
    return sorted(Path(corpus).glob("shard_*.safetensors"))
