"""Speculative-decoding statistics, defined once.

Mean accepted length (MAL) = tokens committed per verify round = 1 + accepted draft tokens per round, the bonus
token included (vLLM's ``mean acceptance length``). Acceptance per draft position j = fraction of the rounds that
drafted token j (1-based) in which it was accepted (requests near max_new_tokens draft fewer tokens).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class SpecStats:
    num_draft_tokens_per_round: int = 0
    rounds: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0  # wall time after prefill (drafting + verifying + loop overhead)
    new_tokens: int = 0
    lookup_rounds: int = 0  # rounds whose draft was a prompt-lookup copy (runtime/prompt_lookup.py)
    lookup_accepted: int = 0  # draft tokens accepted in those rounds

    def record_round(self, num_accepted: int, num_drafted: int | None = None) -> None:
        """One speculative round: ``num_accepted`` of ``num_drafted`` draft tokens kept (rounds without drafts are
        target-only steps and are not recorded)."""
        k = self.num_draft_tokens_per_round if num_drafted is None else num_drafted
        width = max(k, self.num_draft_tokens_per_round)
        if len(self.accepted_per_position) < width:
            self.accepted_per_position += [0] * (width - len(self.accepted_per_position))
            self.drafted_per_position += [0] * (width - len(self.drafted_per_position))
        self.rounds += 1
        self.accepted += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
        for j in range(k):
            self.drafted_per_position[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """MAL, bonus included: 1 + accepted / rounds (0 when no round ran)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of the rounds that drafted position j (1-based j = index + 1) in which it was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time, prefill included."""
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {"mean_accepted_length": round(self.mean_accepted_length, 4) if self.rounds else None,
                "rounds": self.rounds,
                "accepted_draft_tokens": self.accepted, "num_draft_tokens_per_round": self.num_draft_tokens_per_round,
                "acceptance_per_position": [round(a, 4) for a in self.acceptance_per_position],
                "drafted_tokens": sum(self.drafted_per_position),
                "accepted_per_position": list(self.accepted_per_position),
                "drafted_per_position": list(self.drafted_per_position),
                "lookup_rounds": self.lookup_rounds, "lookup_accepted": self.lookup_accepted,
                "new_tokens": self.new_tokens, "tokens_per_s": round(self.tokens_per_s, 3),
                "prefill_s": round(self.prefill_s, 4), "draft_s": round(self.draft_s, 4),
                "verify_s": round(self.verify_s, 4), "decode_s": round(self.decode_s, 4)}
