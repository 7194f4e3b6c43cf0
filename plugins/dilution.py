"""Attention dilution statistics of SharpDraft (arXiv 2610.05106, Sec. 3) and the profile fit behind calibration.

For one query row with pre-softmax scores s_1..s_N (already multiplied by the softmax scale, hidden keys -inf) and
the k keys of largest score ("top" set T, the rest R, |R| = N - k):

    mass_top_k  = sum_{i in T} softmax(s)_i
    contrast    = LME_T(s) - LME_R(s),       LME_S(s) = ln( (1/|S|) sum_{i in S} e^{s_i} )   (log-mean-exp)
    logit(mass_top_k) = contrast - ln((N - k) / k)                                               (exact identity)

The identity says why attention dilutes: with the contrast fixed by what the drafter learnt, the top-k mass falls as
ln N grows. Scaling the query by beta multiplies every score by beta; the top set does not change (order is kept) and

    d contrast / d beta = E_{softmax(beta s) on T}[s] - E_{softmax(beta s) on R}[s]  >= 0

("contrast gained per unit of beta"), so mass_top_k is non-decreasing in beta and a beta that restores a given mass
can be found by bisection (:func:`beta_for_mass`). :func:`fit_profile` fits the rule's ``ref_keys`` and ``slope``
(:class:`plugins.rule.QueryScaleProfile`) to such required betas. All functions compute in float64.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from plugins.rule import DEFAULT_CAP, QueryScaleProfile


@dataclasses.dataclass(frozen=True, slots=True)
class TopKStats:
    """Per-row statistics; every field has the row shape of the scores (``[...]``, float64 tensors).

    Attributes:
        num_keys: N, visible keys of the row.
        mass: top-k attention mass in [0, 1].
        rest_mass: the mass of the other N - k keys, computed directly (not as 1 - mass, which rounds to 0 when a
            sink key takes nearly everything), so ``logit(mass) = ln(mass) - ln(rest_mass)`` stays finite.
        contrast: LME(top) - LME(rest), nats.
        contrast_gain: d contrast / d beta at the scores given (nats per unit of beta).
    """

    num_keys: torch.Tensor
    mass: torch.Tensor
    rest_mass: torch.Tensor
    contrast: torch.Tensor
    contrast_gain: torch.Tensor


def _masked_float64(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` in float64 with every hidden key (<= -1e30, e.g. an additive finfo.min mask) at -inf."""
    s = scores.to(torch.float64)
    return torch.where(s > -1e30, s, torch.tensor(-math.inf, dtype=s.dtype, device=s.device))


def topk_stats(scores: torch.Tensor, top_k: int = 32) -> TopKStats:
    """Top-k mass, contrast and contrast gain per query row.

    Args:
        scores: ``[..., keys]`` pre-softmax scores (e.g. ``[batch, heads, q_len, keys]``) with hidden keys at -inf
            (or any value <= -1e30, e.g. an additive finfo.min mask); any float dtype, computed in float64.
        top_k: k. Every row must see more than k keys.

    Returns:
        :class:`TopKStats` with fields shaped ``scores.shape[:-1]``.

    Raises:
        ValueError: a row sees N <= top_k keys (the rest set would be empty; mass is 1 by definition).
    """
    s = _masked_float64(scores)
    n = torch.isfinite(s).sum(-1)
    if bool((n <= top_k).any()):
        raise ValueError(f"every row needs more than top_k={top_k} visible keys; min N is {int(n.min())}")
    top, idx = s.topk(top_k, dim=-1)
    rest = s.scatter(-1, idx, -math.inf)  # the top keys removed; hidden keys stay -inf
    lse_top = torch.logsumexp(top, -1)
    lse_rest = torch.logsumexp(rest, -1)
    lse_all = torch.logaddexp(lse_top, lse_rest)
    mass = torch.exp(lse_top - lse_all)
    rest_mass = torch.exp(lse_rest - lse_all)
    nf = n.to(torch.float64)
    contrast = (lse_top - math.log(top_k)) - (lse_rest - torch.log(nf - top_k))
    p_top = torch.softmax(top, -1)
    p_rest = torch.softmax(rest, -1)
    e_top = (p_top * top).sum(-1)
    e_rest = torch.where(p_rest > 0, p_rest * torch.nan_to_num(rest, neginf=0.0), 0.0).sum(-1)
    return TopKStats(num_keys=nf, mass=mass, rest_mass=rest_mass, contrast=contrast, contrast_gain=e_top - e_rest)


def identity_residual(stats: TopKStats, top_k: int = 32) -> torch.Tensor:
    """``logit(mass) - (contrast - ln((N - k) / k))`` per row: zero up to rounding (float64), by the identity.

    logit(mass) is taken as ``ln(mass) - ln(rest_mass)`` from the two softmax partitions, independently of the
    log-mean-exp contrast.
    """
    return (torch.log(stats.mass) - torch.log(stats.rest_mass)) - (
        stats.contrast - torch.log((stats.num_keys - top_k) / top_k))


def mean_mass_at(scores: torch.Tensor, beta: float, top_k: int = 32) -> float:
    """Mean over rows of the top-k mass of ``softmax(beta * scores)``; ``scores`` as in :func:`topk_stats`."""
    return _mean_mass(_masked_float64(scores), beta, top_k)


def _mean_mass(masked: torch.Tensor, beta: float, top_k: int) -> float:
    """:func:`mean_mass_at` on scores already from :func:`_masked_float64` (hidden keys stay -inf for any beta)."""
    probs = torch.softmax(torch.where(torch.isfinite(masked), masked * beta, masked), -1)
    return float(probs.topk(top_k, dim=-1).values.sum(-1).mean())


def beta_for_mass(scores: torch.Tensor, target_mass: float, top_k: int = 32, *, lo: float = 1.0,
                  hi: float = 4.0, tol: float = 1e-4) -> float:
    """The beta >= ``lo`` at which the mean top-k mass of ``softmax(beta * scores)`` reaches ``target_mass``.

    The mean mass is non-decreasing in beta (module docstring), so this bisects on ``[lo, hi]``; returns ``lo`` if
    the mass already reaches the target there and ``hi`` if even ``hi`` does not.

    Args:
        scores: ``[..., keys]`` raw (beta = 1) scores of the rows that share one N, as in :func:`topk_stats`.
        target_mass: the mass to restore, in (0, 1), e.g. the mass measured at the drafter's training length.
    """
    if not 0.0 < target_mass < 1.0:
        raise ValueError(f"target_mass must be in (0, 1), got {target_mass}")
    masked = _masked_float64(scores)  # once, not per bisection step
    if _mean_mass(masked, lo, top_k) >= target_mass:
        return lo
    if _mean_mass(masked, hi, top_k) < target_mass:
        return hi
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if _mean_mass(masked, mid, top_k) >= target_mass:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


def fit_profile(num_keys, required_beta, *, top_k: int = 32, cap: float = DEFAULT_CAP,
                weights=None, min_ref_keys: int | None = None, max_ref_keys: int | None = None) -> tuple[QueryScaleProfile, float]:
    """Least-squares fit of ``ref_keys`` and ``slope`` of the rule to required betas (``cap`` and ``top_k`` kept).

    Minimises ``sum_i w_i (beta_rule(N_i) - required_beta_i)^2`` over integer ``ref_keys`` (a log-spaced grid from
    ``min_ref_keys`` (default top_k + 1) to ``max_ref_keys`` (default max N), refined to every integer around the best
    grid point) and ``1 / slope`` in [0, 2] (a grid of 2001 values).

    Args:
        num_keys: N per point, 1-D array-like (> top_k).
        required_beta: beta per point (>= 1), e.g. from :func:`beta_for_mass`; values above ``cap`` count as ``cap``.
        weights: optional non-negative weight per point (e.g. query rows measured at that N).

    Returns:
        (profile, rmse): the fitted :class:`plugins.rule.QueryScaleProfile` and the weighted root-mean-square
        residual of its betas.

    Raises:
        ValueError: empty or mismatched inputs, N <= top_k, or beta < 1.
    """
    n = np.asarray(num_keys, dtype=np.float64).ravel()
    b = np.minimum(np.asarray(required_beta, dtype=np.float64).ravel(), cap)
    w = np.ones_like(n) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if n.size == 0 or n.shape != b.shape or n.shape != w.shape:
        raise ValueError(f"num_keys, required_beta and weights need one value per point, got {n.size}, {b.size}, {w.size}")
    if np.any(n <= top_k) or np.any(b < 1 - 1e-9) or np.any(w < 0):
        raise ValueError("every N must exceed top_k, every required beta be >= 1 and every weight >= 0")
    lo = min_ref_keys or top_k + 1
    hi = max(lo + 1, int(max_ref_keys or n.max()))
    inv_slopes = np.linspace(0.0, 2.0, 2001)[1:]  # 1/slope > 0

    def best_for(refs: np.ndarray) -> tuple[float, int, float]:
        r = np.maximum((n[None, :] - top_k) / (refs[:, None] - top_k), 1.0)  # [refs, points]
        pred = np.minimum(cap, 1.0 + np.log(r)[:, None, :] * inv_slopes[None, :, None])  # [refs, slopes, points]
        err = ((pred - b) ** 2 * w).sum(-1)
        i, j = np.unravel_index(np.argmin(err), err.shape)
        return float(err[i, j]), int(refs[i]), float(inv_slopes[j])

    grid = np.unique(np.geomspace(lo, hi, 96).round().astype(np.int64))
    _, ref, _ = best_for(grid)
    pos = int(np.searchsorted(grid, ref))
    near = np.arange(grid[max(pos - 1, 0)], grid[min(pos + 1, len(grid) - 1)] + 1)
    err, ref, inv_slope = best_for(near)
    rmse = math.sqrt(err / max(w.sum(), 1e-12))
    return QueryScaleProfile(ref_keys=ref, top_k=top_k, slope=round(1.0 / inv_slope, 4), cap=cap), rmse
