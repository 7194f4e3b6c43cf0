"""Sampling parameters, logits processors and lossless verification of draft tokens, defined once.

Everything that turns logits into tokens goes through this module, for drafting, verification and the bonus token
alike, so the three can never disagree:

- **greedy** is ``temperature < GREEDY_EPS`` (:func:`is_greedy`, vLLM's ``_SAMPLING_EPS``). A greedy row takes the
  argmax everywhere (draft tokens, verification, bonus) and never touches its random stream; its top-k / top-p are
  irrelevant (the argmax survives both).
- **processed distribution** of a sampled row: logits (float32) -> float64 -> ``/ temperature`` -> top-k -> softmax
  -> top-p -> renormalise (:func:`process_logits`; the order vLLM and HF use). Draft tokens are drawn from exactly
  the q this returns for the drafter's logits, and the acceptance test uses that same float64 q.
- **verification** of k draft tokens against the target's k + 1 logit rows (:func:`verify`), two lossless schemes:

  ``rejection`` (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318): d_j ~ q_j is kept
  with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected slot emits a sample of
  norm(max(0, p_j - q_j)); if all k are kept the bonus is a sample of p_k. Every emitted token is distributed as
  the target's processed p given the committed prefix. A DFlash block drafts all slots from one forward, so q_j
  does not depend on d_1..d_{j-1}; d_j is still drawn from q_j independently of the earlier draws, which is all
  the proof needs.

  ``exact_match`` (the scheme of the DFlash reference code, which samples a "posterior" token from the target at
  each block slot): the target samples y_j ~ p_j at each slot; d_j is kept while d_j == y_j, the first mismatch
  emits y_j. Lossless for any draft tokens (we draft
  the argmax of q), but it accepts with probability p_j(d_j) instead of sum_x min(p_j(x), q_j(x)).

  sharpdraft uses ``rejection`` for every family: all of them expose the drafter's full logits, and
  sum_x min(p, q) >= p(argmax q) whenever q is close to p. Both are tested (tests/runtime/test_sampling.py) and
  measured side by side on the default pair (README, "Sampled generation").

Random streams: one ``numpy.random.Generator`` (PCG64) per request, seeded from the request's seed, or from fresh
OS entropy when it has none (independent streams). A row draws only from its own stream, so batching never changes
a seeded request's random numbers.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1  # a request's seed: signed 64-bit, as OpenAI and vLLM accept

from runtime.modes import Verification

GREEDY_EPS = 1e-5  # temperature below this is greedy (one definition for drafting, verification and bonus)
VERIFICATION_SCHEMES = tuple(Verification)
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat top_logprobs limit, vLLM's default)


def is_greedy(temperature: float) -> bool:
    """True when ``temperature`` (>= 0) means greedy decoding: ``temperature < GREEDY_EPS``."""
    return temperature < GREEDY_EPS


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI / vLLM names).

    Attributes:
        max_new_tokens: exact cap on generated tokens (>= 1).
        temperature: >= 0; below ``GREEDY_EPS`` is greedy.
        top_k: keep the k most likely tokens; 0 or -1 = off.
        top_p: nucleus mass in (0, 1]; 1 = off.
        seed: seed of this request's random stream; None = fresh entropy.
        stop_token_ids: token ids that end generation (the stop token is returned and counted), in addition to the
            tokenizer's EOS ids unless ``ignore_eos``.
        stop: strings that end generation when they appear in the generated text (the text is cut before the
            string; the token that completed it is returned and counted).
        ignore_eos: do not stop at the EOS ids (stop_token_ids still apply).
        speculative: False decodes target-only (the A/B baseline).
        num_draft_tokens: draft tokens per round for this request, 0..the drafter's maximum; None = the engine's
            default (the manifest's verify_draft_tokens, else the maximum).
        query_scale: False drafts this request with the query scale switched off (beta = 1, the frozen drafter),
            for A/B comparisons; needs an engines folder exported with the per-row switch.
        logprobs: None = no log-probabilities; n in 0..``MAX_LOGPROBS`` = each generated token's log-probability
            under the target's processed distribution (:func:`processed_logprobs`) and the n most likely
            alternatives (OpenAI ``logprobs`` / ``top_logprobs``).
        prompt_logprobs: as ``logprobs``, for the prompt's tokens 1..n-1 (vLLM's name; OpenAI completions'
            ``echo`` with ``logprobs``): how likely the target finds each prompt token after the ones before it.
    Raises:
        ValueError: any field out of range, with what to send instead.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True
    num_draft_tokens: int | None = None
    query_scale: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= 1, or 0 / -1 to disable it, got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            bad(f"top_p must be in (0, 1] (1 disables it), got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad(f"seed must be an integer in [-2**63, 2**63 - 1] (a signed 64-bit seed, as OpenAI and vLLM take) "
                f"or None, got {self.seed!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        k = self.num_draft_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            bad(f"num_draft_tokens must be an integer >= 0 or None, got {k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in 0..{MAX_LOGPROBS} (alternatives per token) or None, got {n!r}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    def make_rng(self) -> np.random.Generator:
        """This request's random stream: PCG64 from ``seed`` taken modulo 2**64 (a negative seed s and s + 2**64
        name one stream; seeds 0..2**63 - 1 are PCG64's own), or from OS entropy when ``seed`` is None."""
        return np.random.Generator(np.random.PCG64(None if self.seed is None else self.seed % 2 ** 64))


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice ``i`` of a request with ``n`` > 1 choices: ``seed + i``, wrapped into the signed 64-bit
    range (``2**63 - 1`` + 1 is ``-2**63``), so every choice of a valid seed is a valid seed and choice ``i`` equals
    an ``n: 1`` request sent with that seed. None stays None (fresh entropy per choice)."""
    return None if seed is None else (seed + i - SEED_MIN) % 2 ** 64 + SEED_MIN


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The processed distribution of a sampled row: temperature, top-k, softmax, top-p, renormalise.

    Args:
        logits: ``[..., vocab]`` float (float32 from the engines); must be finite where it matters (-inf allowed).
        params: a non-greedy :class:`SamplingParams` (greedy rows never need probabilities).
    Returns:
        float64 probabilities ``[..., vocab]`` summing to 1 on the last axis; exactly 0 outside top-k / top-p.
        Ties at the k-th logit keep every tied token (as vLLM does). top-p keeps the smallest prefix of tokens
        sorted by probability whose mass reaches top_p (the first token always).
    Raises:
        ValueError: ``params`` is greedy.
    """
    if params.greedy:
        raise ValueError("process_logits is for sampled rows; greedy rows use the argmax")
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(x, vocab - params.top_k, axis=-1)[..., vocab - params.top_k: vocab - params.top_k + 1]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def processed_logprobs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Log-probabilities of the distribution a row's token is drawn from, float64 ``[..., vocab]``.

    Sampled rows: log of :func:`process_logits` (temperature, top-k, top-p applied; -inf outside them), the
    distribution the verifier keeps (vLLM's ``logprobs_mode="processed_logprobs"``). Greedy rows have no sampling
    distribution: their values are the log-softmax of the raw logits (temperature 1), whose argmax is the token
    emitted, as vLLM reports for temperature 0. Speculation on or off gives the same values: they come from the
    target's logits at each emitted position, whichever round produced them.
    """
    if params.greedy:
        x = np.asarray(logits, dtype=np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    with np.errstate(divide="ignore"):
        return np.log(process_logits(logits, params))


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and the ``n`` most likely alternatives at its position
    (``top``: ``((token id, logprob), ...)``, most likely first; ties by lower id)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


LOGPROB_FLOOR = -9999.0  # what a token of zero processed probability reports (OpenAI's floor): JSON has no -inf


def token_logprob(logits: np.ndarray, token_id: int, params: SamplingParams) -> TokenLogprob:
    """:class:`TokenLogprob` of ``token_id`` under the processed distribution of ``logits`` ``[vocab]``, with up to
    ``params.logprobs`` alternatives; every value finite, so that it can be sent as JSON.

    Sampled rows with ``top_k`` / ``top_p`` give the tokens they cut probability 0: those are left out of ``top``
    (which then holds fewer than ``params.logprobs`` entries, as vLLM does for processed logprobs), and if
    ``token_id`` itself is one of them (a prompt token scored by ``prompt_logprobs``, never a sampled one) its
    logprob is ``LOGPROB_FLOOR`` (-9999.0, OpenAI's value for such tokens), not -inf.
    """
    lp = processed_logprobs(logits, params)
    n = params.logprobs or 0
    top = ()
    if n:
        idx = np.argpartition(-lp, n - 1)[:n]
        idx = idx[np.lexsort((idx, -lp[idx]))]
        top = tuple((int(i), float(lp[i])) for i in idx if np.isfinite(lp[i]))
    value = float(lp[token_id])
    return TokenLogprob(int(token_id), value if np.isfinite(value) else LOGPROB_FLOOR, top)


def sample_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs`` [vocab] (float64, sums to > 0) by inverse CDF; zero-probability ids are never drawn."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def argmax(logits: np.ndarray) -> int:
    """The greedy token of ``logits`` [vocab] (first index on ties, like torch and numpy)."""
    return int(np.argmax(logits))


@dataclasses.dataclass(slots=True)
class RowSampler:
    """Sampling state of one request: its parameters and its random stream."""

    params: SamplingParams
    rng: np.random.Generator

    @classmethod
    def for_request(cls, params: SamplingParams) -> "RowSampler":
        return cls(params, params.make_rng())

    def next_token(self, logits: np.ndarray) -> int:
        """A token from the target's logits ``[vocab]`` (prefill's first token, target-only decoding)."""
        if self.params.greedy:
            return argmax(logits)
        return sample_from(process_logits(logits, self.params), self.rng)

    def draft(self, logits: np.ndarray, scheme: str = "rejection") -> tuple[list[int], np.ndarray | None]:
        """Draft tokens from the drafter's logits ``[k, vocab]`` (already cut to the target's vocabulary).

        Returns:
            (k draft tokens, q ``[k, vocab]`` float64 they were drawn from), q None for greedy rows and for
            ``exact_match`` (which drafts the argmax and never reads q).
        """
        if self.params.greedy or scheme == Verification.EXACT_MATCH:
            return [int(t) for t in np.argmax(logits, axis=-1)], None
        q = process_logits(logits, self.params)
        return [sample_from(row, self.rng) for row in q], q

    def verify(self, draft_tokens: list[int], draft_probs: np.ndarray | None, target_logits: np.ndarray,
               scheme: str = "rejection") -> tuple[int, list[int]]:
        """Verify ``k`` draft tokens against the target.

        Args:
            draft_tokens: d_1..d_k (k >= 0).
            draft_probs: ``[k, vocab]`` float64 q they were drawn from (rejection scheme, sampled rows), else None.
            target_logits: ``[k + 1, vocab]`` float32; row j is the target's logits after the prefix + d_1..d_j.
            scheme: ``"rejection"`` or ``"exact_match"`` (module docstring).
        Returns:
            (a = accepted draft tokens, emitted tokens = d_1..d_a + one target token); always a + 1 tokens.
        """
        k = len(draft_tokens)
        if target_logits.shape[0] != k + 1:
            raise ValueError(f"need k + 1 = {k + 1} target logit rows, got {target_logits.shape[0]}")
        if scheme not in VERIFICATION_SCHEMES:
            raise ValueError(f"unknown verification scheme {scheme!r}; use one of "
                             f"{', '.join(v.value for v in Verification)}")
        if self.params.greedy:
            for j, d in enumerate(draft_tokens):
                best = argmax(target_logits[j])
                if d != best:
                    return j, [*draft_tokens[:j], best]
            return k, [*draft_tokens, argmax(target_logits[k])]
        for j, d in enumerate(draft_tokens):
            p = process_logits(target_logits[j], self.params)
            if scheme == Verification.EXACT_MATCH:
                y = sample_from(p, self.rng)
                if y != d:
                    return j, [*draft_tokens[:j], y]
                continue
            q = draft_probs[j]
            if self.rng.random() * q[d] < p[d]:  # accept with probability min(1, p(d) / q(d)); q(d) > 0
                continue
            residual = np.maximum(p - q, 0.0)
            total = residual.sum()
            # total == 0 only when p == q, where rejection has probability 0; guard float round-off anyway
            return j, [*draft_tokens[:j], sample_from(residual if total > 0 else p, self.rng)]
        return k, [*draft_tokens, sample_from(process_logits(target_logits[k], self.params), self.rng)]
