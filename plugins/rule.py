"""The SharpDraft query-scale rule: the single source of truth for beta(N).

SharpDraft (arXiv 2610.05106) multiplies every drafter query by

    beta(N) = min(cap, 1 + ln(r) / slope),   r = max((N - top_k) / (ref_keys - top_k), 1)

where N is the number of keys the query can see (its softmax size). beta is 1 for N <= ref_keys, grows
logarithmically above it and saturates at ``cap`` (e^0.5 by default). The numpy, torch and ONNX forms used by
the rest of the project are all generated from (or tested against) :func:`beta`.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np

DEFAULT_TOP_K = 32
DEFAULT_SLOPE = 5.0
DEFAULT_CAP = math.exp(0.5)  # e^0.5 ~= 1.6487212707



class Vocabulary(str, enum.Enum):
    """Base of the project's mode vocabularies (:class:`Family`, ``runtime.modes``, ``export.rewrite.NumKeysFrom``,
    ``plugins.trtllm_patch.Route``): a ``str`` enum equal to, hashing as and printing as its value, so a member and
    its string are the same dict key and JSON writes the string. :meth:`parse` refuses other values with
    :meth:`_refusal`'s message."""

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return hash(self.value)

    @classmethod
    def _refusal(cls, value) -> str:
        return f"{cls.__name__} must be one of {', '.join(m.value for m in cls)}, got {value!r}"

    @classmethod
    def parse(cls, value):
        """``cls(value)`` with an error that lists the choices. Raises ValueError."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(cls._refusal(value)) from None


class Family(Vocabulary):
    """The drafter families sharpdraft exports and serves (the ``--drafter`` choices and the manifest's
    ``drafter.family``). A ``str`` enum: ``Family.DFLASH == "dflash"`` and it writes to JSON as ``"dflash"``. Everything
    else that differs between families lives on one object per family (export/families/)."""

    DFLASH = "dflash"
    PARD = "pard"
    EAGLE3 = "eagle3"

    @classmethod
    def _refusal(cls, value) -> str:
        return f"unknown drafter family {value!r}; choose one of {', '.join(f.value for f in cls)}"


# ref_keys per drafter family: DFlash and PARD from the paper's primary runs; EAGLE-3 heads are trained at 2048
# positions, the analogous default (see docs/reference/drafters.md §5).
FAMILY_REF_KEYS = {Family.DFLASH: 2048, Family.PARD: 8192, Family.EAGLE3: 2048}


@dataclasses.dataclass(frozen=True, slots=True)
class QueryScaleProfile:
    """Constants of the query-scale rule for one drafter.

    Attributes:
        ref_keys: N at and below which beta is exactly 1 (the drafter's "training" softmax size). int > top_k.
        top_k: the k of the top-k attention mass the rule keeps constant. int >= 1.
        slope: divisor of ln(r); larger is gentler. float > 0.
        cap: upper bound of beta. float >= 1.
        enabled: False gives the frozen baseline (beta = 1 everywhere).

    Raises:
        ValueError: on non-finite, non-positive or inconsistent values, saying which field and what it got.
    """

    ref_keys: int = FAMILY_REF_KEYS[Family.DFLASH]
    top_k: int = DEFAULT_TOP_K
    slope: float = DEFAULT_SLOPE
    cap: float = DEFAULT_CAP
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if isinstance(self.ref_keys, bool) or not isinstance(self.ref_keys, int) or self.ref_keys <= self.top_k:
            raise ValueError(f"ref_keys must be an integer > top_k ({self.top_k}), got {self.ref_keys!r}")
        if not isinstance(self.slope, (int, float)) or not math.isfinite(self.slope) or self.slope <= 0:
            raise ValueError(f"slope must be a finite number > 0, got {self.slope!r}")
        if not isinstance(self.cap, (int, float)) or not math.isfinite(self.cap) or self.cap < 1:
            raise ValueError(f"cap must be a finite number >= 1, got {self.cap!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")

    @classmethod
    def for_family(cls, family: "Family | str", **overrides: Any) -> "QueryScaleProfile":
        """The preset for a drafter family (:class:`Family` or its name), with optional field overrides.

        Raises:
            ValueError: an unknown family, or an override out of range.
        """
        fields = {"ref_keys": FAMILY_REF_KEYS[Family.parse(family)],
                  **{k: v for k, v in overrides.items() if v is not None}}
        return cls(**fields)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QueryScaleProfile":
        """Build from a manifest / checkpoint dict; unknown keys raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown query-scale profile fields {sorted(unknown)}; expected a subset of {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "QueryScaleProfile":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def beta(self, num_keys):
        """beta for N = ``num_keys`` (int, float or array); 1 where the profile is disabled."""
        if not self.enabled:
            return np.ones_like(np.asarray(num_keys, dtype=np.float64)) if np.ndim(num_keys) else 1.0
        return beta(num_keys, ref_keys=self.ref_keys, top_k=self.top_k, slope=self.slope, cap=self.cap)

    def cap_reached_at(self) -> float:
        """The (real-valued) N at which beta first equals ``cap``: N = top_k + (ref - top_k) e^{slope (cap - 1)}."""
        return self.top_k + (self.ref_keys - self.top_k) * math.exp(self.slope * (self.cap - 1.0))


def beta(num_keys, *, ref_keys: int, top_k: int = DEFAULT_TOP_K, slope: float = DEFAULT_SLOPE,
         cap: float = DEFAULT_CAP):
    """beta(N) of SharpDraft (arXiv 2610.05106), computed in float64.

    Args:
        num_keys: N, visible keys per query: a Python number or an array of any shape (e.g. ``[batch, q_len]``).
        ref_keys, top_k, slope, cap: profile constants (see :class:`QueryScaleProfile`).

    Returns:
        float for scalar input, else a float64 ndarray of the same shape. 1.0 for N <= ref_keys.

    Raises:
        ValueError: if any N < 1.
    """
    n = np.asarray(num_keys, dtype=np.float64)
    if np.any(n < 1):
        raise ValueError(f"visible keys N must be >= 1, got min {n.min()}")
    r = np.maximum((n - top_k) / (ref_keys - top_k), 1.0)
    out = np.minimum(cap, 1.0 + np.log(r) / slope)
    return float(out) if out.ndim == 0 else out


def beta_torch(num_keys, profile: QueryScaleProfile):
    """Torch form of :func:`beta` (float32, differentiable-free), for drafter modules and kernel references.

    Args:
        num_keys: int64 or float tensor of any shape (e.g. ``[batch, 1, q_len, 1]``), or a Python int.
    Returns:
        float32 tensor of the same shape (a 0-d tensor for an int).
    """
    import torch

    n = torch.as_tensor(num_keys).to(torch.float32)
    if not profile.enabled:
        return torch.ones_like(n)
    r = torch.clamp((n - profile.top_k) / float(profile.ref_keys - profile.top_k), min=1.0)
    return torch.clamp(1.0 + torch.log(r) / float(profile.slope), max=float(profile.cap))


# ---------------------------------------------------------------------------------------------------------------
# N, the visible-key count (docs/design.md §1), and the per-row switch: every form of the rule counts N with these
# (the torch reference and kernel wrappers, transformers attention functions, the EAGLE-3 / PARD modules and the
# TensorRT-LLM hooks); the ONNX rewrite builds the same counts in-graph (export/rules/, tested against these).
# ---------------------------------------------------------------------------------------------------------------
def visible_keys(kv_lens, q_len: int, causal: bool, window: int | None = None):
    """N per (batch, query row) from key lengths: int64 ``[batch, q_len]`` torch tensor.

    Args:
        kv_lens: int ``[batch]`` keys per sequence (>= q_len when causal), a tensor or a sequence.
        q_len: query rows per sequence (a block, or 1 for a decode step).
        causal: row i sees ``kv_len - q_len + i + 1`` keys (verify blocks, causal drafters); else all ``kv_len``
            (DFlash blocks: every query of a block sees the whole context and block).
        window: a sliding-window layer's window W, anchored at each query's own position ``p_i = kv_len - q_len + i``
            (the queries are the last q_len positions): row i sees the keys at positions ``> p_i - W``, so
            N = min(N, W) when causal and min(kv_len, W + q_len - 1 - i) for a non-causal block (its later block
            keys included), as flash-attention's bottom-right aligned ``window_size=(W - 1, -1)`` and DFlash's
            sliding layers (runtime/models/dflash.py ``window_mask``).
    """
    import torch

    kv = torch.as_tensor(kv_lens).to(torch.int64)[:, None]
    rows = torch.arange(q_len, device=kv.device)[None]
    n = kv - q_len + rows + 1 if causal else kv.expand(-1, q_len)
    if window is None:
        return n
    return n.clamp(max=window) if causal else torch.minimum(n, window + q_len - 1 - rows)


def count_visible(visible):
    """N per query row from a boolean visibility mask ``[..., keys]`` (True = the row may attend to the key):
    float32 ``[..., 1]``, the form that broadcasts onto a query ``[batch, heads, q_len, head_dim]``."""
    return visible.to(__import__("torch").float32).sum(-1, keepdim=True)


def switch_rows(beta, row_switch):
    """The per-request on/off of the query scale: ``1 + (beta - 1) * switch`` with ``row_switch`` ``[batch]``
    (1 = scaled, 0 = frozen), broadcast over ``beta`` ``[batch, ...]``. None leaves ``beta`` as it is. The ONNX
    rewrite inserts the same arithmetic on its ``query_scale_enabled`` input."""
    if row_switch is None:
        return beta
    return 1.0 + (beta - 1.0) * row_switch.to(beta.device, beta.dtype).view(-1, *([1] * (beta.dim() - 1)))
