"""training/distill.py and its command line scripts/distill.py: token shards that last, training prompts disjoint
from evaluation, and continuous batched greedy decoding on the int4 builder graph that equals the runtime's own
target-only decoding."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.corpus import (HELDOUT_HUMANEVAL, HELDOUT_MODULES, HELDOUT_PLAYS, humaneval,
                             instruction_conversations, plays)
from training.distill import BatchDecoder
from training.shards import read_token_shard, write_token_shard

ROOT = Path(__file__).resolve().parents[2]


def test_token_shard_round_trip(tmp_path):
    seqs = [[1, 2, 3, 49151], [7] * 300, [0, 65535]]
    write_token_shard(tmp_path / "s.safetensors", seqs, [2, 100, 1], ["a", "b", "c"], [4, 5, 6])
    got, plens, sources = read_token_shard(tmp_path / "s.safetensors")
    assert got == seqs and plens == [2, 100, 1] and sources == ["a", "b", "c"]
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(ValueError, match="uint16"):
        write_token_shard(tmp_path / "t.safetensors", [[70000]], [1], ["x"], [0])


def test_instruction_prompts_come_from_training_sources_only():
    convs = instruction_conversations(0)
    assert convs == instruction_conversations(0) and len(convs) > 1500
    kinds = {c["source"].split(":")[0] for c in convs}
    assert kinds == {"pydoc", "stdlib", "humaneval", "play"}
    held_he = {r["task_id"] for r in humaneval("heldout")}
    assert len(held_he) == HELDOUT_HUMANEVAL
    for c in convs:
        src = c["source"]
        assert not any(src.startswith(f"play:{p}") for p in HELDOUT_PLAYS), src
        assert not any(src.startswith(f"stdlib:{m}") for m in HELDOUT_MODULES), src
        assert src.split(":", 1)[1] not in held_he, src
        assert 1 <= len(c["user"]) <= 2
    # no evaluation text leaks in: a distinctive line of each held-out play appears in no prompt
    text = "\n".join(m for c in convs for m in c["user"])
    for stem, play in plays("heldout").items():
        lines = [ln.strip() for ln in play.splitlines() if len(ln.strip()) > 60]
        assert lines and not any(ln in text for ln in lines[100:110]), stem
    assert sum(len(c["user"]) == 2 for c in convs) > 0.15 * len(convs)  # follow-up turns


def test_a_new_seed_asks_new_questions():
    """Seed 1 (the next corpus extension) repeats no first message of seed 0 and still covers every source kind;
    its HumanEval requests use new templates and forms of the task (signature + prose docstring)."""
    first = {c["user"][0] for c in instruction_conversations(0)}
    convs = instruction_conversations(1)
    assert convs == instruction_conversations(1) and len(convs) > 1500
    assert not first & {c["user"][0] for c in convs}
    assert {c["source"].split(":")[0] for c in convs} == {"pydoc", "stdlib", "humaneval", "play"}
    he = [c["user"][0] for c in convs if c["source"].startswith("humaneval:")]
    assert len(he) == 3 * len(humaneval("train"))
    assert any("```" not in m for m in he) and any("```" in m for m in he)
    with pytest.raises(ValueError, match="seed"):
        instruction_conversations(-1)


@pytest.mark.slow
def test_batched_greedy_equals_the_runtime_target_only(tiny_int4_engines, monkeypatch):
    monkeypatch.setenv("SHARPDRAFT_TARGET_MIN_Q", "1")  # the runtime's plain 1-token path, as distill decodes
    from runtime.engine import SpecEngine

    engine = SpecEngine.from_dir(tiny_int4_engines)
    prompts = [[5, 17, 300, 4000, 12, 9], [88] * 3 + [1000, 2000], list(range(200, 223))]
    dec = BatchDecoder(engine.target, slots=4, capacity=64, topk=8)  # one slot stays empty
    for s, p in enumerate(prompts):
        dec.prefill(s, {}, p)
    for _ in range(12):
        dec.step()
    for s, p in enumerate(prompts):
        row = dec.rows[s]
        assert row["ids"][: len(p)] == p and len(row["ids"]) == len(p) + 12 == len(row["labels"])
        assert torch.cat(row["taps"]).shape[0] == len(p) + 12
        top_v = torch.cat([t[0] for t in row["top"]])
        top_i = torch.cat([t[1] for t in row["top"]])
        assert top_v.shape == top_i.shape == (len(p) + 12, 8) and top_v.dtype == torch.float16
        assert top_i[:, 0].tolist() == row["labels"]  # the largest logit is the label, position by position
        assert (top_v[:, :-1] >= top_v[:, 1:]).all()
        ref = engine.generate_target_only(p, 13).token_ids
        assert row["labels"][len(p) - 1:] == ref, s


@pytest.mark.slow
def test_generate_then_features_recomputed_from_tokens(tiny_int4_engines, tmp_path):
    corpus, feats, again = tmp_path / "corpus", tmp_path / "f", tmp_path / "f2"
    run = [sys.executable, str(ROOT / "scripts" / "distill.py")]
    subprocess.run(run + ["generate", "--engine", str(tiny_int4_engines), "--corpus", str(corpus), "--features",
                          str(feats), "--minutes", "0.15", "--slots", "4", "--seq-len", "160", "--new-tokens", "12"],
                   check=True, cwd=ROOT)
    man = json.loads((corpus / "manifest.json").read_text())
    assert man["shards"] and all(s["target"]["precision"] == "int4" for s in man["shards"])
    done = {i for s in man["shards"] for i in s["items"]}
    subprocess.run(run + ["features", "--engine", str(tiny_int4_engines), "--corpus", str(corpus), "--features",
                          str(again)], check=True, cwd=ROOT)
    for s in man["shards"]:
        name = s["file"].split(".")[0]
        seqs, plens, _ = read_token_shard(corpus / s["file"])
        a = torch.load(feats / f"{name}.pt")["records"]
        b = torch.load(again / f"{name}.pt")["records"]
        assert len(a) == len(b) == len(seqs) == s["sequences"]
        for ra, rb, seq, pl in zip(a, b, seqs, plens):
            assert ra["ids"].tolist() == rb["ids"].tolist() == seq[:-1]
            assert ra["prompt_len"] == rb["prompt_len"] == pl
            assert ra["labels"][-1].item() == seq[-1]  # the last generated token is the last position's label
            assert ra["labels"][pl - 1:-1].tolist() == seq[pl:-1]  # generated tokens are the greedy labels
            assert ra["taps"].shape == rb["taps"].shape
            assert ra["top_ids"].shape == rb["top_ids"].shape == (len(seq) - 1, 32)
            assert ra["top_ids"][:, 0].tolist() == ra["labels"].tolist()
            assert rb["top_ids"][:, 0].tolist() == rb["labels"].tolist()
            scale = ra["taps"].float().abs().max()
            assert (ra["taps"].float() - rb["taps"].float()).abs().max() <= 0.05 * scale
            agree = (ra["labels"] == rb["labels"]).float().mean().item()
            assert agree >= 0.9, agree  # 1-token steps vs teacher-forced blocks on an int8-activation graph
    # a rerun skips the finished items and appends new shards
    subprocess.run(run + ["generate", "--engine", str(tiny_int4_engines), "--corpus", str(corpus), "--features",
                          str(feats), "--minutes", "0.05", "--slots", "4", "--seq-len", "160", "--new-tokens", "12"],
                   check=True, cwd=ROOT)
    man2 = json.loads((corpus / "manifest.json").read_text())
    new = [i for s in man2["shards"][len(man["shards"]):] for i in s["items"]]
    assert not set(new) & done
    assert np.all([(corpus / s["file"]).exists() for s in man2["shards"]])


def test_token_shard_overwrite_keeps_mode(tmp_path):
    """write_token_shard writes a temporary and renames it: a new shard follows the umask, a replaced one keeps its
    mode (safetensors >= 0.8 alone would leave 0600, safetensors#782)."""
    import os
    import stat

    p = tmp_path / "shard_00000.safetensors"
    old = os.umask(0o022)
    try:
        write_token_shard(p, [[1, 2, 3]], [1], ["play"], [0])
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o644
        os.chmod(p, 0o600)
        write_token_shard(p, [[4, 5]], [1], ["play"], [1])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert read_token_shard(p)[0] == [[4, 5]]
