"""What every graph check shares, family-neutral: the tolerances, the drafter bound, the NaN-safe comparison
(:func:`max_abs_diff`, :func:`within`), :class:`ValidationError` and the ONNX Runtime session the checks run.

export/validate.py (the target graphs) and each family's ``validate.py`` (export/families/<family>/) use these;
``export.validate`` re-exports them under their old names.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

TARGET_ATOL = 2e-3  # fp32 logits, 30 layers: ORT vs torch differ by reassociation only (measured ~1e-4)
DRAFTER_ATOL = 2e-3
# Softmax over up to 20 * ref_keys keys sums in a different order in ORT and torch: allow an error relative to the
# logit scale too (measured 5e-3 on logits of magnitude ~40 at N = 10,240, i.e. ~1e-4 relative).
DRAFTER_RTOL = 5e-4
# ... and with the number of keys N (a sum over N softmax-weighted values, added in another order: the bound widens as
# sqrt(N / 8192) past 8,192 keys) and with the position, through RoPE: the rotary angle pos * inv_freq is held in fp32,
# one ulp of it is 2^-23 * pos radians, and ORT and torch round it in their own order, so queries and keys at
# position 40,000 rotate up to ~5e-3 rad apart; the bound adds that much of the logits' magnitude. Measured with
# scripts/bench_scale.py (1 B-parameter drafter, hidden 4096): 1.0e-3 at N = 8,192 and 8.9e-3 at N = 40,960, the
# growth of the rotary term; a Qwen3-0.6B-width drafter exceeded the former flat bound (3.65e-3 > 3.64e-3) there.
DRAFTER_KEYS_AT_BASE = 8192
ROPE_ULP = 2.0 ** -23  # relative spacing of fp32: the angle error per radian of pos * inv_freq (inv_freq <= 1)


def drafter_bound(ref: np.ndarray, num_keys) -> float:
    """The validation bound of a drafter graph's logits ``ref`` at ``num_keys`` visible keys (an int, or per-row
    counts: the largest is used; the positions are at most about as large):
    ``DRAFTER_ATOL * s + max|ref| * (DRAFTER_RTOL * s + N * ROPE_ULP)`` with ``s = max(1, sqrt(N / 8192))``."""
    n = max(num_keys) if isinstance(num_keys, (list, tuple)) else int(num_keys)
    s = max(1.0, (n / DRAFTER_KEYS_AT_BASE) ** 0.5)
    return DRAFTER_ATOL * s + float(np.abs(ref).max()) * (DRAFTER_RTOL * s + n * ROPE_ULP)


class ValidationError(ValueError):
    """An exported graph disagrees with its torch source beyond tolerance."""


def max_abs_diff(got, want, what: str) -> float:
    """``max |got - want|`` of a graph output against its reference, refusing values that are not finite.

    ``got`` (the graph's output) and ``want`` (the torch reference) are arrays of one shape (any dtype). An
    infinity in ``got`` is accepted only where ``want`` holds the same infinity (the design puts -inf in logits
    outside the draft vocabulary, for instance); a NaN anywhere, or an inf where the reference is finite, is an
    error naming ``what`` (e.g. ``"drafter graph logits at N=256"``): a ``diff > bound`` test would let a NaN
    through, since every comparison with NaN is false.

    Returns: the largest absolute difference over the finite entries (0.0 for empty arrays).
    Raises:
        ValidationError: NaN in either array, or an inf in ``got`` that ``want`` does not hold at that position
            (the count and the first index named).
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    for arr, side in ((want, "the torch reference"), (got, "the exported graph")):
        nan = np.isnan(arr)
        if nan.any():
            first = tuple(int(i) for i in np.unravel_index(int(nan.argmax()), arr.shape))
            raise ValidationError(f"{what}: {side} holds {int(nan.sum())} NaN values (first at index {first}): a "
                                  "non-finite weight or table in the checkpoint, or an overflow; fix the weights")
    same_inf = np.isinf(want) & (got == want)
    bad = np.isinf(got) & ~same_inf
    if bad.any():
        first = tuple(int(i) for i in np.unravel_index(int(bad.argmax()), got.shape))
        raise ValidationError(f"{what}: the exported graph holds {int(bad.sum())} infinite values where the torch "
                              f"reference is finite (first at index {first}): an overflow or a non-finite weight")
    if not got.size:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(same_inf, 0.0, got - want))
    return float(diff.max())  # inf where the reference is infinite and the graph is not: fails any bound


def within(diff: float, bound: float) -> bool:
    """``diff <= bound`` (False for a NaN ``diff``: a check must fail on it, never pass by a false ``>``)."""
    return bool(diff <= bound)


def session(path: Path):
    """An ONNX Runtime CPU session of ``path`` (warnings off): every graph check runs through this one."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def dims(cfg) -> dict:
    """num_layers, kv_heads, head_dim and hidden_size of an HF config."""
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"num_layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": hd,
            "hidden_size": cfg.hidden_size}
