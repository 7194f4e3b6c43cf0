"""Dilution statistics (plugins/dilution.py): the log-odds identity, the contrast gain, beta_for_mass, fit_profile."""
import math

import numpy as np
import pytest
import torch

from plugins.dilution import beta_for_mass, fit_profile, identity_residual, mean_mass_at, topk_stats
from plugins.rule import QueryScaleProfile


def _scores(n_rows=6, keys=300, hidden=0, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n_rows, keys, generator=g, dtype=torch.float64) * spread
    if hidden:
        s[:, -hidden:] = -math.inf
    return s


@pytest.mark.parametrize("keys,hidden,spread", [(33, 0, 1.0), (100, 20, 3.0), (4096, 0, 6.0), (2000, 1500, 0.5)])
def test_log_odds_identity_holds_to_1e6(keys, hidden, spread):
    s = _scores(keys=keys, hidden=hidden, spread=spread)
    st = topk_stats(s, 32)
    assert torch.equal(st.num_keys, torch.full((6,), float(keys - hidden), dtype=torch.float64))
    assert identity_residual(st, 32).abs().max() < 1e-6
    # the mass is the plain softmax top-k sum
    direct = torch.softmax(s, -1).topk(32, -1).values.sum(-1)
    torch.testing.assert_close(st.mass, direct, rtol=0, atol=1e-12)
    # the contrast is LME(top) - LME(rest) computed the long way
    c0 = torch.logsumexp(s[0][torch.isfinite(s[0])].sort(descending=True).values[:32], 0) - math.log(32)
    rest = s[0][torch.isfinite(s[0])].sort(descending=True).values[32:]
    c1 = torch.logsumexp(rest, 0) - math.log(len(rest))
    assert abs((c0 - c1).item() - st.contrast[0].item()) < 1e-9


def test_identity_stays_finite_with_an_attention_sink():
    s = _scores(keys=1000, spread=1.0)
    s[:, 0] = 60.0  # a sink: the top-k mass is 1 - 1e-23, i.e. 1.0 in float64
    st = topk_stats(s, 32)
    assert bool((st.mass == 1.0).all()) and bool((st.rest_mass > 0).all())
    assert identity_residual(st, 32).abs().max() < 1e-6
    torch.testing.assert_close(st.mass + st.rest_mass, torch.ones(6, dtype=torch.float64))


def test_masked_fill_value_counts_as_hidden():
    s = _scores(keys=200, hidden=50).to(torch.float32)
    s_fin = torch.where(torch.isfinite(s), s, torch.finfo(torch.float32).min)
    a, b = topk_stats(s, 32), topk_stats(s_fin, 32)
    torch.testing.assert_close(a.mass, b.mass)
    assert torch.equal(a.num_keys, b.num_keys)


def test_contrast_gain_is_the_derivative_in_beta():
    s = _scores(keys=500, spread=2.0, seed=3)
    for beta in (1.0, 1.3):
        h = 1e-5
        up, down = topk_stats(s * (beta + h), 32).contrast, topk_stats(s * (beta - h), 32).contrast
        fd = (up - down) / (2 * h)
        gain = topk_stats(s * beta, 32).contrast_gain
        # d/dbeta C(beta s) = E[s] terms; gain is reported per unit of the scores passed in (beta s)
        torch.testing.assert_close(fd, gain / beta, rtol=1e-5, atol=1e-6)
        assert bool((gain >= 0).all())


def test_rows_with_too_few_keys_are_refused():
    with pytest.raises(ValueError, match="more than top_k"):
        topk_stats(_scores(keys=40, hidden=10), 32)


def test_mass_grows_with_beta_and_beta_for_mass_restores_it():
    short, long = _scores(keys=256, spread=2.5, seed=1), _scores(keys=4096, spread=2.5, seed=2)
    m_short = mean_mass_at(short, 1.0)
    masses = [mean_mass_at(long, b) for b in (1.0, 1.2, 1.4, 1.6)]
    assert masses == sorted(masses) and masses[0] < m_short
    beta = beta_for_mass(long, m_short)
    assert 1.0 < beta < 4.0
    assert abs(mean_mass_at(long, beta) - m_short) < 1e-3
    assert beta_for_mass(short, 0.5 * m_short) == 1.0  # already above target: no scaling
    with pytest.raises(ValueError):
        beta_for_mass(long, 1.5)


@pytest.mark.parametrize("ref,slope", [(700, 3.0), (300, 6.5), (2048, 5.0)])
def test_fit_recovers_a_known_profile(ref, slope):
    truth = QueryScaleProfile(ref_keys=ref, slope=slope)
    n = np.array([64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12000, 16000])
    fitted, rmse = fit_profile(n, truth.beta(n))
    assert rmse < 2e-3
    np.testing.assert_allclose(fitted.beta(n), truth.beta(n), atol=5e-3)
    assert fitted.cap == truth.cap and fitted.top_k == 32


def test_fit_rejects_bad_points():
    with pytest.raises(ValueError):
        fit_profile([], [])
    with pytest.raises(ValueError):
        fit_profile([20, 100], [1.0, 1.1])  # N <= top_k
    with pytest.raises(ValueError):
        fit_profile([100, 200], [0.5, 1.1])  # beta < 1
