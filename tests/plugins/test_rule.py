import math

import numpy as np
import pytest
import torch

from plugins.rule import FAMILY_REF_KEYS, QueryScaleProfile, beta, beta_torch


def test_beta_is_one_up_to_ref_keys():
    p = QueryScaleProfile.for_family("dflash")
    for n in (1, 32, 33, 100, 2047, 2048):
        assert p.beta(n) == 1.0
    assert p.beta(2049) > 1.0


@pytest.mark.parametrize("n, expected", [(2049, 1.0000992), (16416, 1.4190380), (4096, 1.1402105)])
def test_pinned_values_dflash(n, expected):
    assert QueryScaleProfile.for_family("dflash").beta(n) == pytest.approx(expected, abs=5e-8)


def test_exact_formula_against_worked_example():
    # N = 16,416, ref 2048: r = (16416 - 32) / (2048 - 32) = 8.126984..., beta = 1 + ln(r) / 5
    r = (16416 - 32) / (2048 - 32)
    assert QueryScaleProfile().beta(16416) == pytest.approx(1 + math.log(r) / 5, rel=1e-15)


@pytest.mark.parametrize("family, n_cap", [("dflash", 51694), ("pard", 209140)])
def test_cap_reached(family, n_cap):
    p = QueryScaleProfile.for_family(family)
    assert p.cap_reached_at() == pytest.approx(n_cap, abs=1.0)
    assert p.beta(n_cap - 2) < p.cap
    assert p.beta(n_cap + 1) == p.cap == pytest.approx(math.exp(0.5))
    assert p.beta(10**9) == p.cap


def test_monotone_and_array_form():
    n = np.arange(1, 300_000, 37)
    b = QueryScaleProfile().beta(n)
    assert b.shape == n.shape and np.all(np.diff(b) >= 0)
    assert np.array_equal(b, [beta(int(x), ref_keys=2048) for x in n[:50]] + list(b[50:]))


def test_torch_form_matches_numpy():
    p = QueryScaleProfile.for_family("pard")
    n = torch.tensor([1, 8191, 8192, 8193, 16416, 50_000, 209_140, 10**7])
    np.testing.assert_allclose(beta_torch(n, p).numpy(), p.beta(n.numpy()), rtol=1e-6)
    assert beta_torch(5000, p.replace(enabled=False)).item() == 1.0


def test_presets():
    assert FAMILY_REF_KEYS == {"dflash": 2048, "pard": 8192, "eagle3": 2048}
    assert QueryScaleProfile.for_family("eagle3", slope=4.0).slope == 4.0
    assert QueryScaleProfile.for_family("pard").beta(8192) == 1.0


@pytest.mark.parametrize("kwargs, field", [
    ({"ref_keys": 32}, "ref_keys"), ({"ref_keys": 10}, "ref_keys"), ({"ref_keys": 2048.5}, "ref_keys"),
    ({"top_k": 0}, "top_k"), ({"slope": 0}, "slope"), ({"slope": float("nan")}, "slope"),
    ({"cap": 0.9}, "cap"), ({"cap": float("inf")}, "cap"), ({"enabled": 1}, "enabled")])
def test_bad_values_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QueryScaleProfile(**kwargs)


def test_unknown_family_and_fields():
    with pytest.raises(ValueError, match="unknown drafter family"):
        QueryScaleProfile.for_family("medusa")
    with pytest.raises(ValueError, match="unknown query-scale profile fields"):
        QueryScaleProfile.from_dict({"ref_keys": 512, "temperature": 2})
    with pytest.raises(ValueError, match="N must be >= 1"):
        beta(0, ref_keys=2048)


def test_round_trip():
    p = QueryScaleProfile(ref_keys=512, slope=4.0, enabled=False)
    assert QueryScaleProfile.from_dict(p.to_dict()) == p


def test_every_form_of_n_agrees_with_the_rule():
    """N is counted in one place (plugins/rule.py); the transformers, TensorRT-LLM and mask forms equal it."""
    import torch

    from plugins.rule import count_visible, switch_rows, visible_keys
    from plugins.trtllm_patch import block_visible_keys, causal_visible_keys
    from runtime.models.hf_query_scale import visible_keys as hf_visible_keys

    kv = torch.tensor([7, 12])
    causal = visible_keys(kv, 4, causal=True)
    assert causal.tolist() == [[4, 5, 6, 7], [9, 10, 11, 12]]
    assert visible_keys(kv, 4, causal=True, window=5).tolist() == [[4, 5, 5, 5], [5] * 4]
    # a non-causal block's window is anchored at each query's position: row i sees min(kv, W + q_len - 1 - i)
    assert visible_keys(kv, 4, causal=False, window=10).tolist() == [[7] * 4, [12, 12, 11, 10]]
    # a causal boolean mask [batch, 1, q, keys] counted row by row gives the same N
    j, i = torch.arange(12)[None, None, None, :], torch.arange(4)[None, None, :, None]
    mask = (j <= kv[:, None, None, None] - 4 + i) & (j < kv[:, None, None, None])
    assert count_visible(mask)[:, 0, :, 0].tolist() == causal.tolist()
    assert hf_visible_keys(mask, 4, 12)[:, 0, :, 0].tolist() == causal.tolist()
    assert hf_visible_keys(None, 4, 12)[0, 0, :, 0].tolist() == causal[1].tolist()
    assert causal_visible_keys(torch.arange(8, 12), 4).tolist() == causal[1].tolist()
    assert block_visible_keys(kv).tolist() == [7, 12] and block_visible_keys(kv, window_left=9).tolist() == [7, 10]
    beta = torch.tensor([[1.5], [1.25]])
    assert switch_rows(beta, torch.tensor([1.0, 0.0])).tolist() == [[1.5], [1.0]]
    assert switch_rows(beta, None) is beta
