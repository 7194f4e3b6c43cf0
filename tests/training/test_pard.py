"""PARD training layout (training/pard.py): mask, COD nesting, label alignment, equivalence with inference."""
from __future__ import annotations

import random

import torch

from training.metrics import accept_len
from training.pard import K, PardTrainingModel, cod_depths, pard_forward, pard_layout, slot_table


def _rows(lay):
    return [(int(p), int(a), int(c)) for p, a, c in zip(lay["pos"], lay["anchor"], lay["copy"])]


def test_mask_keys_exact():
    length = 6
    depth = torch.tensor([3, 0, 2, 1, 3, 0])
    lay = pard_layout(length, depth)
    rows = _rows(lay)
    index = {r: i for i, r in enumerate(rows)}
    # real copy first, in order; mask rows only where depth allows and a + c <= length - 1
    assert rows[:length] == [(p, p, 0) for p in range(length)]
    expected_mask_rows = {(a + c, a, c) for a in range(length) for c in range(1, depth[a] + 1) if a + c < length}
    assert set(rows[length:]) == expected_mask_rows and len(rows) == length + len(expected_mask_rows)
    for i, (p, a, c) in enumerate(rows):
        seen = set(torch.nonzero(lay["allowed"][i]).flatten().tolist())
        want = {index[(q, q, 0)] for q in range(0, p - c + 1)} | {index[(a + j, a, j)] for j in range(1, c + 1)}
        assert seen == want, (p, a, c)
        assert len(seen) == p + 1  # exactly the p+1 keys of the inference layout
        # the mask chain sits at contiguous positions p-c+1..p
        assert sorted(rows[j][0] for j in seen) == list(range(p + 1))


def test_hand_example():
    lay = pard_layout(3, torch.tensor([2, 1, 0]))
    assert _rows(lay) == [(0, 0, 0), (1, 1, 0), (2, 2, 0), (1, 0, 1), (2, 1, 1), (2, 0, 2)]
    assert lay["allowed"][5].tolist() == [True, False, False, True, False, True]
    assert lay["allowed"][4].tolist() == [True, True, False, False, True, False]


def test_cod_nested_and_ratios():
    depth = cod_depths(20000, random.Random(0))
    assert depth.min() >= 0 and depth.max() == K - 1
    for c in range(1, K):
        keep = (depth >= c).float().mean().item()
        assert abs(keep - max(0.7 ** c, 0.2)) < 0.015, (c, keep)


def _tiny():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=64, vocab_size=50, max_position_embeddings=64,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)
    torch.manual_seed(0)
    d = PardTrainingModel(cfg)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    table = torch.randn(50, 32)
    return d.eval(), table


def test_training_rows_equal_inference_forward_and_labels():
    """Row (copy c, position p) of the dense training forward == row p of a plain causal forward over
    [ids[0..p-c], pard_token x c], and is scored against the label at p (prediction of token p+1)."""
    d, table = _tiny()
    length = 9
    ids = torch.randint(0, 50, (length,))
    labels = torch.randint(0, 50, (length,))
    depth = torch.tensor([7, 3, 0, 5, 1, 2, 7, 7, 7])
    with torch.no_grad():
        out = pard_forward(d, ids, labels, depth, table, table)
        lay = pard_layout(length, depth)
        row_ids = torch.where(lay["copy"] == 0, ids[lay["pos"]], torch.full_like(lay["pos"], d.pard_token))
        h = d(row_ids[None], lay["pos"][None], lay["allowed"], table)[0]
        for i, (p, a, c) in enumerate(_rows(lay)):
            seq = torch.cat([ids[:a + 1], torch.full((c,), d.pard_token)])
            ref = d(seq[None], torch.arange(p + 1)[None], None, table)[0, -1]
            torch.testing.assert_close(h[i], ref, atol=1e-5, rtol=1e-5)
            # label alignment: row at position p is scored against labels[p]
            logits = ref @ table.T
            ce = torch.nn.functional.cross_entropy(logits[None], labels[p:p + 1])
            torch.testing.assert_close(out["ce"][i], ce, atol=1e-4, rtol=1e-4)
            assert bool(out["correct"][i]) == (int(logits.argmax()) == int(labels[p]))


def test_slot_table_and_accept_len():
    d, table = _tiny()
    ids = torch.randint(0, 50, (12,))
    depth = torch.zeros(12, dtype=torch.long)
    depth[[0, 3]] = K - 1
    with torch.no_grad():
        out = pard_forward(d, ids, ids, depth, table, table)
    correct, valid = slot_table(out, torch.tensor([0, 3]))
    assert valid.all()
    # draft j+1 of anchor a is the row (position a+j, copy j)
    rows = _rows(out)
    for r, a in enumerate([0, 3]):
        for j in range(K):
            i = rows.index((a + j, a, j))
            assert bool(correct[r, j]) == bool(out["correct"][i])
    assert accept_len(torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)).tolist() == [3, 1, 5]


def test_token_corpus_sequences_train_on_the_continuation_only(tmp_path):
    """--corpus: ids = the sequence but its last token, label at p = token p + 1 on the target's continuation
    (positions before the prompt's last token are -100), cut to the last --max-len tokens; the cache is keyed by
    the shards and max_len."""
    from training.pard import load_sequences
    from training.shards import write_token_shard

    seqs = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(50)]  # 50 sequences of 40 ids
    write_token_shard(tmp_path / "shard_00000.safetensors", seqs, [25] * 50, ["test"] * 50, list(range(50)))
    train, val = load_sequences(tmp_path / "work", tmp_path, val_every=3, corpus=tmp_path, max_len=30)
    assert len(train) + len(val) == 50 and val
    for r in train + val:
        ids, labels = r["ids"].tolist(), r["labels"].tolist()
        first = ids[0] - 9  # the sequence's first id (the first 9 were cut: 39 ids kept as 30)
        assert len(ids) == 30 and ids == list(range(first + 9, first + 39))
        for p, (t, lab) in enumerate(zip(ids, labels)):
            absolute = t - first  # position in the uncut sequence
            assert lab == (t + 1 if absolute >= 24 else -100)  # the prompt's last token predicts token 25
    again, _ = load_sequences(tmp_path / "work", tmp_path, val_every=3, corpus=tmp_path, max_len=30)
    assert [r["ids"].tolist() for r in again] == [r["ids"].tolist() for r in train]
    longer, _ = load_sequences(tmp_path / "work", tmp_path, val_every=3, corpus=tmp_path, max_len=64)
    assert max(r["ids"].numel() for r in longer) == 39  # max_len changed: rebuilt, not the cached cut
