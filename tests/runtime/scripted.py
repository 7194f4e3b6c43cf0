"""Test backends for the speculative loop (runtime/engine.py's duck-typed target and drafter interfaces).

- :class:`ScriptedTarget`: a target with a fixed logits table: the logits after token t are ``table[t]`` (a Markov
  chain), so every case can be computed by hand. Its features are the token ids themselves (F = 1), which lets a
  scripted drafter see exactly the committed tokens, as a real drafter sees their target features.
- :class:`ScriptedDrafter`: proposes ``propose(context_ids, bonus) -> logits [K, V_drafter]``.
- :func:`oracle` replays the target's greedy continuation; :func:`saboteur` is the oracle wrong at one slot.
- :class:`PaddedVocabDrafter` wraps any drafter and appends padding rows to its vocabulary (with a large bias).
"""
from __future__ import annotations

import numpy as np

from runtime.modes import DrafterContext, Verification


class TokenCache:
    """A cache that stores the token ids (scripted target) or context ids (scripted drafter) it covers."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} to {length}")
        del self.ids[length:]

    def fork(self) -> "TokenCache":
        new = TokenCache()
        new.ids = list(self.ids)
        return new


class ScriptedTarget:
    def __init__(self, table: np.ndarray, max_positions: int = 8192):
        self.table = np.asarray(table, np.float32)  # [V, V]: logits after token t
        self.vocab_size = self.table.shape[0]
        self.max_positions = max_positions
        self.calls: list[list[list[int]]] = []  # every forward's token rows (what reached verification)

    def new_cache(self) -> TokenCache:
        return TokenCache()

    def greedy(self, token: int, n: int) -> list[int]:
        """The greedy continuation of ``n`` tokens after ``token``."""
        out = []
        for _ in range(n):
            token = int(self.table[token].argmax())
            out.append(token)
        return out

    def forward(self, caches, tokens):
        self.calls.append([list(t) for t in tokens])
        q = max(len(t) for t in tokens)
        logits = np.zeros((len(tokens), q, self.vocab_size), np.float32)
        feats = np.zeros((len(tokens), q, 1), np.float32)
        for r, (c, row) in enumerate(zip(caches, tokens)):
            if c.length + len(row) > self.max_positions:
                raise ValueError("exceeds the target's positions")
            assert all(0 <= t < self.vocab_size for t in row), f"id outside the vocabulary reached the target: {row}"
            c.ids.extend(row)
            logits[r, : len(row)] = self.table[row]
            feats[r, : len(row), 0] = row
        return logits, feats


class ScriptedDrafter:
    verification = Verification.REJECTION
    context = DrafterContext.TARGET_FEATURES  # the engine's contexts; this drafter reads only their lengths
    query_scaled = False
    query_scale_switch = False

    def __init__(self, propose, num_draft_tokens: int, vocab_size: int, max_positions: int = 8192):
        self.propose = propose  # (context ids, bonus) -> logits [K, vocab_size]
        self.num_draft_tokens = num_draft_tokens
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.block_size = num_draft_tokens + 1

    def new_cache(self) -> TokenCache:
        return TokenCache()

    def can_draft(self, committed: int) -> bool:
        return committed + self.block_size <= self.max_positions

    def draft(self, caches, bonus_tokens, contexts, **kw):
        out = []
        for c, bonus, ctx in zip(caches, bonus_tokens, contexts):
            c.ids.extend(int(t) for t in ctx[:, 0])
            out.append(np.asarray(self.propose(list(c.ids), bonus), np.float32))
        return np.stack(out)


def one_hot_rows(tokens: list[int], vocab: int, scale: float = 10.0) -> np.ndarray:
    logits = np.zeros((len(tokens), vocab), np.float32)
    logits[np.arange(len(tokens)), tokens] = scale
    return logits


def oracle(target: ScriptedTarget, num_draft_tokens: int, wrong_at: int | None = None) -> ScriptedDrafter:
    """A drafter that proposes the target's greedy continuation (wrong at slot ``wrong_at`` if given)."""
    vocab = target.vocab_size

    def propose(_ctx, bonus):
        want = target.greedy(bonus, num_draft_tokens)
        if wrong_at is not None:
            want[wrong_at] = (want[wrong_at] + 1) % vocab
        return one_hot_rows(want, vocab)

    return ScriptedDrafter(propose, num_draft_tokens, vocab)


def saboteur(target: ScriptedTarget, num_draft_tokens: int, wrong_at: int) -> ScriptedDrafter:
    return oracle(target, num_draft_tokens, wrong_at)


class PaddedVocabDrafter:
    """Wraps a drafter: its logits get ``pad`` extra vocabulary rows, row ``bias_row`` (>= the real vocabulary)
    carrying ``bias`` (a drafter whose LM head is padded to a multiple of 128, with a bad bias on a padding row)."""

    def __init__(self, inner, pad: int, bias_row: int, bias: float = 1e4):
        self.inner, self.pad, self.bias_row, self.bias = inner, pad, bias_row, bias
        self.vocab_size = inner.vocab_size + pad

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, caches, bonus_tokens, contexts, **kw):
        logits = self.inner.draft(caches, bonus_tokens, contexts, **kw)
        extra = np.zeros((*logits.shape[:2], self.pad), np.float32)
        out = np.concatenate([logits, extra], axis=-1)
        out[..., self.bias_row] = self.bias
        return out
