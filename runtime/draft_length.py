"""How many draft tokens each row verifies per round, by load and by recent acceptance.

Speculation pays while the verify pass is cheap; as a batch fills, verifying k extra tokens per row costs real
compute, so engines pick k by load. Two policies, both lossless (k only changes speed, never the output):

- :class:`DraftTokensByBatch`: a table from the number of rows in a step to k, as vLLM's per-batch-size draft
  length; ``"1-2:7,3-4:3,5-:0"`` = 7 draft tokens for 1-2 running rows, 3 for 3-4, none (target-only) from 5 on.
- :class:`AdaptiveDraftTokens`: per request, the schedule of Hugging Face transformers' assisted generation
  (``num_assistant_tokens_schedule="heuristic"``): after a round whose drafts were all accepted k grows by 2, after
  one with a rejection it shrinks by 1, within [1, the request's maximum].

A request that sets ``num_draft_tokens`` itself keeps it under either policy.
"""
from __future__ import annotations

import dataclasses
import re

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
