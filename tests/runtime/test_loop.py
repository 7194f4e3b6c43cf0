"""The speculative loop on scripted backends (fixed logits tables): issue 3's cases 1, 4, 5, 6 and the stop,
length and ragged-batch rules, with docs/design.md §5's invariants asserted after every round (check_invariants)."""
import numpy as np
import pytest

from runtime.engine import SpecEngine
from runtime.sampling import SamplingParams
from tests.runtime.scripted import (PaddedVocabDrafter, ScriptedDrafter, ScriptedTarget, one_hot_rows, oracle,
                                    saboteur)

EOS = 3


def chain_table(vocab: int, nxt: dict[int, int], default_shift: int = 1) -> np.ndarray:
    """Logits table whose argmax after token t is nxt.get(t, (t + default_shift) % vocab) (skipping EOS), margin 5."""
    table = np.zeros((vocab, vocab), np.float32)
    for t in range(vocab):
        default = (t + default_shift) % vocab
        table[t, nxt.get(t, default if default != EOS else (default + 1) % vocab)] = 5.0
    return table


def engine_for(target, drafter, **kw):
    return SpecEngine(target, drafter, eos_token_ids=[EOS], check_invariants=True, **kw)


def test_case1_rejected_draft_one_token():
    """Prompt [1,1,1]; drafter always proposes 1; target's argmax is 2; one draft token; max_new_tokens=1."""
    target = ScriptedTarget(chain_table(8, {1: 2, 2: 5}))
    drafter = ScriptedDrafter(lambda ctx, bonus: one_hot_rows([1], 8), 1, 8)
    eng = engine_for(target, drafter)
    out = eng.generate([1, 1, 1], 1)
    assert out.token_ids == [2] and out.stats.accepted == 0 and out.finish_reason == "length"
    out = eng.generate([1, 1, 1], 3)  # draft 1 after bonus 2 is rejected, the target's 5 is emitted
    assert out.token_ids == [2, 5, 6] and out.stats.accepted == 0 and out.stats.rounds == 1
    assert target.calls[-2:] == [[[2, 1]], [[5]]]  # the last token needs no draft: nothing after it is emitted


def test_case4_eos_inside_fully_accepted_block():
    """The target's 2nd generated token is EOS; the oracle drafts 4: stop at EOS inside the accepted block."""
    target = ScriptedTarget(chain_table(8, {1: 2, 2: EOS, EOS: 6}))
    eng = engine_for(target, oracle(target, 4))
    out = eng.generate([1, 1, 1], 20)
    assert out.token_ids == [2, EOS] and out.finish_reason == "stop"
    assert target.calls[-1] == [[2, EOS, 6, 7, 0]]  # the whole block was verified and matched
    assert out.stats.rounds == 1 and out.stats.accepted == 1 and not eng.sequences  # caches released


def test_case5_drafted_eos_rejected_generation_continues():
    target = ScriptedTarget(chain_table(8, {1: 2, 2: 4}))
    drafter = ScriptedDrafter(lambda ctx, bonus: one_hot_rows([EOS, 1, 1], 8), 3, 8)
    eng = engine_for(target, drafter)
    out = eng.generate([1, 1, 1], 6)
    assert out.token_ids == [2, 4, 5, 6, 7, 0] and out.finish_reason == "length" and EOS not in out.token_ids
    assert out.stats.accepted == 0


@pytest.mark.parametrize("max_new", [1, 2, 5, 8, 9, 13])
def test_case6_max_new_tokens_exact(max_new):
    target = ScriptedTarget(chain_table(16, {}))
    eng = engine_for(target, oracle(target, 4))
    out = eng.generate([1], max_new)
    assert out.token_ids == target.greedy(1, max_new) and out.finish_reason == "length"
    assert out.stats.new_tokens == len(out.token_ids) == max_new
    if max_new == 8:  # 1 from prefill, then 5 + 2: the last round drafts only what can still be emitted
        assert out.stats.rounds == 2 and [len(c[0]) for c in target.calls[1:]] == [5, 2]


def test_case6_eos_at_position_6():
    """EOS is returned and counted (documented policy in runtime/stops.py): 6 tokens, finish_reason stop."""
    target = ScriptedTarget(chain_table(16, {7: EOS}))  # 1 -> 2 4 5 6 7 EOS: EOS is the 6th token
    eng = engine_for(target, oracle(target, 4))
    out = eng.generate([1], 8)
    assert out.token_ids == [2, 4, 5, 6, 7, EOS] and out.finish_reason == "stop" and out.stats.new_tokens == 6


def test_stop_and_length_same_token_is_stop():
    target = ScriptedTarget(chain_table(8, {1: 2, 2: EOS}))
    out = engine_for(target, oracle(target, 4)).generate([1], 2)
    assert out.token_ids == [2, EOS] and out.finish_reason == "stop"


def test_stop_token_ids_and_ignore_eos():
    target = ScriptedTarget(chain_table(8, {1: 2, 2: EOS}))
    eng = engine_for(target, oracle(target, 4))
    out = eng.generate([1], params=SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=(6,)))
    assert out.token_ids == [2, EOS, 4, 5, 6] and out.finish_reason == "stop"


@pytest.mark.parametrize("wrong_at", [0, 1, 3])
def test_saboteur_rejected_at_its_slot(wrong_at):
    target = ScriptedTarget(chain_table(16, {}))
    eng = engine_for(target, saboteur(target, 4, wrong_at))
    out = eng.generate([1], 30)
    assert out.token_ids == target.greedy(1, 30)
    acc = out.stats.acceptance_per_position
    assert all(a == 1.0 for a in acc[:wrong_at]) and acc[wrong_at] == 0.0
    assert out.stats.mean_accepted_length == pytest.approx(1 + wrong_at, abs=0.2)


def test_ragged_batch_finished_row_leaves():
    """Rows of different lengths, draft counts and limits advance in shared target calls; a finished row leaves
    without disturbing the others; placeholders never reach a cache or the output."""
    target = ScriptedTarget(chain_table(16, {}))
    eng = engine_for(target, oracle(target, 4))
    reqs = [([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3)),
            ([7], SamplingParams(max_new_tokens=20, num_draft_tokens=1)),
            ([9, 9], SamplingParams(max_new_tokens=17, speculative=False))]
    outs = eng.generate_batch(reqs)
    assert [o.token_ids for o in outs] == [target.greedy(5, 3), target.greedy(7, 20), target.greedy(9, 17)]
    assert any(len(c) == 3 and len({len(r) for r in c}) > 1 for c in target.calls)  # one ragged call of 3 rows
    assert len(target.calls[3]) == 3 and all(len(c) <= 2 for c in target.calls[4:])  # row 0 left after round 1
    assert not eng.sequences


def test_past_drafter_positions_continue_target_only():
    """Case 8 on the scripted pair: drafter max positions 256, target 8192, prompt 250, max_new_tokens 50."""
    target = ScriptedTarget(chain_table(16, {}), max_positions=8192)
    drafter = oracle(target, 4)
    drafter.max_positions = 256
    eng = engine_for(target, drafter)
    prompt = [1] * 250
    out = eng.generate(prompt, 50)
    assert out.token_ids == target.greedy(1, 50) and out.stats.rounds <= 2
    assert eng.generate([2], 5).token_ids == target.greedy(2, 5)  # healthy for the next request


def test_padded_drafter_vocabulary_never_proposes_padding():
    """Case 9 in miniature: drafter vocabulary = target's + 128 padding rows with a huge bias on one."""
    target = ScriptedTarget(chain_table(16, {}))
    drafter = PaddedVocabDrafter(oracle(target, 4), pad=128, bias_row=16 + 5)
    for params in (SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, temperature=0.9, seed=1)):
        out = engine_for(target, drafter).generate([1], params=params)
        assert max(t for call in target.calls for row in call for t in row) < 16
        assert len(out.token_ids) == 20


@pytest.mark.parametrize("kw, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"seed": 2 ** 63}, "seed"), ({"stop": ("",)}, "stop"),
    ({"num_draft_tokens": -1}, "num_draft_tokens")])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"), ([1, 99], SamplingParams(), "token ids"),
    ([1] * 60, SamplingParams(max_new_tokens=5), "exceeds the target's 64 positions"),
    ([1], SamplingParams(num_draft_tokens=9), "num_draft_tokens"),
    ([1], SamplingParams(stop_token_ids=(40,)), "stop_token_ids"),
    ([1], SamplingParams(stop=("x",)), "tokenizer")])
def test_bad_requests_are_clear_and_lose_nothing(prompt, params, match):
    target = ScriptedTarget(chain_table(16, {}), max_positions=64)
    eng = engine_for(target, oracle(target, 4))
    with pytest.raises(ValueError, match=match):
        eng.generate(prompt, params=params)
    assert not eng.sequences and eng.generate([1], 4).token_ids == target.greedy(1, 4)


def test_engine_error_mid_generation_leaves_engine_usable():
    target = ScriptedTarget(chain_table(16, {}))
    drafter = oracle(target, 4)
    eng = engine_for(target, drafter)
    calls = {"n": 0}
    real = drafter.propose

    def flaky(ctx, bonus):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("drafter crashed")
        return real(ctx, bonus)

    drafter.propose = flaky
    with pytest.raises(RuntimeError, match="drafter crashed"):
        eng.generate([1], 30)
    assert not eng.sequences and eng.generate([1], 12).token_ids == target.greedy(1, 12)
