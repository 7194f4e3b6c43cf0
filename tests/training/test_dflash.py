"""DFlash training layout (training/dflash.py; its command line scripts/train_dflash.py): dense mask, equivalence of the batched training forward with
the inference draft step, and the draft-vocabulary loss."""
from __future__ import annotations


import pytest
import torch

from runtime.models.dflash import DFlashConfig, DFlashDrafter
from training.dflash import (BLOCK, P1_EDGES, block_hidden, block_loss, confidence_counts, dense_mask,
                             greedy_chain_mask, soft_ce)
from training.metrics import accept_len

VOCAB, HIDDEN, SEQ = 97, 32, 40


def _drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, vocab_size=VOCAB, block_size=BLOCK, mask_token_id=VOCAB,
                       target_layer_ids=[0, 1, 2], num_target_layers=4, rope_theta=10000.0,
                       max_position_embeddings=256)
    d = DFlashDrafter(cfg).eval()
    with torch.no_grad():  # random, non-degenerate weights everywhere (norms included)
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return d


def _record(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g, dtype=torch.int32)
    return {"ids": ids, "taps": torch.randn(SEQ, 3 * HIDDEN, generator=g).to(torch.bfloat16),
            "labels": torch.randint(0, VOCAB, (SEQ,), generator=g, dtype=torch.int32)}


def test_dense_mask_hand_example():
    m = dense_mask(torch.tensor([3]), seq_len=4, block=2)
    assert m.tolist() == [[True, True, True, False, True, True]] * 2
    m = dense_mask(torch.tensor([1, 2]), seq_len=3, block=2)
    assert m.tolist() == [[True, False, False, True, True, False, False],
                          [True, False, False, True, True, False, False],
                          [True, True, False, False, False, True, True],
                          [True, True, False, False, False, True, True]]


def test_training_forward_equals_inference_draft_step():
    d, rec = _drafter(), _record()
    embed = torch.randn(VOCAB, HIDDEN)
    anchors = torch.tensor([1, 7, 20, 33])
    with torch.no_grad():
        batched = block_hidden(d, rec, anchors, embed)  # [A, B, hidden]
        for i, a in enumerate(anchors.tolist()):
            block = torch.full((1, BLOCK), VOCAB)
            block[0, 0] = int(rec["ids"][a])
            # context split in two steps, as the runtime does (cache, then new verified rows)
            split = a // 2
            taps = rec["taps"].float()[None]
            _, kv = d(d.embed_block(block, embed), taps[:, :split],
                      torch.arange(split + BLOCK)[None] + torch.tensor([0] * split + [a - split] * BLOCK))
            h, _ = d(d.embed_block(block, embed), taps[:, split:a], torch.arange(split, a + BLOCK)[None],
                     past_kv=kv)
            torch.testing.assert_close(batched[i], h[0], rtol=1e-4, atol=1e-4)


def test_sliding_window_training_forward_equals_inference_draft_step():
    """With a sliding layer (window 6 < the anchors' contexts) the batched training masks equal the runtime's."""
    d, rec = _drafter(), _record()
    d.config.layer_windows = [6, None]
    embed = torch.randn(VOCAB, HIDDEN)
    anchors = torch.tensor([2, 9, 21, 30])
    with torch.no_grad():
        batched = block_hidden(d, rec, anchors, embed)
        full = block_hidden(_drafter(), rec, anchors, embed)
        assert not torch.allclose(batched, full)  # the window hides context the full layer sees
        for i, a in enumerate(anchors.tolist()):
            block = torch.full((1, BLOCK), VOCAB)
            block[0, 0] = int(rec["ids"][a])
            h, _ = d(d.embed_block(block, embed), rec["taps"].float()[None, :a], torch.arange(a + BLOCK)[None])
            torch.testing.assert_close(batched[i], h[0], rtol=1e-4, atol=1e-4)


def test_draft_vocab_loss():
    d, rec = _drafter(), _record()
    embed = torch.randn(VOCAB, HIDDEN)
    lm_head = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    anchors = torch.tensor([2, 9, 30])
    with torch.no_grad():
        full, correct_full, valid = block_loss(d, rec, anchors, embed, lm_head, slot_decay=2.0)
        # a draft vocabulary that is the whole vocabulary in another order: the same loss and correctness
        perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
        label_map = torch.empty(VOCAB, dtype=torch.long)
        label_map[perm] = torch.arange(VOCAB)
        same, correct_same, _ = block_loss(d, rec, anchors, embed, lm_head[perm], label_map, slot_decay=2.0)
        torch.testing.assert_close(same, full)
        assert torch.equal(correct_same, correct_full)
        # labels outside the draft vocabulary count as wrong and carry no loss
        labels = rec["labels"].long()
        tgt = labels[(anchors[:, None] + torch.arange(1, BLOCK) - 1).clamp(max=SEQ - 1)]
        dropped = int(tgt[0, 0])
        keep = torch.tensor([t for t in range(VOCAB) if t != dropped])
        part_map = torch.full((VOCAB,), -1, dtype=torch.long)
        part_map[keep] = torch.arange(keep.numel())
        part, correct_part, _ = block_loss(d, rec, anchors, embed, lm_head[keep], part_map, slot_decay=2.0)
        assert torch.isfinite(part)
        assert not correct_part[tgt == dropped].any()
        assert torch.equal(correct_part[tgt != dropped], correct_full[tgt != dropped] & valid[tgt != dropped])
    # no label in the draft vocabulary: zero loss, zero gradient (no NaN)
    none_map = torch.full((VOCAB,), -1, dtype=torch.long)
    loss, correct, _ = block_loss(d, rec, anchors, embed, lm_head[:5], none_map)
    loss.backward()
    assert loss.item() == 0.0 and not correct.any()
    assert all(p.grad is None or not p.grad.any() for p in d.parameters())


def test_greedy_chain_mask_hand_example_and_brute_force():
    m = greedy_chain_mask(torch.tensor([5, 6, 7, 8]), torch.tensor([6, 9, 8, 0]), torch.tensor([0, 1, 2]))
    assert m[:, :3].tolist() == [[True, True, False], [True, False, False], [True, True, False]]
    assert not m[:, 3:].any()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 3, (SEQ,), generator=g)
    labels = torch.cat([ids[1:], torch.zeros(1, dtype=torch.long)])
    flip = torch.rand(SEQ, generator=g) < 0.3
    labels[flip] = (labels[flip] + 1) % 3  # 30% of positions leave the greedy chain
    anchors = torch.arange(1, SEQ - 1)
    m = greedy_chain_mask(ids, labels, anchors)
    for i, a in enumerate(anchors.tolist()):
        for j in range(1, BLOCK):
            want = all(q + 1 < SEQ and int(ids[q + 1]) == int(labels[q]) for q in range(a, a + j - 1))
            assert bool(m[i, j - 1]) == want, (a, j)


def test_chain_mask_drops_only_the_slots_off_the_greedy_chain():
    d, rec = _drafter(), _record()
    embed = torch.randn(VOCAB, HIDDEN)
    lm_head = torch.randn(VOCAB, HIDDEN)
    anchors = torch.tensor([2, 9, 30])
    with torch.no_grad():
        _, correct, valid = block_loss(d, rec, anchors, embed, lm_head, slot_decay=2.0)
        _, correct_m, valid_m = block_loss(d, rec, anchors, embed, lm_head, slot_decay=2.0, chain_mask=True)
        chain = greedy_chain_mask(rec["ids"], rec["labels"], anchors)
        assert torch.equal(valid_m, valid & chain) and valid_m[:, 0].all() and not valid_m.all()
        assert torch.equal(correct_m, correct & chain)
        # a record whose ids are the target's greedy chain: the mask changes nothing
        greedy = dict(rec, ids=torch.cat([rec["ids"][:1], rec["labels"][:-1]]))
        plain = block_loss(d, greedy, anchors, embed, lm_head, slot_decay=2.0)
        masked = block_loss(d, greedy, anchors, embed, lm_head, slot_decay=2.0, chain_mask=True)
        torch.testing.assert_close(plain[0], masked[0])
        assert torch.equal(plain[2], masked[2])


@pytest.mark.parametrize("row,expected", [([1, 1, 0, 1], 3), ([0, 1, 1, 1], 1), ([1, 1, 1, 1], 5)])
def test_accept_len(row, expected):
    assert accept_len(torch.tensor([row], dtype=torch.bool)).item() == expected


def test_distill_prompts_long_and_default():
    import random

    from training.dflash import distill_prompts

    windows = [list(range(i * 1000, i * 1000 + 900)) for i in range(5)]
    chat = [[-7] * 2000, [-8] * 30]
    for seed in range(5):
        long = distill_prompts(random.Random(seed), windows, chat, max_len=700, long_prompts=True)
        assert len(long) == 16 and len({len(p) for p in long}) == 1  # one length per batch: no padding
        assert 64 <= len(long[0]) <= 700
        for p in long:  # contiguous slices of one window
            assert p == list(range(p[0], p[0] + len(p))) and p[0] // 1000 == p[-1] // 1000
        short = distill_prompts(random.Random(seed), windows, chat, max_len=700, long_prompts=False)
        assert all(len(p) <= 692 if p[0] < 0 else 64 <= len(p) < 256 for p in short)
    kinds = {p[0] < 0 for s in range(8) for p in distill_prompts(random.Random(s), windows, chat, 700, False)}
    assert kinds == {True, False}  # both chat prompts and document slices


def test_training_profile_sets_ref_keys_to_training_length():
    from training.dflash import training_profile

    prof = training_profile({"ref_keys": 512, "top_k": 16, "slope": 3.0, "cap": 1.5, "enabled": True}, 1280)
    assert prof == {"ref_keys": 1280, "top_k": 16, "slope": 3.0, "cap": 1.5, "enabled": True}
    fresh = training_profile(None, 640)
    assert fresh["ref_keys"] == 640 and fresh["slope"] == 5.0 and fresh["top_k"] == 32


def test_save_best_keeps_extra_config_and_previous_log(tmp_path):
    """`save --best` writes ckpt_best.pt (not the latest ckpt.pt) in the public layout, keeps the config's extra
    fields (the verify default) and nests the init folder's training_log.json under previous_run."""
    import json

    from click.testing import CliRunner

    from runtime.models.dflash import load_dflash
    from scripts.train_dflash import cli

    init = tmp_path / "shipped"
    init.mkdir()
    (init / "training_log.json").write_text(json.dumps({"step": 7, "log": [{"step": 7}]}))
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    best, latest = _drafter(), _drafter()
    with torch.no_grad():
        for p in latest.parameters():
            p.add_(1.0)
    best.config.extra["sharpdraft_verify_draft_tokens"] = 2
    best.config.query_scale = {"ref_keys": 1280, "top_k": 32, "slope": 5.0, "cap": 1.6, "enabled": True}
    state = {"step": 40, "seconds": 1.0, "log": [{"step": 40}], "init_from": str(init), "calls": []}
    for name, d in (("ckpt_best.pt", best), ("ckpt.pt", latest)):
        torch.save({"model": d.state_dict(), "opt": {}, "state": state, "config": best.config.to_dict()},
                   work / name)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["save", "--work", str(work), "--out", str(out), "--best"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sharpdraft_verify_draft_tokens"] == 2 and cfg["sharpdraft_query_scale"]["ref_keys"] == 1280
    log = json.loads((out / "training_log.json").read_text())
    assert log["previous_run"] == {"step": 7, "log": [{"step": 7}]} and log["step"] == 40
    saved = load_dflash(out)
    for k, v in best.state_dict().items():  # bf16 on disk
        torch.testing.assert_close(saved.state_dict()[k], v.to(torch.bfloat16).float())


def test_sample_anchors_from_the_generated_part():
    import random

    from training.dflash import sample_anchors

    rec = {"ids": torch.zeros(100, dtype=torch.int32), "prompt_len": 70}
    rng = random.Random(0)
    a = sample_anchors(rng, rec, 40, gen_frac=0.5)
    assert a.numel() == 40 and a.unique().numel() == 40 and a.min() >= 1 and a.max() <= 98
    assert (a >= 70).sum() >= 20  # half from 70 .. 98, the rest anywhere
    g = sample_anchors(rng, rec, 40, generated_only=True)
    assert g.tolist() == list(range(70, 99))  # only 29 generated anchors exist
    assert sample_anchors(rng, {"ids": rec["ids"]}, 16, generated_only=True) is None
    u = sample_anchors(rng, {"ids": rec["ids"]}, 16, gen_frac=1.0)  # no prompt_len: uniform
    assert u.numel() == 16 and u.min() >= 1
    short = sample_anchors(rng, {"ids": torch.zeros(5, dtype=torch.int32), "prompt_len": 2}, 32, gen_frac=1.0)
    assert short.tolist() == [1, 2, 3]


@pytest.mark.slow
def test_resumed_run_keeps_the_checkpoint_config(tmp_path):
    """A second `train` call on a run that began with --init-from rebuilds the drafter from the checkpoint's own
    config, so the init folder's extra fields (the verify default) survive into `save`."""
    import json

    from click.testing import CliRunner

    from scripts.train_dflash import cli

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=576, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, intermediate_size=128, vocab_size=49152, block_size=BLOCK, mask_token_id=49152,
                       target_layer_ids=[1, 14, 27], num_target_layers=30, rope_theta=100000.0,
                       max_position_embeddings=2048)
    d = DFlashDrafter(cfg)
    d.config.extra["sharpdraft_verify_draft_tokens"] = 3
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    recs = [{"ids": torch.randint(0, 49152, (30,), generator=g, dtype=torch.int32),
             "taps": torch.randn(30, 1728, generator=g).to(torch.bfloat16),
             "labels": torch.randint(0, 49152, (30,), generator=g, dtype=torch.int32)} for _ in range(80)]
    torch.save({"kind": "text", "seq_len": 30, "records": recs}, work / "data" / "shard_00000.pt")
    opt = torch.optim.AdamW(d.parameters())
    torch.save({"model": d.state_dict(), "opt": opt.state_dict(), "config": d.config.to_dict(),
                "state": {"step": 5, "seconds": 1.0, "log": [], "calls": []}}, work / "ckpt.pt")
    res = CliRunner().invoke(cli, ["train", "--work", str(work), "--minutes", "0.01", "--save-every", "1",
                                   "--anchors", "4", "--seqs-per-step", "1"])
    assert res.exit_code == 0, res.output
    ck = torch.load(work / "ckpt.pt")
    assert ck["state"]["step"] > 5 and ck["config"]["sharpdraft_verify_draft_tokens"] == 3
    assert ck["config"]["num_hidden_layers"] == 1  # not rebuilt as a fresh 2-layer drafter
    res = CliRunner().invoke(cli, ["save", "--work", str(work), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sharpdraft_verify_draft_tokens"] == 3


def test_grown_drafter_drafts_as_before_until_trained():
    """--layers N with --init-from: appended layers start as the identity (zeroed o_proj / down_proj)."""
    import copy
    from types import SimpleNamespace

    from training.dflash import grow_drafter

    d = _drafter()
    # the new layers copy the target's last decoder layer; a drafter layer has the same projections and norms
    target = SimpleNamespace(model=SimpleNamespace(layers=[copy.deepcopy(d.layers[1])]))
    g = grow_drafter(d, target, 3).eval()
    assert g.config.num_hidden_layers == 3 and len(g.layers) == 3 and d.config.num_hidden_layers == 2
    torch.testing.assert_close(g.layers[2].self_attn.q_proj.weight, d.layers[1].self_attn.q_proj.weight)
    assert not g.layers[2].self_attn.o_proj.weight.any() and not g.layers[2].mlp.down_proj.weight.any()
    rec = _record()
    ids, taps = rec["ids"].long()[None], rec["taps"].float()[None]
    blk = torch.full((1, BLOCK), VOCAB)
    blk[0, 0] = ids[0, 10]
    pos = torch.arange(0, 10 + BLOCK)[None]
    with torch.no_grad():
        emb = torch.randn(VOCAB + 1, HIDDEN)
        a, _ = d(d.embed_block(blk, emb), taps[:, :10], pos)
        b, _ = g(g.embed_block(blk, emb), taps[:, :10], pos)
    torch.testing.assert_close(a, b)


def test_walk_rounds_replays_the_loop_and_equals_a_real_greedy_loop(monkeypatch):
    """walk_rounds' rounds are those of a greedy draft-verify loop over the same text: checked against a loop
    that drafts each round with the inference draft step (DFlashDrafter.forward, features of positions < anchor)
    and accepts the leading run of drafts equal to the target's labels. fp32 throughout (no bf16 autocast), so
    both sides take the same argmax on any CPU."""
    import random

    monkeypatch.setenv("SHARPDRAFT_TRAIN_AUTOCAST", "off")

    from training.dflash import sample_anchors, walk_rounds

    d, rec = _drafter(), _record(4)
    g = torch.Generator().manual_seed(2)
    embed, head = torch.randn(VOCAB + 1, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g)
    # labels = the drafter's own greedy drafts at a few anchors, so some rounds accept several tokens
    rec["labels"] = rec["labels"].clone()
    for a in (6, 15, 22):
        blk = torch.full((1, BLOCK), VOCAB)
        blk[0, 0] = rec["ids"][a]
        h, _ = d(d.embed_block(blk, embed), rec["taps"][None, :a].float(), torch.arange(a + BLOCK)[None])
        drafts = (h[0, 1:] @ head.T).argmax(-1)
        rec["labels"][a: a + 4] = drafts[:4].to(torch.int32)
    anchors, accepted = walk_rounds(d, rec, embed, head, None, 5, 30, chunk=7)
    expect_a, expect_l, a = [], [], 5
    while a < 35:
        blk = torch.full((1, BLOCK), VOCAB)
        blk[0, 0] = rec["ids"][a]
        h, _ = d(d.embed_block(blk, embed), rec["taps"][None, :a].float(), torch.arange(a + BLOCK)[None])
        drafts = (h[0, 1:] @ head.T).argmax(-1).tolist()
        run = 0
        while run < BLOCK - 1 and a + run < SEQ and drafts[run] == int(rec["labels"][a + run]):
            run += 1
        expect_a.append(a)
        expect_l.append(min(1 + run, 35 - a))
        a += 1 + run
    assert anchors == expect_a and accepted == expect_l
    assert max(accepted) >= 3 and len(anchors) < 30  # the walk skips over accepted runs
    picked = sample_anchors(random.Random(0), {"ids": rec["ids"], "prompt_len": 5}, 20, 0.5, must=anchors[:6])
    assert set(anchors[:6]) <= set(picked.tolist()) and picked.numel() == 20


def test_tables_from_a_folder_that_is_not_an_engine_is_a_usage_error(tmp_path):
    import click

    from training.dflash import engine_tables

    with pytest.raises(click.UsageError, match="--tables-from"):
        engine_tables(tmp_path, torch.Size([VOCAB, HIDDEN]))


def _with_top(rec: dict, k: int, seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(SEQ, VOCAB, generator=g) * 3
    v, i = logits.topk(k, -1)
    return {**rec, "labels": i[:, 0].to(torch.int32), "top_logits": v.to(torch.float16), "top_ids": i.to(torch.int32)}


def test_soft_targets_against_a_hand_computation():
    d, rec = _drafter(), _with_top(_record(), k=VOCAB)
    embed, lm_head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    anchors = torch.tensor([2, 9, 30])
    with torch.no_grad():
        hard, correct, valid = block_loss(d, rec, anchors, embed, lm_head, slot_decay=2.0)
        assert torch.equal(block_loss(d, rec, anchors, embed, lm_head, slot_decay=2.0, kd=0.0)[0], hard)
        soft, correct_s, _ = block_loss(d, rec, anchors, embed, lm_head, slot_decay=2.0, kd=1.0, kd_temp=2.0)
        assert torch.equal(correct, correct_s)  # correctness stays the argmax label's
        # the whole vocabulary kept: soft CE = KL(p || q) + H(p) with p the target's full softmax at temperature 2
        h = block_hidden(d, rec, anchors, embed)[:, 1:]
        logits = h @ lm_head.T
        pos = (anchors[:, None] + torch.arange(1, BLOCK) - 1).clamp(max=SEQ - 1)
        full = torch.zeros(SEQ, VOCAB).scatter(-1, rec["top_ids"].long(), rec["top_logits"].float())
        p = torch.softmax(full[pos] / 2.0, -1)
        ref = -(p * torch.log_softmax(logits / 2.0, -1)).sum(-1)
        torch.testing.assert_close(soft_ce(logits, rec, pos, None, 2.0), ref, rtol=1e-4, atol=1e-4)
        w = torch.exp(-(torch.arange(1, BLOCK).float() - 1) / 2.0)[None].expand_as(ref) * valid
        torch.testing.assert_close(soft, (4.0 * ref * w).sum() / w.sum(), rtol=1e-4, atol=1e-4)
    # without stored top logits the term is skipped (older feature shards train as before)
    plain = {k: v for k, v in rec.items() if not k.startswith("top_")}
    with torch.no_grad():
        torch.testing.assert_close(block_loss(d, plain, anchors, embed, lm_head, slot_decay=2.0, kd=1.0)[0], hard)


def test_soft_targets_renormalise_over_the_draft_vocabulary():
    rec = _with_top(_record(), k=6)
    pos = torch.tensor([[0, 1], [2, 3]])
    keep = rec["top_ids"][0, [0, 2, 3]].long()  # a draft vocabulary holding 3 of position 0's top 6 (not #2, #5, #6)
    label_map = torch.full((VOCAB,), -1, dtype=torch.long)
    label_map[keep] = torch.arange(3)
    logits = torch.randn(2, 2, 3, requires_grad=True)
    out = soft_ce(logits, rec, pos, label_map, 1.0)
    p = torch.softmax(rec["top_logits"][0, [0, 2, 3]].float(), -1)
    torch.testing.assert_close(out[0, 0], -(p * torch.log_softmax(logits[0, 0], -1)).sum())
    # a slot none of whose top ids is in the draft vocabulary contributes 0 (and no NaN gradient)
    none_map = torch.full((VOCAB,), -1, dtype=torch.long)
    out = soft_ce(logits, rec, pos, none_map, 1.0)
    out.sum().backward()
    assert out.eq(0).all() and torch.isfinite(logits.grad).all()


def test_confidence_counts_buckets_slots_by_the_targets_top1_probability():
    rec = _with_top(_record(), k=4)
    # position 5: top-1 probability 0.95 (bucket 0.9-1.0); position 6: 0.4 (bucket 0.3-0.5); the rest 0.25
    rec["top_logits"] = torch.zeros(SEQ, 4, dtype=torch.float16)
    rec["top_logits"][5] = torch.tensor([0.0, -4.0, -4.0, -4.0]).log_softmax(-1).half()
    rec["top_logits"][5, 0] = torch.tensor(0.95).log().half()
    rec["top_logits"][5, 1:] = torch.tensor(0.05 / 3).log().half()
    rec["top_logits"][6] = torch.tensor([0.4, 0.2, 0.2, 0.2]).log().half()
    anchors = torch.tensor([5])  # slot j guesses the label at 5 + j - 1: positions 5 .. 5 + B - 2
    correct = torch.zeros(1, BLOCK - 1, dtype=torch.bool)
    correct[0, 0] = True  # the sure position was guessed, the others not
    valid = torch.ones_like(correct)
    valid[0, -1] = False
    out = confidence_counts(rec, anchors, correct, valid)
    assert out.shape == (BLOCK - 1, len(P1_EDGES) - 1, 2)
    assert out[0, -1].tolist() == [1.0, 1.0] and out[1, 1].tolist() == [1.0, 0.0]  # slot 1 at 5, slot 2 at 6
    assert out[2:-1, 0].tolist() == [[1.0, 0.0]] * (BLOCK - 4) and not out[-1].any()  # the invalid last slot
    assert out[..., 0].sum() == BLOCK - 2 and out[..., 1].sum() == 1


def test_draft_vocab_command_keeps_the_most_frequent_labels(tmp_path):
    """`draft-vocab` counts every record's labels over the shards (read through mmap) and writes the most frequent
    ids first, ties by lower id, never an id that no label holds."""
    import json

    from click.testing import CliRunner

    from scripts.train_dflash import cli

    (tmp_path / "data").mkdir()
    rec = lambda labels: {"ids": torch.tensor(labels), "labels": torch.tensor(labels), "prompt_len": 1}  # noqa: E731
    torch.save({"records": [rec([5, 5, 5, 9]), rec([7, 7])]}, tmp_path / "data" / "shard_00000.pt")
    torch.save({"records": [rec([9, 9, 3])]}, tmp_path / "data" / "shard_00001.pt")
    res = CliRunner().invoke(cli, ["draft-vocab", "--work", str(tmp_path), "--size", "3", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    vocab = json.loads((tmp_path / "draft_vocab.json").read_text())
    assert vocab["draft_ids"] == [5, 9, 7]  # 3 x 5, 3 x 9 (tie: lower id first), 2 x 7; 3 (once) left out
    assert vocab["coverage_of_counts"] == pytest.approx(8 / 9)
    out = tmp_path / "new" / "folder"  # made if missing
    res = CliRunner().invoke(cli, ["draft-vocab", "--work", str(tmp_path), "--size", "10", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "draft_vocab.json").read_text())["draft_ids"] == [5, 9, 7, 3]
