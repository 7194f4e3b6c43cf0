"""Sampled verification keeps the target's processed distribution (issue 3, case 2), and the processors.

Statistical bound (written once): with n = 100,000 one-step draws, each token's empirical frequency must be within
5 standard errors of the processed target probability p: |f - p| <= 5 * sqrt(p (1 - p) / n) + 1e-9. For a correct
sampler a 5-sigma miss has probability ~6e-7 per token; seeds are fixed, so the test is deterministic. Tokens with
p = 0 (outside top-k / top-p) must never appear: not as the first token, the resampled token or the bonus.
"""
import math

import numpy as np
import pytest

from runtime.sampling import GREEDY_EPS, RowSampler, SamplingParams, is_greedy, process_logits, sample_from

TARGET = np.array([2.0, 1.5, 1.0, 0.5], np.float32)
DRAFTER = np.array([1.0, 2.0, 0.5, 0.5], np.float32)
N_DRAWS = 100_000
SIGMAS = 5.0


def processed_target(params: SamplingParams) -> np.ndarray:
    """The expected distribution, computed by hand (not with process_logits)."""
    x = TARGET.astype(np.float64) / params.temperature
    if params.top_k > 0:
        x = np.where(x >= np.sort(x)[-params.top_k], x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p)
        keep, mass = [], 0.0
        for i in order:
            keep.append(i)
            mass += p[i]
            if mass >= params.top_p:
                break
        p = np.where(np.isin(np.arange(4), keep), p, 0.0)
        p /= p.sum()
    return p


CONFIGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=2),
           SamplingParams(temperature=0.5, top_p=0.6)]


@pytest.mark.parametrize("scheme", ["rejection", "exact_match"])
@pytest.mark.parametrize("params", CONFIGS, ids=["T1", "T0.7-topk2", "T0.5-topp0.6"])
def test_case2_one_step_histogram_matches_processed_target(params, scheme):
    expect = processed_target(params)
    sampler = RowSampler(params, np.random.Generator(np.random.PCG64(1234)))
    target_rows = np.stack([TARGET, TARGET])  # k + 1 = 2 rows: the draft slot, then the bonus slot
    first = np.zeros(4, np.int64)
    later = np.zeros(4, np.int64)
    for _ in range(N_DRAWS):
        drafts, q = sampler.draft(DRAFTER[None], scheme)
        _, emitted = sampler.verify(drafts, q, target_rows, scheme)
        first[emitted[0]] += 1
        for t in emitted[1:]:
            later[t] += 1
    freq = first / N_DRAWS
    bound = SIGMAS * np.sqrt(expect * (1 - expect) / N_DRAWS) + 1e-9
    assert np.all(np.abs(freq - expect) <= bound), (freq, expect, bound)
    assert np.all(first[expect == 0] == 0) and np.all(later[expect == 0] == 0)  # never outside top-k / top-p


def test_case2_expected_distributions_by_hand():
    """Pin the three processed distributions so the histogram test cannot pass against a wrong expectation."""
    p1 = processed_target(CONFIGS[0])
    assert p1 == pytest.approx(np.exp([2.0, 1.5, 1.0, 0.5]) / np.exp([2.0, 1.5, 1.0, 0.5]).sum())
    p2 = processed_target(CONFIGS[1])
    assert p2[2:].tolist() == [0.0, 0.0] and p2[0] == pytest.approx(1 / (1 + math.exp(-0.5 / 0.7)))
    assert processed_target(CONFIGS[2]).tolist() == [1.0, 0.0, 0.0, 0.0]  # p0 = 0.644 >= 0.6 already
    for params in CONFIGS:
        np.testing.assert_allclose(process_logits(TARGET, params), processed_target(params), atol=1e-12)


def test_drafts_come_from_the_same_q_as_the_acceptance_test():
    params = SamplingParams(temperature=0.7, top_k=2)
    sampler = RowSampler(params, np.random.Generator(np.random.PCG64(0)))
    logits = np.stack([DRAFTER, TARGET, DRAFTER])
    drafts, q = sampler.draft(logits)
    np.testing.assert_array_equal(q, process_logits(logits, params))
    assert q.dtype == np.float64 and all(q[j, d] > 0 for j, d in enumerate(drafts))


def test_greedy_definition_is_one_threshold():
    assert is_greedy(0.0) and is_greedy(GREEDY_EPS / 10) and not is_greedy(GREEDY_EPS)
    sampler = RowSampler(SamplingParams(temperature=1e-6), np.random.Generator(np.random.PCG64(0)))
    state = sampler.rng.bit_generator.state
    assert sampler.draft(DRAFTER[None])[0] == [1]
    assert sampler.verify([1], None, np.stack([TARGET, TARGET])) == (0, [0])  # argmax everywhere
    assert sampler.next_token(TARGET) == 0
    assert sampler.rng.bit_generator.state == state  # greedy rows never consume random numbers


def test_tiny_temperature_has_no_overflow():
    for t in (GREEDY_EPS, 1e-4):
        p = process_logits(np.array([3.0, 3.0 - 1e-3, -1e4, -np.inf], np.float32), SamplingParams(temperature=t))
        assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0) and p[0] > 0.99


def test_sample_from_never_draws_zero_probability():
    rng = np.random.Generator(np.random.PCG64(5))
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = {sample_from(probs, rng) for _ in range(2000)}
    assert draws == {1, 3}


def test_seeded_streams_reproduce_and_unseeded_differ():
    a = SamplingParams(temperature=1.0, seed=42).make_rng().random(4)
    b = SamplingParams(temperature=1.0, seed=42).make_rng().random(4)
    c = SamplingParams(temperature=1.0).make_rng().random(4)
    d = SamplingParams(temperature=1.0).make_rng().random(4)
    assert (a == b).all() and not (c == d).all()


def test_top_k_ties_and_top_p_keep_first():
    p = process_logits(np.array([1.0, 1.0, 0.0, -1.0]), SamplingParams(temperature=1.0, top_k=1))
    assert p.tolist() == [0.5, 0.5, 0.0, 0.0]  # ties at the k-th logit are all kept (vLLM)
    p = process_logits(np.array([5.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert p.tolist() == [1.0, 0.0, 0.0]
