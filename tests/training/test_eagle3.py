"""EAGLE-3 training-time-test layout (training/eagle3.py): mask, label alignment, equivalence with chain drafting."""
from __future__ import annotations


import pytest
import torch

from runtime.models.eagle3 import Eagle3Config, Eagle3Drafter
from training.eagle3 import ttt_forward, ttt_loss, ttt_mask, ttt_targets, vocab_buffers
from training.metrics import chain_accept


def test_mask_hand_example():
    t, f = True, False
    assert ttt_mask(3, 0).tolist() == [[t, f, f], [t, t, f], [t, t, t]]
    assert ttt_mask(3, 1).tolist() == [[t, f, f, t, f, f], [t, t, f, f, t, f], [t, t, t, f, f, t]]


def test_mask_keys_exact():
    length = 7
    for step in range(4):
        m = ttt_mask(length, step)
        assert m.shape == (length, (step + 1) * length)
        for q in range(length):
            want = {k for k in range(q + 1)} | {b * length + q for b in range(1, step + 1)}
            assert set(torch.nonzero(m[q]).flatten().tolist()) == want
            assert int(m[q].sum()) == q + 1 + step  # N of a chain query at depth `step`


def test_label_alignment():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    labels = torch.tensor([21, 22, 23, 24, 25, 26])  # labels[p] = target's prediction of token p + 1
    tokens, targets = ttt_targets(ids, labels, 3)
    assert tokens.shape == targets.shape == (3, 5)
    # step 0: index t holds token t + 1, predicts labels[t + 1] (the token after t + 1)
    assert tokens[0].tolist() == [11, 12, 13, 14, 15]
    assert targets[0].tolist() == [22, 23, 24, 25, 26]
    # step i: input = previous step's target labels[t + i], predicts labels[t + i + 1]; past the end: ignored
    assert tokens[1].tolist() == [22, 23, 24, 25, 26]
    assert targets[1].tolist() == [23, 24, 25, 26, -100]
    assert tokens[2].tolist() == [23, 24, 25, 26, 0]
    assert targets[2].tolist() == [24, 25, 26, -100, -100]
    # the input token of step i is the target of step i - 1 wherever both exist
    assert torch.equal(tokens[1:][targets[:-1] >= 0], targets[:-1][targets[:-1] >= 0])


def test_vocab_buffers():
    ids = torch.tensor([2, 5, 9])
    d2t, t2d, lookup = vocab_buffers(ids, 12)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 9]
    assert torch.nonzero(t2d).flatten().tolist() == [2, 5, 9]
    assert lookup[[2, 5, 9, 3]].tolist() == [0, 1, 2, -100]


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       vocab_size=40, draft_vocab_size=16, target_hidden_size=32, aux_layer_ids=[1, 2, 3],
                       rope_theta=10000.0)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return d.eval(), torch.randn(40, 32)


@torch.no_grad()
@pytest.mark.parametrize("advance", [False, True])
def test_ttt_equals_chain_drafting(advance):
    """Step i at index t == a context pass over 0..t then i chain steps via forward(), with position ids held at t
    (training layout) or advanced to t + i (inference layout, advance=True)."""
    d, embed = _tiny()
    n, steps = 9, 3
    ids = torch.randint(0, 40, (n,))
    labels = torch.randint(0, 40, (n,))
    taps = torch.randn(n, 96)
    tokens, _ = ttt_targets(ids, labels, steps)
    logits = ttt_forward(d, taps, tokens, embed, advance)
    length = n - 1
    for t in range(length):
        pos = torch.arange(t + 1)[None]
        lg, out, kv = d(tokens[0, :t + 1][None], d.project(taps[None, :t + 1]), pos, torch.ones(1, t + 1).long(),
                        embed_weight=embed)
        torch.testing.assert_close(lg[0, t], logits[0][t])
        h = out[:, t:t + 1]
        for i in range(1, steps):
            past = kv[0].shape[2]
            lg, out, kv = d(tokens[i, t:t + 1][None], h, torch.tensor([[t + i if advance else t]]), torch.ones(1, past + 1).long(),
                            past_kv=kv, embed_weight=embed)
            torch.testing.assert_close(lg[0, 0], logits[i][t], rtol=1e-4, atol=1e-4)
            h = out


def test_loss_ignores_out_of_vocab_and_accept_len():
    d, embed = _tiny(1)
    draft_ids = torch.arange(0, 32, 2)  # 16 even target ids
    d.d2t.copy_(draft_ids - torch.arange(16))
    lookup = vocab_buffers(draft_ids, 40)[2]
    rec = {"ids": torch.randint(0, 40, (12,)), "labels": torch.randint(0, 20, (12,)) * 2 + 1,  # all odd: no label
           "taps": torch.randn(12, 96)}
    loss, correct, valid = ttt_loss(d, rec, 3, embed, lookup)
    assert float(loss) == 0.0 and not correct.any()  # every label outside the draft vocabulary is ignored
    assert valid.sum(1).tolist() == [11, 10, 9]
    rec["labels"] = torch.randint(0, 16, (12,)) * 2
    loss, correct, valid = ttt_loss(d, rec, 3, embed, lookup)
    assert loss.item() > 0
    c = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    v = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    assert chain_accept(c, v).tolist() == [3, 2, 1]  # last anchor dropped: its step 2 has no label


def test_init_from_an_earlier_checkpoint_keeps_its_weights_under_a_new_draft_vocabulary(tmp_path):
    """--init-from: fc / midlayer / norm carried over, LM-head rows of tokens in both vocabularies carried over,
    rows new to the vocabulary at zero; the result saves and loads strictly."""
    from types import SimpleNamespace

    from runtime.models.eagle3 import load_eagle3, save_eagle3
    from training.eagle3 import init_drafter, make_config

    tc = SimpleNamespace(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, max_position_embeddings=256, vocab_size=40)
    target = SimpleNamespace(config=tc, model=SimpleNamespace(embed_tokens=torch.nn.Embedding(40, 32)))
    torch.manual_seed(0)
    old_ids = torch.arange(0, 32, 2)  # 16 even ids
    old = Eagle3Drafter(make_config(tc, 16))
    d2t, t2d, _ = vocab_buffers(old_ids, 40)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p))
        old.d2t.copy_(d2t)
        old.t2d.copy_(t2d)
    save_eagle3(old, tmp_path / "old", old.config.to_dict(), metadata={"format": "pt"})
    old = load_eagle3(tmp_path / "old")  # bf16 round trip: compare against what was stored
    new_ids = torch.arange(8, 24)  # 8..23: the even ones were in the old vocabulary
    d = init_drafter(tmp_path / "old", target, new_ids)
    assert torch.equal(d.draft_to_target, new_ids)
    for k, v in old.state_dict().items():
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(d.state_dict()[k], v), k
    for row, tid in enumerate(new_ids.tolist()):
        want = old.lm_head.weight[tid // 2] if tid % 2 == 0 else torch.zeros(32)
        assert torch.equal(d.lm_head.weight[row], want), tid
    save_eagle3(d, tmp_path / "new", d.config.to_dict(), metadata={"format": "pt"})
    assert torch.equal(load_eagle3(tmp_path / "new").draft_to_target, new_ids)
