"""The lossless greedy draft -> verify -> commit loop over an engines/ folder (DFlash family).

One round at committed length s (tokens whose K/V are in the target cache) with pending bonus token x_s:
  1. draft: the drafter sees the target features of positions it has not cached yet and the block
     [x_s, MASK x (B-1)] at positions s .. s+B-1, and returns B-1 draft tokens d_1..d_{B-1};
  2. verify: the target runs [x_s, d_1 .. d_{B-1}] in one pass; p_j = argmax of its logits at slot j;
  3. accept the longest prefix with d_{j+1} == p_j (a tokens); commit x_s, d_1..d_a; the new bonus is p_a;
     roll the target cache back to s + a + 1; the features of the a + 1 committed positions feed the next draft.
Because every emitted token is the target's own argmax given the committed prefix, the output equals target-only
greedy decoding token for token (DFlash, arXiv 2602.06036, §3; Leviathan et al. 2023, arXiv 2211.17192).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from runtime.manifest import load_manifest
from runtime.metrics import SpecStats
from runtime.ort_engines import OrtDFlashDrafter, OrtTarget


class InvariantError(AssertionError):
    """A loop invariant of design.md §5 broke (a bug, never user error)."""


@dataclasses.dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens only, stop token included when it ended generation
    finish_reason: str  # "stop" (EOS / stop token) or "length" (max_new_tokens)
    stats: SpecStats


class SpecEngine:
    """Target + drafter engines of one engines/ folder and the greedy speculative loop (batch 1)."""

    def __init__(self, engine_dir: str | Path, device: str = "auto", threads: int | None = None,
                 check_invariants: bool = False, verify_checksums: bool = True):
        self.engine_dir = Path(engine_dir)
        self.manifest = load_manifest(self.engine_dir, verify_checksums=verify_checksums)
        self.target = OrtTarget(self.engine_dir, self.manifest, device, threads)
        self.drafter = OrtDFlashDrafter(self.engine_dir, self.manifest, device, threads)
        self.eos_token_ids = set(self.manifest["tokenizer"]["eos_token_ids"])
        self.check_invariants = check_invariants
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.engine_dir / self.manifest["tokenizer"]["dir"])
        return self._tokenizer

    @property
    def max_positions(self) -> int:
        return self.target.max_positions

    def _check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.manifest["target"]["vocab_size"]
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(prompt_ids)}..{max(prompt_ids)}")
        if len(prompt_ids) + max_new_tokens > self.max_positions:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"target's {self.max_positions} positions; shorten the prompt or lower max_new_tokens")

    def _prefill(self, prompt_ids: list[int], stats: SpecStats) -> tuple[int, np.ndarray]:
        self.target.reset()
        self.drafter.reset()
        t0 = time.perf_counter()
        logits, taps = self.target.forward(np.asarray([prompt_ids], np.int64))
        stats.prefill_s = time.perf_counter() - t0
        return int(logits[0, -1].argmax()), taps

    def _target_step(self, token: int) -> int:
        """One target decode step on ``token``; returns the target's greedy next token."""
        logits, _ = self.target.forward(np.asarray([[token]], np.int64))
        return int(logits[0, -1].argmax())

    def generate_target_only(self, prompt_ids: list[int], max_new_tokens: int) -> GenerationResult:
        """Plain greedy decoding with the target engine (the baseline and the lossless reference)."""
        self._check_prompt(prompt_ids, max_new_tokens)
        stats = SpecStats()
        token, _ = self._prefill(prompt_ids, stats)
        out = [token]
        t0 = time.perf_counter()
        while len(out) < max_new_tokens and token not in self.eos_token_ids:
            token = self._target_step(token)
            out.append(token)
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        return GenerationResult(out, "stop" if out[-1] in self.eos_token_ids else "length", stats)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, speculative: bool = True) -> GenerationResult:
        """Greedy speculative generation; output ids equal :meth:`generate_target_only` (lossless).

        Args:
            prompt_ids: prompt token ids (non-empty, within the target vocabulary).
            max_new_tokens: exact cap on generated tokens (>= 1).
            speculative: False runs target-only decoding.
        Raises:
            ValueError: empty prompt, bad ids, max_new_tokens < 1, prompt + max_new_tokens over the target limit.
        """
        if not speculative:
            return self.generate_target_only(prompt_ids, max_new_tokens)
        self._check_prompt(prompt_ids, max_new_tokens)
        block = self.drafter.block_size
        stats = SpecStats(num_draft_tokens_per_round=block - 1)
        bonus, ctx = self._prefill(prompt_ids, stats)
        out = [bonus]
        t0 = time.perf_counter()
        while len(out) < max_new_tokens and out[-1] not in self.eos_token_ids:
            s = self.target.kv_len
            if s + block > min(self.drafter.max_positions, self.max_positions):
                # Past the drafter's (or the target's) positions: finish target-only, still exact.
                bonus = self._target_step(bonus)
                out.append(bonus)
                continue
            t1 = time.perf_counter()
            drafts = self.drafter.draft(bonus, ctx).argmax(-1)
            t2 = time.perf_counter()
            logits, taps = self.target.forward(np.asarray([[bonus, *drafts.tolist()]], np.int64))
            stats.verify_s += time.perf_counter() - t2
            stats.draft_s += t2 - t1
            posterior = logits[0].argmax(-1)  # [B]: target's choice after each block slot
            matches = drafts == posterior[:-1]
            a = int(matches.argmin()) if not matches.all() else block - 1
            stats.record_round(a)
            # Emit d_1..d_a and the new bonus p_a, cut at a stop token / max_new_tokens; keep in the target cache
            # exactly the committed tokens (x_s plus the emitted ones but the new pending bonus).
            kept = _append_until_stop(out, [*drafts[:a].tolist(), int(posterior[a])], self.eos_token_ids,
                                      max_new_tokens)
            n_new = len(kept) - len(out)
            self.target.truncate(s + n_new)
            ctx = taps[:, :n_new]
            out, bonus = kept, kept[-1]
            if self.check_invariants:
                self._check_round(len(prompt_ids), out, ctx)
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        reason = "stop" if out[-1] in self.eos_token_ids else "length"
        return GenerationResult(out, reason, stats)

    def _check_round(self, prompt_len: int, out: list[int], ctx: np.ndarray) -> None:
        """Invariants after every round (design.md §5)."""
        committed = prompt_len + len(out) - 1  # every emitted token but the pending bonus has its K/V cached
        if self.target.kv_len != committed:
            raise InvariantError(f"target KV length {self.target.kv_len} != committed tokens {committed}")
        if self.drafter.kv_len + ctx.shape[1] != committed:
            raise InvariantError(f"drafter cache {self.drafter.kv_len} + pending context {ctx.shape[1]} != "
                                 f"committed tokens {committed}: positions not contiguous")
        if self.drafter.kv_len >= committed:
            raise InvariantError("drafter cache holds keys beyond the verified context")


def _append_until_stop(out: list[int], new: list[int], stop_ids: set[int], max_new_tokens: int) -> list[int]:
    """``out`` + ``new``, cut after the first stop token in ``new`` or at max_new_tokens, whichever comes first.

    Only ``new`` is scanned: ``out`` never holds a stop token (the loop ends on one).
    Example: out=[5], new=[7, 2, 9], stop={2}, max 10 -> [5, 7, 2]; max 2 -> [5, 7].
    """
    kept = list(out)
    for tok in new:
        if len(kept) >= max_new_tokens:
            break
        kept.append(tok)
        if tok in stop_ids:
            break
    return kept
