"""Prompt lookup (n-gram) drafts beside the model drafter: copy what followed the last occurrence of the suffix.

A small drafter cannot copy from a long context: on the default pair a reply that repeats an identifier of the
prompt, quotes a line of the document or loops ("The murdering ones were the murdering ones.") is drafted with
slot-1 acceptance near 0.3 (docs/drafter-quality.md). Prompt lookup decoding (Saxena 2023; Hugging Face
transformers' ``prompt_lookup_num_tokens``; vLLM's ``method="ngram"``) drafts those spans for free: find the latest
earlier occurrence of the last n committed tokens (n from ``max_ngram`` down to ``min_ngram``) and propose the
tokens that followed it. Combining it with a model drafter per round follows Arctic Inference's suffix decoding
hybrid: where a match exists, its copy is verified instead of the model's draft (and the model's call is skipped);
elsewhere the model drafts as before. Either way the target verifies, so the loop stays lossless.

The index is incremental: each committed token adds one entry per n (a dict from the n-gram to the position after
its latest occurrence), so a lookup costs O(max_ngram) per round at any context length.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Settings of the n-gram proposer (one per engine).

    Attributes:
        min_ngram: shortest suffix that may match (>= 1); shorter matches are more often wrong.
        max_ngram: longest suffix tried first (>= min_ngram).
        num_tokens: most tokens proposed per round (the verify block is 1 + this).
    """

    min_ngram: int = 3
    max_ngram: int = 5
    num_tokens: int = 7

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup: need 1 <= min_ngram ({self.min_ngram}) <= max_ngram "
                             f"({self.max_ngram})")
        if self.num_tokens < 1:
            raise ValueError(f"prompt lookup: num_tokens must be >= 1, got {self.num_tokens}")

    @classmethod
    def parse(cls, spec: str) -> "PromptLookup":
        """``"MIN:MAX:TOKENS"`` (e.g. ``"3:5:7"``), ``"MIN:TOKENS"`` (max = min + 2) or ``"MIN"``.

        Raises:
            ValueError: not 1-3 colon-separated integers, or values out of range (the message says which).
        """
        try:
            parts = [int(p) for p in spec.split(":")]
        except ValueError:
            raise ValueError(f"prompt lookup {spec!r}: expected MIN[:MAX]:TOKENS integers, e.g. '3:5:7'") from None
        if len(parts) == 1:
            return cls(parts[0], parts[0] + 2)
        if len(parts) == 2:
            return cls(parts[0], parts[0] + 2, parts[1])
        if len(parts) == 3:
            return cls(*parts)
        raise ValueError(f"prompt lookup {spec!r}: expected MIN[:MAX]:TOKENS integers, e.g. '3:5:7'")

    @property
    def spec(self) -> str:
        """The ``MIN:MAX:TOKENS`` form :meth:`parse` reads."""
        return f"{self.min_ngram}:{self.max_ngram}:{self.num_tokens}"

    def new_index(self) -> "NgramIndex":
        return NgramIndex(self)


class NgramIndex:
    """Per-sequence index of the n-grams of ``tokens`` (prompt ids + emitted ids), grown as tokens commit."""

    def __init__(self, cfg: PromptLookup):
        self.cfg = cfg
        self._tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(cfg.min_ngram, cfg.max_ngram + 1)}
        self._indexed = 0  # n-grams ending before this position (continuation start < it) are in the tables

    def propose(self, tokens: list[int], max_tokens: int | None = None) -> tuple[list[int], int]:
        """Draft tokens that continue ``tokens`` by copying what followed the latest earlier occurrence of its
        longest matching suffix.

        Args:
            tokens: the sequence so far (prompt + emitted, the pending bonus last); only ever extended between calls.
            max_tokens: cap below ``num_tokens`` (e.g. the tokens left before max_new_tokens).
        Returns:
            (draft ids, matched n); ``([], 0)`` when no suffix of ``min_ngram``..``max_ngram`` tokens occurred
            before. A match close to the end continues periodically (a loop of period p shorter than the draft is
            copied p by p).
        """
        n_tok = len(tokens)
        if n_tok < self._indexed:
            raise ValueError("prompt lookup: the token list shrank; build a new index for a new sequence")
        for end in range(self._indexed, n_tok):  # continuation start `end` < n_tok: the suffix itself is excluded
            for n, table in self._tables.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        self._indexed = n_tok
        k = self.cfg.num_tokens if max_tokens is None else min(max_tokens, self.cfg.num_tokens)
        if k <= 0:
            return [], 0
        for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
            if n_tok < n:
                continue
            start = self._tables[n].get(tuple(tokens[n_tok - n:]))
            if start is not None:
                out: list[int] = []
                for i in range(k):
                    pos = start + i
                    out.append(tokens[pos] if pos < n_tok else out[pos - n_tok])
                return out, n
        return [], 0


DEFAULT_SPEC = "3:5:7"  # runtime.generate / runtime.serve default: docs/quantized-target.md, runs F and G


def click_option(help: str, default: str | None = None):
    """The ``--prompt-lookup MIN[:MAX]:TOKENS|off`` option of runtime.generate, runtime.serve and the scripts.

    The command receives a :class:`PromptLookup`, or ``None`` for ``off`` (and when the option is absent and
    ``default`` is None); a bad spec ends as click's usage error naming the option (exit status 2), before the
    command's body reads any engine folder.
    """
    import click

    def to_lookup(ctx, param, value):
        if value is None or value.strip().lower() in ("off", "none", "0"):
            return None
        try:
            return PromptLookup.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return click.option("--prompt-lookup", default=default, show_default=default is not None,
                        metavar="MIN[:MAX]:TOKENS|off", callback=to_lookup, help=help)
