"""The lossless draft -> verify -> commit loop over a ragged batch of sequences (DFlash and PARD drafters).

One round of a sequence at committed length s (tokens whose K/V are in the target cache) with pending bonus x_s:
  1. draft: the drafter sees what it has not cached yet (DFlash: the target features of those positions; PARD:
     their token ids) and the block [x_s, MASK x (K-1)] from position s, and returns logits for k <= K draft
     slots (DFlash: K = B-1 slots after x_s; PARD: K rows ending the block); the draft tokens
     d_1..d_k are drawn from them (runtime/sampling.py: argmax for greedy rows, q for sampled rows);
  2. verify: the target runs [x_s, d_1 .. d_k] in one pass;
  3. accept a tokens (greedy: longest prefix equal to the target's argmax; sampled: rejection sampling) and emit
     d_1..d_a plus one target token (the bonus, or the resampled token), cut at a stop / max_new_tokens;
     roll the target cache back to s + emitted; the features of the emitted positions feed the next draft.
Greedy rows therefore equal target-only greedy decoding token for token (DFlash, arXiv 2602.06036, §3;
Leviathan et al. 2023, arXiv 2211.17192); sampled rows keep the target's processed distribution.

One :meth:`SpecEngine.step` advances every active sequence by one round: the verify pass is one batched target call
over rows of different lengths and different draft counts; a row that finishes leaves the batch and its caches are
dropped at once. Rows whose next block would pass the drafter's max positions (or that asked for no speculation)
decode target-only in the same batched call (k = 0), still exact.

Backends: runtime/backends/protocols.py's ``TargetBackend`` and ``DrafterBackend`` Protocols (runtime/backends/ort.py,
runtime/backends/pytorch.py, tests/runtime/scripted.py). A drafter's ``context`` says what it reads: target features
(DFlash), each row's committed token ids before x_s (PARD), or both (EAGLE-3).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from runtime.backends.protocols import DrafterBackend, TargetBackend, check_backend
from runtime.manifest import Manifest
from runtime.metrics import SpecStats
from runtime.modes import Backend, DrafterContext, Verification
from runtime.draft_length import (AdaptiveDraftTokens, DraftConfidence, DraftCost, DraftLengthPolicy,
                                  DraftTokensByBatch, top1_probabilities)
from runtime.prompt_lookup import NgramIndex, PromptLookup
from runtime.sampling import RowSampler, SamplingParams, TokenLogprob, token_logprob
from runtime.stops import StopChecker


class InvariantError(AssertionError):
    """A loop invariant of docs/design.md §5 broke (a bug, never user error)."""


@dataclasses.dataclass(slots=True)
class GenerationResult:
    token_ids: list[int]  # generated tokens only, the stop token included when one ended generation
    finish_reason: str  # "stop" (stop token / stop string) or "length" (max_new_tokens)
    stats: SpecStats
    text: str | None = None  # decoded output (special tokens skipped, cut before a stop string); None without tokenizer
    logprobs: list[TokenLogprob] | None = None  # one per token id when the request asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..n-1 (SamplingParams.prompt_logprobs)


@dataclasses.dataclass(eq=False)
class Sequence:
    """State of one request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RowSampler
    stopper: StopChecker
    target_cache: Any
    drafter_cache: Any
    num_draft_tokens: int
    out: list[int] = dataclasses.field(default_factory=list)
    pending_ctx: np.ndarray | None = None  # target features of committed positions the drafter has not cached
    finish_reason: str | None = None
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    token_logprobs: list[TokenLogprob] | None = None  # aligned with ``out`` when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..n-1, when the request asked
    adaptive: AdaptiveDraftTokens | None = None  # per-request draft length (runtime/draft_length.py)
    prefill_group: str | None = None  # requests of one group with the same prompt share one prefill (n > 1)
    prefill_out: tuple | None = None  # (last logits, features) of this step's prefill, for the group's others
    ngram: NgramIndex | None = None  # prompt lookup index (runtime/prompt_lookup.py), built at the first round

    @property
    def committed(self) -> int:
        """Tokens whose K/V are in the target cache: the prompt and every emitted token but the pending bonus."""
        return len(self.prompt_ids) + len(self.out) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        text = self.stopper.text(self.out) if self.stopper.tokenizer is not None else None
        lps = None if self.token_logprobs is None else list(self.token_logprobs)
        plps = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return GenerationResult(list(self.out), self.finish_reason or "", self.stats, text, lps, plps)


@dataclasses.dataclass(slots=True)
class Proposal:
    """What one round verifies, per row of the batch (the proposer's output, :meth:`SpecEngine._propose`)."""

    ks: list[int]  # draft tokens verified per row (0: the row decodes target-only this round)
    drafts: list[list[int]]  # the draft token ids, ``ks[r]`` of them
    qs: list[np.ndarray | None]  # the draft distributions q ``[k, V]`` for rejection sampling (None: greedy)
    looked_up: set[int] = dataclasses.field(default_factory=set)  # rows drafted by prompt lookup
    drafted: list[int] = dataclasses.field(default_factory=list)  # rows drafted by the drafter, in call order


class SpecEngine:
    """A target and a drafter backend plus the speculative loop over a ragged batch of sequences.

    Args:
        target, drafter: backends (module docstring); ``drafter`` may be None (target-only engine).
        eos_token_ids: ids that end generation unless a request sets ignore_eos.
        tokenizer: HF tokenizer (stop strings, output text); optional.
        verification: "rejection" or "exact_match"; None = the drafter's own choice.
        default_draft_tokens: draft tokens verified per round for requests that do not set num_draft_tokens
            (None = all the drafter drafts; an engines manifest's ``drafter.verify_draft_tokens``).
        draft_tokens_by_batch: k by the number of rows in a step, for requests that do not set num_draft_tokens
            (runtime/draft_length.py; None = ``default_draft_tokens`` at any load). Capped at the drafter's K.
        adaptive_draft_tokens: per request, lower k after rejections and raise it after fully accepted rounds
            (runtime/draft_length.py), within the request's k.
        check_invariants: assert docs/design.md §5's invariants after every round (tests).
        prompt_lookup: n-gram drafts beside the drafter (runtime/prompt_lookup.py): a row whose last tokens occurred
            before verifies the copy of what followed (up to ``num_tokens``, capped by ``draft_tokens_by_batch``)
            and skips the drafter that round; None = the drafter alone.
        draft_confidence: per round and row, verify the leading draft tokens while the product of the drafter's
            top-1 probabilities stays >= its threshold (runtime/draft_length.py); the ceiling is the request's
            num_draft_tokens, else ``draft_tokens_by_batch``, else the drafter's K (not ``default_draft_tokens``).
            A :class:`~runtime.draft_length.DraftCost` instead verifies the k with the most expected tokens per
            second under the round cost it fits to this engine's single-row rounds. None = a fixed k per round.
        batch_invariant_seeds: draft each seeded sampled row in a drafter call of its own (:meth:`_draft_groups`),
            so that at a fixed k a seeded request emits the same tokens alone, as choice i of n, or beside other
            requests; False drafts every row in one call (one drafter call per round, whatever the seeds).
        online_adapt: a ``runtime.online_adapt.AdaptConfig``: the drafter learns the target's verified tokens after
            every round (torch backend, DFlash drafter), as a post-verify callback (:attr:`adapter`); None = off.
        post_verify: callbacks run after every round's commit with the tokens each drafter-drafted row emitted
            (``list[list[int]]``, in drafter-call order; empty when no row drafted).

    Options reach the engine here or through :meth:`from_dir` (and :meth:`with_options` for a sweep over the same
    backends); they are read-only afterwards.
    """

    def __init__(self, target, drafter=None, *, eos_token_ids=(), tokenizer=None, verification: str | None = None,
                 check_invariants: bool = False, manifest: Manifest | None = None, engine_dir: Path | None = None,
                 proposable_vocab: int | None = None, default_draft_tokens: int | None = None,
                 draft_tokens_by_batch: DraftTokensByBatch | None = None, adaptive_draft_tokens: bool = False,
                 prompt_lookup: PromptLookup | None = None, draft_confidence: DraftConfidence | DraftCost | None = None,
                 batch_invariant_seeds: bool = True, online_adapt=None,
                 post_verify: tuple[Callable[[list[list[int]]], None], ...] = ()):
        check_backend(target, TargetBackend)
        if drafter is not None:
            check_backend(drafter, DrafterBackend)
        self.target = target
        self.drafter = drafter
        self._options = dict(eos_token_ids=eos_token_ids, verification=verification, check_invariants=check_invariants,
                             manifest=manifest, engine_dir=engine_dir, proposable_vocab=proposable_vocab,
                             default_draft_tokens=default_draft_tokens, draft_tokens_by_batch=draft_tokens_by_batch,
                             adaptive_draft_tokens=adaptive_draft_tokens, prompt_lookup=prompt_lookup,
                             draft_confidence=draft_confidence, batch_invariant_seeds=batch_invariant_seeds)
        # ids >= this are padding rows (of the drafter's or the target's head): never proposed as draft tokens
        self._proposable_vocab = min(proposable_vocab or target.vocab_size, target.vocab_size)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer = tokenizer
        self._verification = Verification.parse(verification or (drafter.verification if drafter is not None
                                                                  else Verification.REJECTION))
        k_max = drafter.num_draft_tokens if drafter is not None else 0
        # draft tokens verified per round when a request does not say (manifest ``verify_draft_tokens``)
        self._default_draft_tokens = min(default_draft_tokens or k_max, k_max)
        self._draft_length = DraftLengthPolicy(k_max, draft_tokens_by_batch, draft_confidence)
        self._prompt_lookup = prompt_lookup if drafter is not None else None
        self._adapter = None  # online draft adaptation (runtime/online_adapt.py); torch backend only
        if online_adapt is not None:
            from runtime.online_adapt import OnlineAdapter

            self._adapter = OnlineAdapter.for_drafter(drafter, online_adapt)
            post_verify = (*post_verify, self._adapter.on_verified)
        self._post_verify = tuple(post_verify)
        self.sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # the options, read-only (a sweep builds a new engine with :meth:`with_options`)
    manifest = property(lambda self: self._options["manifest"])
    engine_dir = property(lambda self: self._options["engine_dir"])
    check_invariants = property(lambda self: self._options["check_invariants"])
    batch_invariant_seeds = property(lambda self: self._options["batch_invariant_seeds"])
    adaptive_draft_tokens = property(lambda self: self._options["adaptive_draft_tokens"])
    draft_tokens_by_batch = property(lambda self: self._draft_length.by_batch)
    draft_confidence = property(lambda self: self._draft_length.confidence)
    prompt_lookup = property(lambda self: self._prompt_lookup)
    verification = property(lambda self: self._verification)
    default_draft_tokens = property(lambda self: self._default_draft_tokens)
    proposable_vocab = property(lambda self: self._proposable_vocab)
    eos_token_ids = property(lambda self: self._eos_token_ids)
    adapter = property(lambda self: self._adapter, doc="the online adapter (``online_adapt``), or None")

    def with_options(self, **changes) -> "SpecEngine":
        """A new engine over the same backends, tokenizer and manifest with some constructor options changed (a
        benchmark's sweep over configurations); ``online_adapt`` attaches an adapter to the shared drafter.

        Raises:
            RuntimeError: this engine has requests running, or adapts online (its adapter owns the drafter).
            TypeError: an unknown option.
        """
        if self.sequences or self._adapter is not None or self._post_verify:
            raise RuntimeError("with_options needs an idle engine without online adaptation or post-verify callbacks")
        return SpecEngine(self.target, self.drafter, tokenizer=self._tokenizer, **{**self._options, **changes})

    @classmethod
    def from_dir(cls, engine_dir: str | Path, device: str = "auto", threads: int | None = None,
                 check_invariants: bool = False, verify_checksums: bool = True,
                 backend: str = "onnxruntime", **options) -> "SpecEngine":
        """Load an engines/ folder (runtime/manifest.py checks schema, files and checksums).

        ``backend``: "onnxruntime" runs the folder's ONNX graphs; "torch" rebuilds the pair in PyTorch from the
        sources the manifest recorded (target, drafter checkpoint, taps, query-scale profile; the drafter's
        attention on the fused op, runtime/backends/pytorch.py) and uses the folder's tokenizer. The torch backend
        does not read the graphs, so it skips their checksums; ``threads`` (or ``$SHARPDRAFT_THREADS``) sets
        torch's process-wide intra-op threads. ``options``: the constructor's keyword options (draft length,
        prompt lookup, verification, online adaptation, ...); ``default_draft_tokens`` defaults to the manifest's
        ``drafter.verify_draft_tokens``.

        Raises:
            EngineDirError: the folder is missing, incomplete or does not match its manifest; torch backend: a
                recorded source is missing or does not match.
            ValueError: an unknown backend; online adaptation off the torch backend.
        """
        from runtime.manifest import load_manifest

        backend = Backend.parse(backend)
        engine_dir = Path(engine_dir)
        onnx = backend == Backend.ONNXRUNTIME
        manifest = load_manifest(engine_dir, verify_checksums=verify_checksums and onnx, require_graphs=onnx)
        if backend == Backend.TORCH:
            from runtime.backends.pytorch import torch_pair_from_manifest

            threads = threads or int(os.environ.get("SHARPDRAFT_THREADS", 0))
            if threads:  # process-wide: torch has one intra-op pool
                import torch

                torch.set_num_threads(threads)
            target, drafter = torch_pair_from_manifest(manifest, device, base_dir=engine_dir)
        else:
            from runtime.backends.ort import OrtTarget, ort_drafter_class

            target = OrtTarget(engine_dir, manifest, device, threads)
            drafter = ort_drafter_class(manifest.drafter.family)(engine_dir, manifest, device, threads)
        options.setdefault("default_draft_tokens", manifest.drafter.verify_draft_tokens)
        return cls(target, drafter, eos_token_ids=manifest.tokenizer.eos_token_ids,
                   check_invariants=check_invariants, manifest=manifest, engine_dir=engine_dir,
                   proposable_vocab=manifest.tokenizer.vocab_size, **options)

    @property
    def tokenizer(self):
        if self._tokenizer is None and self.engine_dir is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.engine_dir / self.manifest.tokenizer.dir)
        return self._tokenizer

    @property
    def max_positions(self) -> int:
        return self.target.max_positions

    # ---------------------------------------------------------------- requests
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validate a request without touching engine state (safe from any thread).

        Raises:
            ValueError: empty prompt, ids outside the target vocabulary, prompt + max_new_tokens over the target's
                positions, stop ids outside the vocabulary, num_draft_tokens above the drafter's.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in prompt_ids):
            raise ValueError("prompt token ids must be integers")
        vocab = self.target.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(prompt_ids)}..{max(prompt_ids)}")
        if len(prompt_ids) + params.max_new_tokens > self.max_positions:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"the target's {self.max_positions} positions; shorten the prompt or lower max_new_tokens")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < the vocabulary size {vocab}")
        k_max = self.drafter.num_draft_tokens if self.drafter is not None else 0
        if params.num_draft_tokens is not None and params.num_draft_tokens > k_max:
            raise ValueError(f"num_draft_tokens {params.num_draft_tokens} exceeds the drafter's {k_max}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
        if not params.query_scale and self.drafter is not None and self.drafter.query_scaled \
                and not self.drafter.query_scale_switch:
            raise ValueError("this engines folder has no per-request query-scale switch (exported by an older "
                             "sharpdraft); re-export it with sharpdraft-export to use query_scale=false")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prefill_group: str | None = None) -> Sequence:
        """Queue a request; its prefill runs at the next :meth:`step`.

        ``prefill_group``: requests of one group with the same prompt whose prefills fall in the same step run one
        prefill and copy its cache (the n samples of one OpenAI request); the others sample their own first token.

        Raises:
            ValueError: see :meth:`check_request`; or a duplicate request id.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(prompt_ids, params)
        k = 0 if not params.speculative or self.drafter is None else (
            self.default_draft_tokens if params.num_draft_tokens is None else params.num_draft_tokens)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, prompt_ids, params, RowSampler.for_request(params),
                       StopChecker(params, self.eos_token_ids, self.tokenizer),
                       self.target.new_cache(), self.drafter.new_cache() if self.drafter is not None else None, k)
        seq.stats.num_draft_tokens_per_round = k
        seq.prefill_group = prefill_group
        if params.logprobs is not None:
            seq.token_logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        if self.adaptive_draft_tokens and k > 0:
            seq.adaptive = AdaptiveDraftTokens(k)
        self.sequences[request_id] = seq
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request and its caches at once (client gone); unknown ids are ignored."""
        self.sequences.pop(request_id, None)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Advance every active sequence by one round (new ones by their prefill).

        Returns:
            (sequence, tokens emitted this step) per sequence that emitted; finished sequences are removed from
            the engine (their caches released) and carry ``finish_reason``.
        """
        seqs = list(self.sequences.values())
        fresh = [s for s in seqs if not s.out]
        emitted, leaders = [], {}
        for s in fresh:
            key = None if s.prefill_group is None else (s.prefill_group, tuple(s.prompt_ids))
            leader = leaders.get(key)
            if leader is not None and hasattr(leader.target_cache, "fork"):
                emitted.append((s, self._prefill_from(leader, s)))
            else:
                emitted.append((s, self._prefill(s, keep=key is not None)))
                if key is not None:
                    leaders[key] = s
        for s in leaders.values():
            s.prefill_out = None
        running = [s for s in seqs if s.out and not s.finished and s not in fresh]
        if running:
            emitted.extend(self._round(running))
        for seq, _ in emitted:
            if seq.finished:
                self.sequences.pop(seq.request_id, None)
        return emitted

    def _prefill(self, seq: Sequence, keep: bool = False) -> list[int]:
        t0 = time.perf_counter()
        n = len(seq.prompt_ids)
        collect = None if seq.prompt_logprobs is None else self._prompt_logprobs(seq)
        if hasattr(self.target, "prefill"):  # chunked (bounded memory), last position's logits only
            kw = {} if collect is None else {"on_logits": collect}
            last, feats = self.target.prefill(seq.target_cache, seq.prompt_ids, **kw)
        else:
            logits, feats = self.target.forward([seq.target_cache], [seq.prompt_ids])
            last, feats = logits[0, n - 1], feats[0]
            if collect is not None:
                collect(0, logits[0, :n])
        if keep:  # the other requests of its prefill group copy this step's result
            seq.prefill_out = (last, feats)
        return self._first_token(seq, last, feats, t0)

    def _prefill_from(self, leader: Sequence, seq: Sequence) -> list[int]:
        """``seq``'s prefill as a copy of ``leader``'s (same prompt, same step): its cache forked, its own first
        token sampled from the same logits."""
        t0 = time.perf_counter()
        seq.target_cache = leader.target_cache.fork()
        last, feats = leader.prefill_out
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = list(leader.prompt_logprobs or [])
        return self._first_token(seq, last, feats, t0)

    @staticmethod
    def _prompt_logprobs(seq: Sequence):
        """A prefill callback appending, for each chunk's logits ``[m, vocab]`` from prompt position ``start``, the
        logprob of the prompt token each row predicts (rows past the prompt's end are ignored)."""
        params = dataclasses.replace(seq.params, logprobs=seq.params.prompt_logprobs)
        prompt = seq.prompt_ids

        def collect(start: int, rows: np.ndarray) -> None:
            for j in range(rows.shape[0]):
                if start + j + 1 < len(prompt):
                    seq.prompt_logprobs.append(token_logprob(rows[j], prompt[start + j + 1], params))

        return collect

    def _first_token(self, seq: Sequence, last: np.ndarray, feats: np.ndarray, t0: float) -> list[int]:
        n = len(seq.prompt_ids)
        token = seq.sampler.next_token(last)
        seq.finish_reason = seq.stopper.extend(seq.out, [token])
        if seq.token_logprobs is not None and seq.out:
            seq.token_logprobs.append(token_logprob(last, token, seq.params))
        # the drafter's context (target features of positions it has not cached); a row that never drafts keeps
        # none, so target-only decoding does not copy a growing [length, F] array every step
        seq.pending_ctx = feats[:n] if seq.num_draft_tokens > 0 else None
        seq.stats.prefill_s = time.perf_counter() - t0
        seq.stats.new_tokens = len(seq.out)
        return [token]

    # ---------------------------------------------------------------- one round: propose -> verify -> commit
    def _round(self, seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """One draft -> verify -> commit round over ``seqs`` (module docstring); returns each row's new tokens."""
        t0 = time.perf_counter()
        proposal = self._propose(seqs)
        t1 = time.perf_counter()
        logits, feats = self.target.forward([s.target_cache for s in seqs],
                                            [[s.out[-1], *d] for s, d in zip(seqs, proposal.drafts)])
        t2 = time.perf_counter()
        observe = getattr(self._draft_length.confidence, "observe", None)  # DraftCost fits the round's cost in k
        if observe is not None and len(seqs) == 1 and proposal.drafted == [0]:
            observe(proposal.ks[0], t2 - t0)
        emitted = []
        for r, s in enumerate(seqs):
            emitted.append((s, self._commit(s, proposal, r, logits[r], feats[r])))
            s.stats.draft_s += t1 - t0
            s.stats.verify_s += t2 - t1
        drafted = [emitted[i][1] for i in proposal.drafted]
        for callback in self._post_verify:  # e.g. online adaptation: the drafter learns the target's tokens
            callback(drafted)
        dt = time.perf_counter() - t0
        for s in seqs:
            s.stats.decode_s += dt
        return emitted

    def _propose(self, seqs: list[Sequence]) -> "Proposal":
        """The round's draft tokens per row (vLLM v1's proposer): k by :class:`DraftLengthPolicy`, prompt-lookup
        copies first, then the drafter for the rows without one, in the calls :meth:`_draft_groups` says."""
        by_load = None if self.drafter is None else self._draft_length.by_load(len(seqs))
        ks = []
        for s in seqs:
            k = self._draft_length.row(s.num_draft_tokens, s.params.num_draft_tokens,
                                       s.params.max_new_tokens - len(s.out), by_load, s.adaptive)
            if k > 0 and not self.drafter.can_draft(s.committed):
                k = 0  # past the drafter's positions: this row continues target-only (exact)
            ks.append(k)
        proposal = Proposal(ks, [[] for _ in seqs], [None] * len(seqs))
        if self._prompt_lookup is not None:  # n-gram copies first; the drafter drafts the rows without a match
            for i, s in enumerate(seqs):
                self._propose_lookup(s, i, proposal, by_load)
        drafting = [i for i, k in enumerate(ks) if k > 0 and i not in proposal.looked_up]
        for group in self._draft_groups(seqs, drafting):
            self._propose_drafter([seqs[i] for i in group], group, proposal)
            proposal.drafted += group
        return proposal

    def _propose_lookup(self, s: Sequence, i: int, proposal: "Proposal", by_load: int | None) -> None:
        """Row ``i``'s prompt-lookup copy (runtime/prompt_lookup.py), when its last tokens occurred before."""
        cap = self._draft_length.lookup_cap(s.params.max_new_tokens - len(s.out), by_load)
        if s.num_draft_tokens == 0 or cap <= 0:
            return
        if s.ngram is None:
            s.ngram = self._prompt_lookup.new_index()
        d, _ = s.ngram.propose(s.prompt_ids + s.out, cap)
        if d:
            proposal.drafts[i], proposal.ks[i] = d, len(d)
            proposal.looked_up.add(i)
            if not s.params.greedy and self._verification == Verification.REJECTION:
                q = np.zeros((len(d), self.target.vocab_size), np.float64)  # a copy is certain: q one-hot
                q[np.arange(len(d)), d] = 1.0
                proposal.qs[i] = q

    def _propose_drafter(self, rows: list[Sequence], group: list[int], proposal: "Proposal") -> None:
        """One drafter call over ``rows`` (indices ``group``): their draft tokens and q, k cut by confidence or cost."""
        kind = self.drafter.context
        if kind == DrafterContext.TOKENS:  # PARD: committed token ids
            contexts = [np.asarray(s.prompt_ids + s.out[:-1], np.int64) for s in rows]
        elif kind == DrafterContext.FEATURES_AND_TOKENS:  # EAGLE-3: (features not cached yet, committed token ids)
            contexts = [(s.pending_ctx, np.asarray(s.prompt_ids + s.out[:-1], np.int64)) for s in rows]
        else:  # DFlash: target features of the positions the drafter has not cached
            contexts = [s.pending_ctx for s in rows]
        ks = proposal.ks
        kw = {"num_tokens": max(ks[i] for i in group)}  # the drafter may skip slots nobody verifies
        if not all(s.params.query_scale for s in rows):
            kw["query_scale"] = [s.params.query_scale for s in rows]
        logits = self.drafter.draft([s.drafter_cache for s in rows], [s.out[-1] for s in rows], contexts, **kw)
        confidence = self._draft_length.confidence
        if confidence is not None:  # softmax over the draft vocabulary's columns only
            support = self.drafter.draft_ids if getattr(self.drafter, "draft_vocab_enabled", False) else None
        for i, s, lg in zip(group, rows, logits):
            s.pending_ctx = s.pending_ctx[:0]
            if confidence is not None:
                ks[i] = confidence.length(top1_probabilities(lg[: ks[i]], support))
            proposal.drafts[i], proposal.qs[i] = s.sampler.draft(self._draft_logits(lg, ks[i]), self._verification)

    def _commit(self, s: Sequence, proposal: "Proposal", r: int, logits: np.ndarray, feats: np.ndarray) -> list[int]:
        """Row ``r``'s verification (greedy prefix or rejection sampling, runtime/sampling.py) and commit: the
        emitted tokens (cut at a stop / max_new_tokens), their logprobs, statistics, the caches rolled back to the
        committed length and the emitted positions' features queued for the drafter. Returns the new tokens."""
        k, drafts = proposal.ks[r], proposal.drafts[r]
        base = s.committed  # before this round: the target cache held `base` tokens, then 1 + k were appended
        accepted, new = s.sampler.verify(drafts, proposal.qs[r], logits[: k + 1], self._verification)
        before = len(s.out)
        s.finish_reason = s.stopper.extend(s.out, new)
        n_new = len(s.out) - before
        if s.token_logprobs is not None:  # emitted token j was drawn from verify row j (trimmed like the ids)
            s.token_logprobs.extend(token_logprob(logits[j], s.out[before + j], s.params) for j in range(n_new))
        if k > 0:
            s.stats.record_round(min(accepted, n_new), k)
            if r in proposal.looked_up:
                s.stats.lookup_rounds += 1
                s.stats.lookup_accepted += min(accepted, n_new)
            elif s.adaptive is not None:
                s.adaptive.update(k, accepted)
        s.stats.new_tokens = len(s.out)
        if s.finished:
            s.target_cache = s.drafter_cache = s.pending_ctx = None  # release at once
        else:
            s.target_cache.truncate(base + n_new)  # x_s and the emitted tokens but the new pending bonus
            if s.pending_ctx is not None:
                s.pending_ctx = np.concatenate([s.pending_ctx, feats[:n_new]], axis=0)
            if self.check_invariants:
                self._check_round(s, drafts)
        return s.out[before:]

    def _draft_groups(self, seqs: list[Sequence], drafting: list[int]) -> list[list[int]]:
        """The drafter calls of a round: one over ``drafting`` (row indices into ``seqs``), except that with
        ``batch_invariant_seeds`` each seeded sampled row is drafted in a call of its own.

        Why: the drafter graph's logits depend slightly on the rows beside a row (padding to the longest cache and
        context changes the reduction order; the int8 drafter's activation quantization magnifies 1e-5 into 0.1),
        and a sampled draft token or acceptance test can flip on that, so a seeded request would not repeat its
        solo output inside a batch. Alone, its drafter call has the shapes of its solo run, bit for bit; the
        target's verify rows do not depend on their neighbours (shared-buffer graphs; tested). Greedy rows need
        no such care (their output is the target's, whatever was drafted). Online adaptation reads one call's
        examples per round, so it keeps one call.
        """
        if not drafting:
            return []
        if not self.batch_invariant_seeds or self._adapter is not None:
            return [drafting]
        alone = [i for i in drafting if seqs[i].params.seed is not None and not seqs[i].params.greedy]
        rest = [i for i in drafting if i not in alone]
        return ([rest] if rest else []) + [[i] for i in alone]

    def _draft_logits(self, logits: np.ndarray, k: int) -> np.ndarray:
        """The drafter's logits ``[K, V_drafter]`` as ``[k, V_target]`` f32 with padding ids at -inf.

        Padding rows (ids >= ``proposable_vocab``, e.g. a drafter head padded to a multiple of 128) can then never
        be drafted, greedy or sampled, and q has the target's width for the rejection test.
        """
        out = np.full((k, self.target.vocab_size), -np.inf, np.float32)
        width = min(logits.shape[-1], self._proposable_vocab)
        out[:, :width] = logits[:k, :width]
        return out

    def _check_round(self, s: Sequence, drafts: list[int]) -> None:
        """Invariants after every round (docs/design.md §5)."""
        if s.target_cache.length != s.committed:
            raise InvariantError(f"target KV length {s.target_cache.length} != committed tokens {s.committed}")
        if self.drafter is not None and self.drafter.context == DrafterContext.TOKENS:
            if s.drafter_cache.length > s.committed:  # PARD caches committed tokens only (mask slots dropped)
                raise InvariantError(f"drafter cache {s.drafter_cache.length} holds more than the committed tokens "
                                     f"{s.committed}: unverified (mask) K/V were kept")
        elif self.drafter is not None and s.pending_ctx is not None:
            cached = s.drafter_cache.length
            if cached + s.pending_ctx.shape[0] != s.committed:
                raise InvariantError(f"drafter cache {cached} + pending context {s.pending_ctx.shape[0]} != "
                                     f"committed tokens {s.committed}: positions not contiguous")
        if len(s.out) > s.params.max_new_tokens:
            raise InvariantError(f"{len(s.out)} tokens emitted, max_new_tokens {s.params.max_new_tokens}")
        if any(t in s.stopper.stop_ids for t in s.out):
            raise InvariantError("a stop token was emitted but generation continued")
        if any(t >= self.proposable_vocab for t in drafts):
            raise InvariantError("a draft id outside the target vocabulary reached verification")

    # ---------------------------------------------------------------- convenience
    def generate_batch(self, requests: list[tuple[list[int], SamplingParams]]) -> list[GenerationResult]:
        """Run ``requests`` (prompt ids, params) together to completion; results in request order.

        Raises:
            ValueError: a request is invalid (nothing is queued then).
        """
        if self.sequences:
            raise RuntimeError("generate_batch needs an idle engine; use add_request/step for continuous batching")
        seqs = []
        try:
            for ids, params in requests:
                seqs.append(self.add_request(ids, params))
        except ValueError:
            for s in seqs:
                self.abort(s.request_id)
            raise
        try:
            while self.sequences:
                self.step()
        except BaseException:  # an engine error or an interrupt: leave the engine idle for the next request
            for s in seqs:
                self.abort(s.request_id)
            raise
        return [s.result() for s in seqs]

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None, *,
                 params: SamplingParams | None = None, speculative: bool | None = None) -> GenerationResult:
        """Generate for one request; greedy output equals :meth:`generate_target_only` (lossless).

        Args:
            prompt_ids: prompt token ids (non-empty, within the target vocabulary).
            max_new_tokens: shorthand for ``SamplingParams(max_new_tokens=...)`` (greedy) when ``params`` is None.
            params: full sampling parameters.
            speculative: override ``params.speculative``.
        Raises:
            ValueError: see :meth:`add_request` and :class:`SamplingParams`.
        """
        if params is None:
            params = SamplingParams(max_new_tokens=16 if max_new_tokens is None else max_new_tokens)
        elif max_new_tokens is not None:
            params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        if speculative is not None:
            params = dataclasses.replace(params, speculative=speculative)
        return self.generate_batch([(prompt_ids, params)])[0]

    def generate_target_only(self, prompt_ids: list[int], max_new_tokens: int | None = None, *,
                             params: SamplingParams | None = None) -> GenerationResult:
        """Target-only decoding (the baseline and the lossless reference); same arguments as :meth:`generate`."""
        return self.generate(prompt_ids, max_new_tokens, params=params, speculative=False)
