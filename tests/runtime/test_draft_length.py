"""Draft length by load and by acceptance (runtime/draft_length.py), n > 1 prefill sharing and per-token logprobs,
on the scripted backends: every policy stays lossless and does what it says."""
import numpy as np
import pytest

from runtime.draft_length import AdaptiveDraftTokens, DraftConfidence, DraftTokensByBatch, top1_probabilities
from runtime.engine import SpecEngine
from runtime.sampling import SamplingParams, processed_logprobs
from tests.runtime.scripted import ScriptedDrafter, ScriptedTarget, one_hot_rows, oracle, saboteur
from tests.runtime.test_loop import EOS, chain_table


def _engine(target, drafter, **kw):
    return SpecEngine(target, drafter, eos_token_ids=[EOS], check_invariants=True, **kw)


@pytest.mark.parametrize("spec, sizes, ks", [("1-2:7,3-4:3,5-:0", [1, 2, 3, 4, 5, 50], [7, 7, 3, 3, 0, 0]),
                                              ("1:4,2-:1", [1, 2, 9], [4, 1, 1])])
def test_table_parses_and_answers(spec, sizes, ks):
    t = DraftTokensByBatch.parse(spec)
    assert [t(b) for b in sizes] == ks and DraftTokensByBatch.parse(str(t)) == t


@pytest.mark.parametrize("bad", ["", "1-2:7", "2-:3", "1-2:7,4-:0", "1-3:2,3-:1", "a-b:c", "1-:x", "0-:2"])
def test_table_refusals_name_the_problem(bad):
    with pytest.raises(ValueError, match="draft tokens by batch"):
        DraftTokensByBatch.parse(bad)


def _max_k(result) -> int:
    """The largest draft length any round of a request used."""
    return sum(1 for d in result.stats.drafted_per_position if d)


def test_draft_length_follows_the_batch_size_and_stays_lossless():
    target = ScriptedTarget(chain_table(16, {}))
    table = DraftTokensByBatch.parse("1:4,2-3:2,4-:0")
    eng = _engine(target, oracle(target, 4), draft_tokens_by_batch=table)
    prompts = [[1, 2], [3, 4], [5, 6], [8, 9]]
    ref = [eng.generate_target_only(p, 12).token_ids for p in prompts]
    for n, k in ((1, 4), (2, 2), (4, 0)):  # rows of equal length finish together: the batch size holds
        outs = eng.generate_batch([(p, SamplingParams(max_new_tokens=12)) for p in prompts[:n]])
        assert [o.token_ids for o in outs] == ref[:n]
        assert {_max_k(o) for o in outs} == {k}
    own = eng.generate_batch([(p, SamplingParams(max_new_tokens=12, num_draft_tokens=3)) for p in prompts])
    assert {_max_k(o) for o in own} == {3}  # a request's own k wins over the table


def test_adaptive_schedule():
    a = AdaptiveDraftTokens(6)
    a.update(6, 6)
    assert a.k == 6  # capped at k_max
    for _ in range(3):
        a.update(a.k, 0)
    assert a.k == 3
    a.update(3, 3)
    assert a.k == 5
    for _ in range(9):
        a.update(a.k, 0)
    assert a.k == 1  # never below 1


def test_adaptive_draft_length_drops_on_rejections_and_stays_lossless():
    target = ScriptedTarget(chain_table(16, {}))
    bad = _engine(target, saboteur(target, 6, wrong_at=0), adaptive_draft_tokens=True)
    out = bad.generate([1, 2], 30)
    assert out.token_ids == bad.generate_target_only([1, 2], 30).token_ids
    # every round is rejected at once: k goes 6, 5, 4, 3, 2, 1, 1, ...; the drafted counts show it
    assert out.stats.drafted_per_position[0] == out.stats.rounds and out.stats.drafted_per_position[:6] == \
        [out.stats.rounds, 5, 4, 3, 2, 1]
    good = _engine(target, oracle(target, 6), adaptive_draft_tokens=True)
    out = good.generate([1, 2], 30)
    assert out.stats.drafted_per_position[5] == out.stats.rounds  # all accepted: k stays at 6


def test_confidence_cut_is_the_cumulative_product_rule():
    c = DraftConfidence(0.4)
    assert c.length([0.9, 0.8, 0.5, 0.99]) == 2  # 0.9, 0.72, 0.36: the third slot drops below 0.4
    assert c.length([0.3, 0.99]) == 1  # at least one draft token
    assert c.length([1.0] * 7) == 7 and c.length([]) == 0
    assert DraftConfidence.parse("off") is None and DraftConfidence.parse(None) is None
    assert DraftConfidence.parse("0.25") == DraftConfidence(0.25)
    for bad in ("x", "1.5", "-0.2"):
        with pytest.raises(ValueError, match="draft confidence"):
            DraftConfidence.parse(bad)


def test_top1_probability_over_a_draft_vocabulary_equals_the_full_softmax():
    rng = np.random.default_rng(0)
    support = np.sort(rng.choice(100, 20, replace=False))
    full = np.full((3, 100), -np.inf, np.float32)
    full[:, support] = rng.normal(size=(3, 20)) * 3
    e = np.exp(full - full.max(-1, keepdims=True))
    want = (e / e.sum(-1, keepdims=True)).max(-1)
    np.testing.assert_allclose(top1_probabilities(full), want, rtol=1e-6)
    np.testing.assert_allclose(top1_probabilities(full, support), want, rtol=1e-6)


def _confident_for(target, num_draft_tokens: int, sure: int) -> ScriptedDrafter:
    """Drafts the target's greedy continuation, confident (p ~ 1) on the first ``sure`` slots, unsure (p < 0.2)
    after them: a confidence policy should verify exactly ``sure`` tokens a round."""
    vocab = target.vocab_size

    def propose(_ctx, bonus):
        want = target.greedy(bonus, num_draft_tokens)
        logits = one_hot_rows(want, vocab)
        logits[sure:] *= 0.1  # scale 1: p(top-1) = e / (e + vocab - 1) < 0.2 for vocab 16
        return logits

    return ScriptedDrafter(propose, num_draft_tokens, vocab)


def test_confidence_draft_length_verifies_the_confident_prefix_and_stays_lossless():
    target = ScriptedTarget(chain_table(16, {}))
    ref = SpecEngine(target, None, eos_token_ids=[EOS]).generate_target_only([1, 2], 40).token_ids
    for sure in (1, 3, 6):
        # default_draft_tokens 2 is the fixed k; under the policy the ceiling is the drafter's 6
        eng = _engine(target, _confident_for(target, 6, sure), default_draft_tokens=2,
                      draft_confidence=DraftConfidence(0.4))
        out = eng.generate([1, 2], 40)
        assert out.token_ids == ref
        assert _max_k(out) == sure and out.stats.mean_accepted_length > sure  # all drafts accepted + bonus
    eng = _engine(target, _confident_for(target, 6, 6), draft_confidence=DraftConfidence(0.4))
    own = eng.generate([1, 2], params=SamplingParams(max_new_tokens=40, num_draft_tokens=3))
    assert own.token_ids == ref and _max_k(own) == 3  # a request's own k is the ceiling
    fixed = _engine(target, _confident_for(target, 6, 1), default_draft_tokens=4).generate([1, 2], 40)
    assert fixed.token_ids == ref and _max_k(fixed) == 4  # without the policy: the fixed k


def test_n_choices_share_one_prefill():
    target = ScriptedTarget(chain_table(16, {}))
    eng = _engine(target, oracle(target, 3))
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=1)
    seqs = [eng.add_request([1, 2, 3], params, request_id=f"c{i}", prefill_group="g") for i in range(3)]
    before = len(target.calls)
    eng.step()
    assert len(target.calls) == before + 1  # one prefill for the three
    while eng.sequences:
        eng.step()
    alone = eng.generate([1, 2, 3], params=params)
    assert all(s.result().token_ids == alone.token_ids for s in seqs)  # same seed, same prompt: same sample


def test_logprobs_follow_the_emitted_tokens_and_are_trimmed_at_a_stop():
    target = ScriptedTarget(chain_table(16, {}))
    eng = _engine(target, oracle(target, 4))
    params = SamplingParams(max_new_tokens=10, logprobs=2)
    spec = eng.generate([1, 2], params=params)
    base = eng.generate_target_only([1, 2], params=params)
    assert spec.token_ids == base.token_ids and len(spec.logprobs) == len(spec.token_ids)
    for a, b, t in zip(spec.logprobs, base.logprobs, spec.token_ids):
        assert a.token_id == b.token_id == t and abs(a.logprob - b.logprob) < 1e-6 and a.top == b.top
        assert a.top[0][0] == t and len(a.top) == 2  # greedy: the emitted token is the most likely
    row = target.table[2]  # the first emitted token was scored after the prompt's last token, 2
    assert spec.logprobs[0].logprob == pytest.approx(float(processed_logprobs(row, params)[spec.token_ids[0]]))
    stop_at = spec.token_ids[4]  # a stop token inside an accepted block
    stopped = eng.generate([1, 2], params=SamplingParams(max_new_tokens=10, logprobs=0, stop_token_ids=(stop_at,)))
    assert stopped.token_ids == spec.token_ids[:5] and stopped.finish_reason == "stop"
    assert [lp.token_id for lp in stopped.logprobs] == stopped.token_ids
    assert all(lp.top == () for lp in stopped.logprobs)
    assert not np.allclose([lp.logprob for lp in spec.logprobs], 0.0)


def test_prompt_logprobs_score_each_prompt_token_after_the_ones_before():
    target = ScriptedTarget(chain_table(16, {}))
    eng = _engine(target, oracle(target, 3))
    prompt = [1, 5, 9, 2, 7]
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=1)
    out = eng.generate(prompt, params=params)
    assert [lp.token_id for lp in out.prompt_logprobs] == prompt[1:] and out.logprobs is None
    for prev, lp in zip(prompt, out.prompt_logprobs):
        assert lp.logprob == pytest.approx(float(processed_logprobs(target.table[prev], params)[lp.token_id]))
        assert len(lp.top) == 1


def test_draft_cost_fits_the_round_and_picks_the_fastest_length():
    """DraftCost: a + b k fitted from observed rounds; the k maximising (1 + sum of cumulative top-1) / (a + b k)."""
    from runtime.draft_length import DraftConfidence, DraftCost

    cost = DraftCost()
    top1 = np.array([0.9, 0.85, 0.7, 0.2, 0.1])
    assert cost.coefficients() is None and cost.length(top1) == 5  # nothing observed: the ceiling
    for _ in range(40):  # rounds at k = 1 and 3 on a machine where a round costs 10 ms + 2 ms per draft token
        for k in (1, 3):
            cost.observe(k, 0.010 + 0.002 * k)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.010, rel=1e-6) and b == pytest.approx(0.002, rel=1e-6)
    expected = 1 + np.cumsum(np.cumprod(top1))
    best = int(np.argmax(expected / (0.010 + 0.002 * np.arange(1, 6)))) + 1
    assert cost.length(top1) == best == 3
    assert cost.length(np.array([0.99] * 5)) == 5  # sure drafts: verify them all
    cheap_verify_only = DraftCost()  # one k observed: b from the prior (0.2 a)
    for _ in range(10):
        cheap_verify_only.observe(2, 0.014)
    a, b = cheap_verify_only.coefficients()
    assert a == pytest.approx(0.014 / 1.4) and b == pytest.approx(0.2 * a)
    assert cheap_verify_only.length(np.array([0.05, 0.9])) == 1  # a weak first draft: one token is enough
    assert isinstance(DraftConfidence.parse("cost"), DraftCost) and DraftConfidence.parse("cost") is not \
        DraftConfidence.parse("cost")
    with pytest.raises(ValueError, match="'cost' or 'off'"):
        DraftConfidence.parse("fast")
    with pytest.raises(ValueError, match="decay"):
        DraftCost(decay=1.0)


def test_draft_cost_in_the_loop_is_lossless_and_observes_rounds(tiny_engines):
    """The engine feeds DraftCost its single-row rounds; output equals target-only greedy."""
    from runtime.draft_length import DraftCost

    cost = DraftCost()
    eng = SpecEngine.from_dir(tiny_engines, draft_confidence=cost)
    ids = eng.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
    spec = eng.generate(ids, 24)
    assert spec.token_ids == eng.generate_target_only(ids, 24).token_ids
    assert cost.coefficients() is not None and cost._sums[0] > 0
    assert spec.stats.rounds >= 1 and 1 <= spec.stats.mean_accepted_length <= eng.drafter.num_draft_tokens + 1
