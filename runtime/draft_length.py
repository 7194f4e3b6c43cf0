"""How many draft tokens each row verifies per round, by load and by recent acceptance.

Speculation pays while the verify pass is cheap; as a batch fills, verifying k extra tokens per row costs real
compute, so engines pick k by load. Two policies, both lossless (k only changes speed, never the output):

- :class:`DraftTokensByBatch`: a table from the number of rows in a step to k, as vLLM's per-batch-size draft
  length; ``"1-2:7,3-4:3,5-:0"`` = 7 draft tokens for 1-2 running rows, 3 for 3-4, none (target-only) from 5 on.
- :class:`AdaptiveDraftTokens`: per request, the schedule of Hugging Face transformers' assisted generation
  (``num_assistant_tokens_schedule="heuristic"``): after a round whose drafts were all accepted k grows by 2, after
  one with a rejection it shrinks by 1, within [1, the request's maximum].
- :class:`DraftCost`: per round and row, the length with the most expected tokens per second: the drafter's
  top-1 probabilities estimate acceptance, and the round's cost in k is fitted to this run's own timings.
- :class:`DraftConfidence`: per round and row, from the drafter's own confidence: verify the leading draft tokens
  while the product of the drafter's top-1 probabilities stays at or above a threshold (at least one). A draft's
  top-1 probability is a calibrated estimate of its acceptance (measured on the demo pair, docs/performance), so
  the product estimates the chance that the whole prefix is accepted, as EAGLE-2 ranks draft-tree nodes (arXiv
  2406.16858, §4); transformers' ``assistant_confidence_threshold`` applies a per-token form of the same stop.
  Drafters that draft a block in one pass (DFlash, PARD) pay the same draft cost for any k, so only the verify
  block shrinks or grows.

A request that sets ``num_draft_tokens`` itself keeps it under either policy. :class:`DraftLengthPolicy` combines
them into each row's k per round (what runtime/engine.py's proposer asks).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d*)\s*)?:\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class DraftTokensByBatch:
    """Draft tokens per round by batch size: ``ranges`` = ((first, last or None = no bound, k), ...), sorted."""

    ranges: tuple[tuple[int, int | None, int], ...]

    @classmethod
    def parse(cls, spec: str) -> "DraftTokensByBatch":
        """Parse ``"1-2:7,3-4:3,5-:0"`` (``a-b:k``, ``a-:k`` open-ended, ``a:k`` a single size).

        Raises:
            ValueError: bad syntax, overlapping or unsorted ranges, or a gap (every batch size from 1 up must be
                covered), with the offending part named.
        """
        ranges = []
        for part in spec.split(","):
            m = _RANGE.match(part)
            if not m:
                raise ValueError(f"draft tokens by batch: {part!r} is not 'first-last:k', 'first-:k' or 'size:k' "
                                 "(e.g. '1-2:7,3-4:3,5-:0')")
            first, last, k = int(m.group(1)), m.group(2), int(m.group(3))
            last = first if last is None else (int(last) if last else None)
            if first < 1 or (last is not None and last < first):
                raise ValueError(f"draft tokens by batch: {part.strip()!r} is an empty or non-positive range")
            ranges.append((first, last, k))
        expected = 1
        for first, last, _ in ranges:
            if expected is None or first != expected:
                raise ValueError(f"draft tokens by batch: ranges must cover every batch size from 1 in order "
                                 f"without overlap; {spec!r} does not (next size expected: {expected})")
            expected = None if last is None else last + 1
        if expected is not None:
            raise ValueError(f"draft tokens by batch: the last range must be open-ended ('{expected}-:k'), so every "
                             "batch size has a draft length")
        return cls(tuple(ranges))

    def __call__(self, batch_size: int) -> int:
        """k for a step of ``batch_size`` rows."""
        for first, last, k in self.ranges:
            if first <= batch_size and (last is None or batch_size <= last):
                return k
        raise AssertionError("unreachable: parse() checked the ranges cover every size")

    def __str__(self) -> str:
        return ",".join(f"{a}-{'' if b is None else b}:{k}" if b != a else f"{a}:{k}" for a, b, k in self.ranges)


@dataclasses.dataclass
class AdaptiveDraftTokens:
    """Per-request draft length: +2 after an all-accepted round, -1 after a rejection, in [1, ``k_max``].

    Attributes:
        k_max: the request's maximum (its default or the batch table's value).
        k: the next round's draft length (starts at ``k_max``).
    """

    k_max: int
    k: int = -1

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = self.k_max

    def update(self, drafted: int, accepted: int) -> None:
        """After a round that verified ``drafted`` tokens of which ``accepted`` were accepted."""
        if drafted <= 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)


# runtime.generate / runtime.serve default: off; measured on the 2-core CPU it raised MAL but not speed
# (docs/performance/README.md, "Draft length by confidence")
DEFAULT_CONFIDENCE = None


@dataclasses.dataclass(frozen=True)
class DraftConfidence:
    """Verify the longest draft prefix whose cumulative drafter confidence stays >= ``threshold`` (at least 1).

    Attributes:
        threshold: in (0, 1]; higher verifies fewer tokens per round (docs/performance/README.md, "Draft length
            by confidence": 0.3 was the best measured on the 2-core CPU, within noise of a fixed 2).
    """

    threshold: float

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"draft confidence threshold must be in (0, 1], got {self.threshold}; "
                             "use 'off' to verify a fixed number of draft tokens")

    @classmethod
    def parse(cls, spec: "str | float | None") -> "DraftConfidence | DraftCost | None":
        """``"0.4"`` -> DraftConfidence(0.4); ``"cost"`` -> a fresh :class:`DraftCost`; ``"off"``, ``"0"``, ``None``
        -> None.

        Raises:
            ValueError: not a number in (0, 1] or "off".
        """
        if spec is None or str(spec).strip().lower() in ("off", "none", "0", "0.0"):
            return None
        if str(spec).strip().lower() == "cost":
            return DraftCost()
        try:
            value = float(spec)
        except ValueError:
            raise ValueError(f"draft confidence: {spec!r} is not a threshold in (0, 1], 'cost' or 'off'") from None
        return cls(value)

    def length(self, top1: np.ndarray) -> int:
        """Draft tokens to verify given the drafter's top-1 probabilities ``[k_max]`` (float, slot order).

        Returns:
            the largest j in [1, k_max] with prod(top1[:j]) >= threshold, or 1 when none is (k_max >= 1).
        """
        top1 = np.asarray(top1, np.float64)
        if top1.size == 0:
            return 0
        return max(1, int(np.count_nonzero(np.cumprod(top1) >= self.threshold)))


@dataclasses.dataclass(eq=False)  # one fit per engine: hashed by identity
class DraftCost:
    """Verify the draft length that maximises expected tokens per second under the round cost measured in this run.

    Expected tokens of a round that verifies k drafts: ``1 + sum_{i<=k} prod_{j<=i} p_j`` with ``p_j`` the drafter's
    top-1 probabilities (the bonus token always comes; :class:`DraftConfidence` uses the same estimate). A round's
    seconds: ``a + b k`` (draft call + verify block; the block's extra rows cost compute, docs/round-cost.md), fitted
    by exponentially weighted least squares over the engine's recent single-row rounds (:meth:`observe`; ``decay``
    per round, so the fit follows the context as it grows). Until two different k have been seen, b is taken as
    ``prior_per_token`` x a (0.2: the verify block's extra row over the round at 512-1k on the 2-core CPUs,
    docs/round-cost.md). k is chosen in 1..k_max per row and round.

    Attributes:
        decay: weight kept by past rounds per new round, in (0, 1).
        prior_per_token: b / a before the fit has two distinct k.
    """

    decay: float = 0.95
    prior_per_token: float = 0.2
    _sums: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(5), repr=False)  # w, wk, wkk, wt, wkt

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0 or self.prior_per_token < 0:
            raise ValueError(f"draft cost: decay must be in (0, 1) and prior_per_token >= 0, got {self.decay}, "
                             f"{self.prior_per_token}")

    def observe(self, k: int, seconds: float) -> None:
        """A single-row round that verified ``k`` draft tokens took ``seconds`` (draft + verify)."""
        if k > 0 and seconds > 0:
            self._sums *= self.decay
            self._sums += (1.0, k, k * k, seconds, k * seconds)

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) seconds of the fitted ``a + b k``; None before any round was observed."""
        w, wk, wkk, wt, wkt = self._sums
        if w <= 0:
            return None
        var = wkk / w - (wk / w) ** 2
        if var > 1e-3:  # two or more distinct k: least squares
            b = (wkt / w - (wk / w) * (wt / w)) / var
            a = wt / w - b * wk / w
            if a > 0 and b >= 0:
                return a, b
        k_mean = wk / w
        a = (wt / w) / (1.0 + self.prior_per_token * k_mean)
        return a, self.prior_per_token * a

    def length(self, top1: np.ndarray) -> int:
        """Draft tokens to verify given the drafter's top-1 probabilities ``[k_max]`` (float, slot order): the k in
        [1, k_max] with the most expected tokens per second (the longest when nothing was observed yet)."""
        top1 = np.asarray(top1, np.float64)
        if top1.size == 0:
            return 0
        ab = self.coefficients()
        if ab is None:
            return int(top1.size)
        a, b = ab
        ks = np.arange(1, top1.size + 1)
        rate = (1.0 + np.cumsum(np.cumprod(top1))) / (a + b * ks)
        return int(ks[int(np.argmax(rate))])


def top1_probabilities(logits: np.ndarray, support: np.ndarray | None = None) -> np.ndarray:
    """Softmax probability of each row's most likely token.

    Args:
        logits: ``[k, vocab]`` float (``-inf`` allowed outside the drafter's vocabulary).
        support: optional int64 ``[V]`` ids holding every finite logit (a draft vocabulary,
            runtime/draft_vocab.py); the softmax then reads only those columns (7 x 8,192 instead of 7 x 49,152).
    Returns:
        float64 ``[k]`` in (0, 1].
    """
    x = np.asarray(logits)
    if support is not None:
        x = np.take(x, support, axis=-1)
    x = x.astype(np.float64, copy=False)
    m = x.max(axis=-1, keepdims=True)
    return 1.0 / np.exp(x - m).sum(axis=-1)


@dataclasses.dataclass(frozen=True)
class DraftLengthPolicy:
    """Per round and row, how many draft tokens the loop verifies (before prompt lookup and the confidence cut).

    The request's own ``num_draft_tokens`` wins; else ``by_batch`` (k by the step's rows, capped at the drafter's
    ``k_max``); else, with ``confidence``, the drafter's ``k_max`` as the ceiling the confidence cut lowers; else the
    row's default. An :class:`AdaptiveDraftTokens` row lowers it further; a row never drafts past its
    max_new_tokens (one token is the target's own).

    Attributes:
        k_max: draft tokens the drafter drafts per round (K); 0 without a drafter.
        by_batch: k by the number of rows in a step; None = each row's default at any load.
        confidence: the per-round cut (:class:`DraftConfidence` or :class:`DraftCost`); None = a fixed k.
    """

    k_max: int
    by_batch: DraftTokensByBatch | None = None
    confidence: DraftConfidence | None = None

    def by_load(self, rows: int) -> int | None:
        """k for a step of ``rows`` rows from ``by_batch`` (capped at ``k_max``); None without a table or drafter."""
        if self.by_batch is None or self.k_max <= 0:
            return None
        return min(self.by_batch(rows), self.k_max)

    def row(self, k: int, request_k: int | None, remaining: int, by_load: int | None,
            adaptive: AdaptiveDraftTokens | None) -> int:
        """k for one row this round.

        Args:
            k: the row's draft length (0: the row does not speculate).
            request_k: the request's own num_draft_tokens, or None.
            remaining: tokens the row may still emit (>= 1).
            by_load: :meth:`by_load` of this step.
            adaptive: the row's acceptance-driven length, if any.
        """
        if k > 0 and by_load is not None and request_k is None:  # the request's own k wins
            k = by_load
        elif k > 0 and self.confidence is not None and request_k is None:
            k = self.k_max  # the ceiling; the drafter's confidence cuts it below
        if k > 0 and adaptive is not None:
            k = min(k, adaptive.k)
        return min(k, remaining - 1)

    @staticmethod
    def lookup_cap(remaining: int, by_load: int | None) -> int:
        """Most tokens a prompt-lookup copy may propose for a row that may still emit ``remaining`` tokens."""
        return min(remaining - 1, by_load if by_load is not None else 1 << 30)


def click_option(default: str | None = None):
    """The ``--draft-confidence T|off`` option of runtime.generate, runtime.serve and the scripts; the command
    receives a :class:`DraftConfidence` or None. A bad value is click's usage error naming the option."""
    import click

    def to_policy(ctx, param, value):
        try:
            return DraftConfidence.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return click.option(
        "--draft-confidence", default=default, show_default=default is not None, metavar="T|cost|off",
        callback=to_policy,
        help="verify the leading draft tokens while the product of the drafter's top-1 probabilities stays >= T "
             "(at least 1; up to the request's or the drafter's maximum); 'cost': the length with the most expected "
             "tokens per second under the round cost measured as it runs; 'off': a fixed number per round "
             "(runtime/draft_length.py)")
