"""training/shards.py: the shard formats and the one train / validation split every recipe reads them through."""
from __future__ import annotations

import zlib

import torch

from training import shards
from training.dflash import load_shards as dflash_split
from training.eagle3 import load_shards as eagle3_split
from training.pard import load_sequences as pard_split


def _write(data, n_shards=2, per_shard=120):
    g = torch.Generator().manual_seed(0)
    for s in range(n_shards):
        recs = []
        for i in range(per_shard):
            n = 4 + (i * 7 + s) % 27
            recs.append({"ids": torch.randint(0, 49152, (n,), generator=g, dtype=torch.int32),
                         "labels": torch.randint(0, 49152, (n,), generator=g, dtype=torch.int32),
                         "taps": torch.zeros(n, 3, dtype=torch.bfloat16)})
        shards.write_feature_shard(data / f"shard_{s:05d}.pt", "text", 30, recs)


def test_the_split_is_the_crc32_of_the_ids():
    ids = torch.arange(20, dtype=torch.int32)
    assert shards.is_validation(ids, 7) == (zlib.crc32(ids.numpy().tobytes()) % 7 == 0)
    recs = [{"ids": torch.arange(k, k + 12, dtype=torch.int32)} for k in range(200)]
    train, val = shards.split(recs, 10, min_len=12)
    assert len(train) + len(val) == 200 and val and all(shards.is_validation(r["ids"], 10) for r in val)
    assert shards.split(recs, 10, min_len=13) == ([], [])


def test_every_recipe_reads_the_same_split(tmp_path):
    """DFlash and PARD hold out the same sequences; EAGLE-3 (from 8 tokens on) the same ones plus shorter ones."""
    data = tmp_path / "dflash" / "data"
    data.mkdir(parents=True)
    _write(data)
    assert [f.name for f in shards.feature_shard_files(data)] == ["shard_00000.pt", "shard_00001.pt"]
    assert not list(data.glob(".*tmp"))  # written through a temp file, renamed
    ids = lambda recs: [tuple(r["ids"].tolist()) for r in recs]  # noqa: E731
    d_train, d_val = dflash_split(tmp_path / "dflash")
    p_train, p_val = pard_split(tmp_path / "pard", tmp_path / "dflash")
    e_train, e_val = eagle3_split(data)
    assert ids(d_val) == ids(p_val) and ids(d_train) == ids(p_train) and d_val
    assert min(r["ids"].numel() for r in d_train + d_val) == shards.MIN_TOKENS
    assert set(ids(d_val)) <= set(ids(e_val)) and set(ids(d_train)) <= set(ids(e_train))
    assert {len(x) for x in set(ids(e_val + e_train)) - set(ids(d_val + d_train))} <= set(range(8, shards.MIN_TOKENS))
