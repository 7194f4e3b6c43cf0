"""ONNX Runtime engines for the target and the DFlash drafter of an engines/ folder, with per-sequence KV caches.

Target and DFlash drafter graphs exported with kv_io "static" (the default, export/graphs.py) keep each
sequence's cache in a :class:`StaticKVCache`: preallocated buffers the graph reads in place (spare slots masked by
``attention_mask``), new positions written after each call, rollback a length change. A single sequence's step
therefore returns no cache from the graph; a ragged batch gathers its rows' valid positions into one padded tensor
per call.

Quantized targets (``--target-precision int4|int8``, export/genai_target.py: ONNX Runtime GenAI's builder graph,
kv_io "shared") use the same :class:`StaticKVCache` buffers, bound through IOBinding as both past and present:
the graph writes the new positions into them itself, so a single sequence's step copies nothing at all.

Concat-form graphs (older folders, ``--target-kv-io concat`` / ``--drafter-kv-io concat``, PARD and EAGLE-3
drafters) return past + new K/V: each sequence owns a :class:`KVCache` per graph (numpy arrays ``[1, kv_heads,
length, head_dim]``, rollback is a slice); a batched call pads the rows' caches on the right and masks the padding
out, and each row's new K/V are cut back out of the present tensors, so padding and placeholder slots never enter
any cache.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from runtime.kv_cache import (KVCache, StaticKVCache, gather_static, pad_caches,  # noqa: F401 - re-exported
                              unpad_present)

from plugins.rule import Family
from runtime.draft_vocab import expand_logits, load_draft_vocab
from runtime.manifest import GraphEntry, Manifest
from runtime.modes import DrafterContext, KvIo, Verification
from runtime.ragged import attention_mask, dflash_block, positions, rows_after_past
from runtime.ort_threads import session_options  # noqa: F401 - re-exported (scripts, tests)
from runtime.shared_tables import load_shared_table


DEFAULT_PREFILL_CHUNK = 512


def providers(device: str = "auto") -> list[str]:
    """["CUDAExecutionProvider", "CPUExecutionProvider"] when onnxruntime-gpu sees a GPU (and device != cpu)."""
    import onnxruntime as ort

    avail = ort.get_available_providers()
    if device in ("auto", "cuda") and "CUDAExecutionProvider" in avail:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        raise RuntimeError("device=cuda needs onnxruntime-gpu and a CUDA GPU; install the `gpu` extra or use cpu")
    return ["CPUExecutionProvider"]


class _Graph:
    """One ONNX Runtime session of an engines/ folder."""

    role = "drafter"  # session_options' per-role settings

    def __init__(self, engine_dir: Path, graph: GraphEntry, dims: tuple[int, int, int], device: str,
                 threads: int | None):
        import onnxruntime as ort

        if graph.precision == "bf16":  # export/bf16.py: written for CUDA / TensorRT consumers
            from runtime.manifest import EngineDirError

            raise EngineDirError(f"{engine_dir}: its {self.role} graph is bf16, which the sharpdraft runtime cannot "
                                 "run (ONNX Runtime's CPU provider has no bf16 kernels and its KV buffers are numpy "
                                 "arrays, which have no bf16 type); the folder is for TensorRT / CUDA consumers: "
                                 "export --dtype fp16 (the same graphs in float16) or fp32 to run it here")
        self.session = ort.InferenceSession(str(engine_dir / graph.file), session_options(threads, self.role),
                                            providers=providers(device))
        self.num_layers, self.kv_heads, self.head_dim = dims
        self.kv_names = [n for n in graph.inputs if n.startswith("past_")]
        self.out_names = graph.outputs
        self.ort_s = 0.0  # seconds spent inside ONNX Runtime calls (benchmarks subtract it from step time)

    def _run(self, names: list[str], feed: dict, session=None) -> list[np.ndarray]:
        """``session.run`` (default: this graph's) timed into :attr:`ort_s`."""
        t0 = time.perf_counter()
        try:
            return (session or self.session).run(names, feed)
        finally:
            self.ort_s += time.perf_counter() - t0

    def new_cache(self) -> KVCache:
        return KVCache(self.num_layers, self.kv_heads, self.head_dim)

    def _drafter_setup(self, engine_dir: Path, manifest: Manifest, graph: GraphEntry) -> None:
        """Query-scale facts of a drafter graph and the target tensors it borrows (``manifest.shared_weights``)."""
        self.query_scaled = bool(manifest.query_scale.profile.enabled)
        self.query_scale_switch = "query_scale_enabled" in graph.inputs
        target_graph = engine_dir / manifest.graphs["target"].file
        self.shared = {name: _shared_tensor(target_graph, spec) for name, spec in manifest.shared_weights.items()
                       if name in graph.inputs}

    def _run_drafter(self, feed: dict, flags: list[bool], past: list, caches: list[KVCache], l_max: int,
                     keep: list[int]) -> list[np.ndarray]:
        """Run the drafter graph with the switch, KV and borrowed tensors added; give each row back its old K/V plus
        its ``keep[r]`` real new positions; return the outputs before the present K/V (``caches`` None: every
        output, new K/V included, for a static-KV graph whose caller appends them)."""
        if self.query_scale_switch:
            feed["query_scale_enabled"] = np.asarray(flags, np.float32)
        feed.update(zip(self.kv_names, past))
        feed.update(self.shared)
        outputs = self._run(self.out_names, feed)
        if caches is None:  # static KV: the caller appends the new K/V (returned after the other outputs)
            return outputs
        n = len(outputs) - len(self.kv_names)
        unpad_present(outputs[n:], caches, l_max, keep)
        return outputs[:n]

    def _row_flags(self, query_scale: list[bool] | None, batch: int) -> list[bool]:
        """Per-row query-scale switches (None = on). Raises ValueError for off rows without a switch input."""
        flags = [True] * batch if query_scale is None else list(query_scale)
        if not all(flags) and self.query_scaled and not self.query_scale_switch:
            raise ValueError("this drafter graph has no query_scale_enabled input; re-export the engines folder")
        return flags


class OrtTarget(_Graph):
    """Target graph: ``forward`` runs a ragged batch of rows and appends each row's real tokens to its cache."""

    role = "target"

    def __init__(self, engine_dir: Path, manifest: Manifest, device: str = "auto", threads: int | None = None):
        t = manifest.target
        graph = manifest.graphs["target"]
        super().__init__(engine_dir, graph, (t.num_layers, t.num_key_value_heads, t.head_dim), device, threads)
        self.max_positions = t.max_position_embeddings
        self.vocab_size = t.vocab_size
        self.kv_io = KvIo.parse(graph.kv_io)
        self.static = self.kv_io == KvIo.STATIC
        self.shared_kv = self.kv_io == KvIo.SHARED  # builder graph: past and present are one buffer (GQA)
        self.precision = t.precision
        if self.shared_kv:
            self.present_names = [n for n in graph.outputs if n.startswith("present")]
            self.taps_output = graph.taps_output
            self.kv_dtype = _ORT_DTYPES[next(i.type for i in self.session.get_inputs() if i.name == self.kv_names[0])]
        # int8-activation graphs (MatMulNBits accuracy_level 4) give a 1-token step other rounding than a block of
        # >= 2, so such graphs record min_q_len 2: every call then takes the block path, and speculative greedy
        # output equals target-only greedy output bit for bit (docs/quantized-target.md). $SHARPDRAFT_TARGET_MIN_Q
        # overrides it for benchmarks of the plain 1-token step.
        self.min_q = max(1, int(os.environ.get("SHARPDRAFT_TARGET_MIN_Q", 0)) or int(graph.min_q_len or 1))
        self.prefill_chunk = int(os.environ.get("SHARPDRAFT_PREFILL_CHUNK", DEFAULT_PREFILL_CHUNK))

    def new_cache(self) -> KVCache | StaticKVCache:
        if self.static or self.shared_kv:
            return StaticKVCache(self.num_layers, self.kv_heads, self.head_dim,
                                 dtype=self.kv_dtype if self.shared_kv else np.float32)
        return super().new_cache()

    def prefill(self, cache: KVCache | StaticKVCache, tokens: list[int], on_logits=None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Run a prompt through the target in chunks of ``prefill_chunk`` tokens (``$SHARPDRAFT_PREFILL_CHUNK``).

        Chunking bounds the attention scores (``[1, heads, chunk, length]``) and the logits kept (only the last
        position's), so a long prompt's prefill memory no longer grows with the prompt's square.

        Args:
            cache: the sequence's (empty or partial) target cache; the prompt's K/V are appended.
            tokens: the prompt ids (>= 1).
            on_logits: optional ``callback(start, logits)`` with each chunk's logits ``[chunk_len, vocab]`` f32
                (row j predicts prompt token start + j + 1): prompt logprobs without keeping ``[n, vocab]``.
        Returns:
            logits of the last position ``[vocab]`` f32 and taps ``[len(tokens), F]`` f32.
        Raises:
            ValueError: as :meth:`forward`.
        """
        # A static cache grows chunk by chunk: each chunk's call reads (and masks) the whole buffer, so reserving
        # the prompt's length up front would make every chunk attend to it (measured: 2x slower at 6k tokens).
        step = max(1, self.prefill_chunk)
        if self.shared_kv:  # the graph reads only each row's own length of its buffer: room costs no compute
            cache.reserve(cache.length + len(tokens) + 1)
        taps = []
        for i in range(0, len(tokens), step):
            chunk = tokens[i: i + step]
            logits, t = self.forward([cache], [chunk])
            taps.append(t[0, : len(chunk)])
            if on_logits is not None:
                on_logits(i, logits[0, : len(chunk)])
        return logits[0, len(chunk) - 1], np.concatenate(taps)

    def forward(self, caches: list[KVCache], tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Run each row's ``tokens[r]`` at positions ``caches[r].length ..`` and append their K/V to ``caches[r]``.

        Args:
            caches: one cache per row (rows may hold different lengths).
            tokens: per row >= 1 token ids; rows may differ in length (placeholders pad them to q_max; they attend
                nothing a real token reads and are dropped from the caches).
        Returns:
            logits ``[batch, q_max, vocab]`` f32 and taps ``[batch, q_max, F]`` f32; row r is valid for its first
            ``len(tokens[r])`` slots.
        Raises:
            ValueError: a row is empty or would pass the target's max_position_embeddings.
        """
        lens = [len(t) for t in tokens]
        if min(lens) < 1:
            raise ValueError("every row needs at least one token")
        for c, n in zip(caches, lens):
            if c.length + n > self.max_positions:
                raise ValueError(f"sequence of {c.length + n} tokens exceeds the target's {self.max_positions} "
                                 "positions")
        b, q = len(tokens), max(lens)
        q = max(q, self.min_q)  # placeholder slots after the real ones (never kept, never read by a real token)
        for c in caches:
            if c.length + q > self.max_positions:
                q = max(lens)  # no room for the placeholder at the very end of the positions
        if self.shared_kv:
            return self._forward_shared(caches, tokens, lens, q)
        if self.static:
            for c in caches:
                c.reserve(c.length + q)
            past, l_max = gather_static(caches)
        else:
            past, l_max = pad_caches(caches)
        # placeholder slots repeat each row's last token: after every real token of the row (causal), never read
        feed = rows_after_past([c.length for c in caches], tokens, l_max, width=q,
                               max_positions=self.max_positions).feed()
        feed.update(zip(self.kv_names, past))
        logits, taps, *kv = self._run(self.out_names, feed)
        if self.static:
            for r, (c, n) in enumerate(zip(caches, lens)):
                c.append(kv, n, row=r)
        else:
            unpad_present(kv, caches, l_max, lens)
        return logits, taps

    def _forward_shared(self, caches: list[StaticKVCache], tokens: list[list[int]], lens: list[int],
                        q: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`forward` on a kv_io "shared" graph (export/genai_target.py): past and present bound to one buffer.

        Each row is one graph call over its own buffers: the graph writes the row's q new positions in place (rotary
        positions from the mask sum, length + q) and the cache only advances its length, so no step copies a
        cache. Rows are not batched into one call: ONNX Runtime's CPU GroupQueryAttention refuses batch > 1 when
        q > 1 and a past is given ("batch_size must be 1 when sequence_length > 1"), which is every verify block,
        and a batched decode would first gather every row's cache into one buffer.
        """
        logits = np.empty((len(caches), q, self.vocab_size), np.float32)
        taps = None
        for r, (c, row) in enumerate(zip(caches, tokens)):
            ids = np.full((1, q), row[-1], np.int64)  # placeholders after every real token (causal), never kept
            ids[0, : len(row)] = row
            c.reserve(c.length + q)
            key = (id(self.session), c.capacity, c.kv_buffers[0].ctypes.data)
            if c.binding is None or c.binding[0] != key:  # bound once per buffer allocation (~1.2 ms to bind)
                c.binding = (key, bind_shared(self.session, c.kv_buffers, self.kv_names, self.present_names,
                                              self.taps_output))
            lg, tp = run_shared(self.session, ids, np.ones((1, c.length + q), np.int64), c.kv_buffers,
                                self.kv_names, self.present_names, self.taps_output, self, binding=c.binding[1])
            logits[r] = lg[0]
            if taps is None:
                taps = np.zeros((len(caches), q, 0 if tp is None else tp.shape[-1]), np.float32)
            if tp is not None:
                taps[r] = tp[0]
            c.advance(lens[r])
        return logits, taps


_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # K/V buffers of builder graphs


def bind_shared(session, buffers: list[np.ndarray], past_names: list[str], present_names: list[str],
                taps_output: str | None):
    """An IOBinding of ``session`` with each K/V buffer bound as both its past input and its present output (the
    outputs ``logits`` and ``taps_output`` bound first, so they come first in ``get_outputs``). Valid while the
    buffers live at the same addresses with the same shapes.

    Raises:
        ValueError: a buffer is not C-contiguous.
    """
    binding = session.io_binding()
    binding.bind_output("logits")
    if taps_output:
        binding.bind_output(taps_output)
    for pn, qn, buf in zip(past_names, present_names, buffers):
        if not buf.flags.c_contiguous:
            raise ValueError("shared KV buffers must be C-contiguous")
        binding.bind_input(pn, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        binding.bind_output(qn, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
    return binding


def run_shared(session, ids: np.ndarray, mask: np.ndarray, buffers: list[np.ndarray], past_names: list[str],
               present_names: list[str], taps_output: str | None, timer: "_Graph | None" = None, binding=None):
    """One call of a kv_io "shared" graph with each past buffer bound as its own present (IOBinding, no copy).

    Args:
        ids: ``[batch, q]`` int64; mask: ``[batch, total]`` int64, row sums = cached length + q.
        buffers: per layer K, V ``[batch, kv_heads, capacity, head_dim]`` C-contiguous arrays, capacity >= total;
            the graph writes row b's new positions at [sum(mask[b]) - q, sum(mask[b])) in place.
        timer: a graph whose :attr:`ort_s` accumulates the call's seconds.
        binding: a :func:`bind_shared` binding of these buffers to reuse (None: bound for this call).
    Returns:
        (logits ``[batch, q, vocab]`` f32, taps ``[batch, q, F]`` f32 or None without ``taps_output``).
    """
    if binding is None:
        binding = bind_shared(session, buffers, past_names, present_names, taps_output)
    else:  # fresh output tensors for this call's q (the K/V bindings stay)
        binding.bind_output("logits")
        if taps_output:
            binding.bind_output(taps_output)
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("attention_mask", mask)
    t0 = time.perf_counter()
    try:
        session.run_with_iobinding(binding)
    finally:
        if timer is not None:
            timer.ort_s += time.perf_counter() - t0
    outs = binding.get_outputs()
    logits = outs[0].numpy()
    taps = outs[1].numpy() if taps_output else None
    return logits, taps


class OrtDFlashDrafter(_Graph):
    """DFlash drafter graph + per-sequence context caches (verified context only: block K/V are never returned).

    A ragged batch is drafted in one graph call: caches and new context rows are right-padded and masked out with
    the graph's ``attention_mask`` (from which the in-graph beta counts each row's N). Engines exported before the
    mask input existed are drafted one row per call.
    """

    family = Family.DFLASH
    verification = Verification.REJECTION  # runtime/sampling.py explains the choice
    context = DrafterContext.TARGET_FEATURES

    def __init__(self, engine_dir: Path, manifest: Manifest, device: str = "auto", threads: int | None = None):
        d = manifest.drafter.config
        graph = manifest.graphs["drafter"]
        super().__init__(engine_dir, graph, (d["num_hidden_layers"], d["num_key_value_heads"], d["head_dim"]),
                         device, threads)
        self.block_size = d["block_size"]
        self.num_draft_tokens = self.block_size - 1
        self.mask_token_id = d["dflash_config"]["mask_token_id"]
        self.max_positions = d["max_position_embeddings"]
        self.batched = "attention_mask" in graph.inputs
        self.slot_input = "draft_slots" in graph.inputs  # the LM head scores only the slots asked for
        self.static = KvIo.parse(graph.kv_io) == KvIo.STATIC
        self._drafter_setup(engine_dir, manifest, graph)
        self.vocab_size = d.get("vocab_size", manifest.target.vocab_size)
        self._full_head = self.shared.get("lm_head_weight")
        # the graph may carry its LM head: an int8 graph the target's quantized rows (export/drafter_quant.py), a
        # speculators-format drafter its own head; in the draft vocabulary's order when the folder has one
        self.head_in_graph = "lm_head_weight" not in graph.inputs
        self.draft_ids = self._draft_head = None
        vocab_entry = manifest.drafter.draft_vocab
        if vocab_entry and (self._full_head is not None or self.head_in_graph):
            self.draft_ids = load_draft_vocab(engine_dir / vocab_entry["file"], self.vocab_size)
            if self._full_head is not None:
                self._draft_head = np.ascontiguousarray(self._full_head[self.draft_ids])
        self.set_draft_vocab(True)

    def new_cache(self) -> KVCache | StaticKVCache:
        if self.static:
            return StaticKVCache(self.num_layers, self.kv_heads, self.head_dim)
        return super().new_cache()

    def set_draft_vocab(self, enabled: bool) -> None:
        """Score only the draft vocabulary's LM-head rows (the default when the engines folder has one), or the
        whole vocabulary (A/B; runtime/draft_vocab.py). No-op for folders without a draft vocabulary.

        Raises:
            ValueError: ``enabled`` False on a graph that carries its draft-vocabulary LM head (int8 export).
        """
        if self.head_in_graph and not enabled and self.draft_ids is not None:
            raise ValueError("this drafter graph carries the draft vocabulary's LM-head rows (an int8 export, or the "
                             "drafter's own head); a float export of a drafter that borrows the target's head can "
                             "score the whole vocabulary (--drafter-precision fp32)")
        self.draft_vocab_enabled = bool(enabled and self.draft_ids is not None)
        if self._full_head is not None:
            self.shared["lm_head_weight"] = self._draft_head if self.draft_vocab_enabled else self._full_head

    def can_draft(self, committed: int) -> bool:
        """True when a block at positions committed .. committed + B - 1 fits the drafter's positions."""
        return committed + self.block_size <= self.max_positions

    def draft(self, caches: list[KVCache], bonus_tokens: list[int], contexts: list[np.ndarray],
              query_scale: list[bool] | None = None, num_tokens: int | None = None) -> np.ndarray:
        """Draft B-1 tokens (or the first ``num_tokens``) after each row's bonus token.

        Args:
            caches: per row, the drafter cache of positions 0 .. kv_len - 1.
            bonus_tokens: per row the last token the target produced (block slot 0, at position s).
            contexts: per row ``[ctx_len, F]`` f32 taps of the verified positions kv_len .. s - 1 (ctx_len >= 0);
                they are appended to the row's cache.
            query_scale: per row, False = beta 1 (frozen drafter) through the graph's ``query_scale_enabled``
                input; None = on for every row.
            num_tokens: draft tokens the caller will verify (1..B-1; None = all): the graph's LM head then scores
                only block slots 1..num_tokens (``draft_slots``). The block itself is always drafted whole (its
                slots attend to each other), so the logits of those slots do not depend on ``num_tokens``.
        Returns:
            logits ``[batch, num_tokens or B - 1, vocab]`` f32 for block slots 1.. (-inf outside the draft
            vocabulary when the folder has one).
        Raises:
            ValueError: a row asks for the scale off and the graph has no switch input.
        """
        flags = self._row_flags(query_scale, len(caches))
        k = self.num_draft_tokens if num_tokens is None else max(1, min(int(num_tokens), self.num_draft_tokens))
        if not self.batched:
            return np.concatenate([self._draft_rows([c], [b], [x], [f], k) for c, b, x, f in
                                   zip(caches, bonus_tokens, contexts, flags)])
        return self._draft_rows(caches, bonus_tokens, contexts, flags, k)

    def _draft_rows(self, caches, bonus_tokens, contexts, flags, k: int) -> np.ndarray:
        b, blk = len(caches), self.block_size
        ctx_lens = [x.shape[0] for x in contexts]
        c_max = max(ctx_lens)
        if self.static:  # buffers read in place (spare slots masked); the graph needs a past of >= 1 slot
            past, l_max = gather_static(caches)
            if l_max == 0:
                past, l_max = [np.zeros((b, self.kv_heads, 1, self.head_dim), np.float32) for _ in past], 1
        else:
            past, l_max = pad_caches(caches)
        ids = np.full((b, blk), self.mask_token_id, np.int64)
        ids[:, 0] = bonus_tokens
        hidden = np.zeros((b, c_max, contexts[0].shape[1]), np.float32)
        for r, ctx in enumerate(contexts):
            hidden[r, : ctx.shape[0]] = ctx
        pos, mask = dflash_block([c.length for c in caches], ctx_lens, l_max, blk)
        feed = {"input_ids": ids, "target_hidden": hidden, "position_ids": pos}
        if self.batched:
            feed["attention_mask"] = mask
        if self.slot_input:
            feed["draft_slots"] = np.arange(1, k + 1, dtype=np.int64)
        if self.static:
            logits, *new_kv = self._run_drafter(feed, flags, past, None, l_max, ctx_lens)
            for r, (cache, n) in enumerate(zip(caches, ctx_lens)):
                cache.append(new_kv, n, row=r)
        else:
            (logits,) = self._run_drafter(feed, flags, past, caches, l_max, ctx_lens)
        if self.draft_vocab_enabled:
            return expand_logits(logits, self.draft_ids, self.vocab_size)
        return logits


def _shared_tensor(target_graph: Path, spec: dict) -> np.ndarray:
    return load_shared_table(target_graph, spec)


class OrtPardDrafter(_Graph):
    """PARD drafter graph (export/families/pard/graph.py ``export_pard_drafter``) + per-sequence caches of committed
    tokens.

    Each call feeds, per row, the committed tokens the cache does not hold yet, ending with the bonus token, then
    K-1 ``pard_token`` slots; the K draft tokens are the logits of the last K of those rows (the graph gathers them
    from ``logits_start``). Only real tokens' K/V are kept: the mask slots are dropped, which is PARD's rewind by
    K-1. Rows are right-padded with placeholders after every real slot (never read by a real query: causal) and
    the in-graph beta counts each query row's visible keys from the mask.
    """

    family = Family.PARD
    verification = Verification.REJECTION
    context = DrafterContext.TOKENS  # the engine passes committed token ids, not target features

    def __init__(self, engine_dir: Path, manifest: Manifest, device: str = "auto", threads: int | None = None):
        d = manifest.drafter
        cfg = d.config
        graph = manifest.graphs["drafter"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        super().__init__(engine_dir, graph, (cfg["num_hidden_layers"], cfg["num_key_value_heads"], hd), device,
                         threads)
        self.num_draft_tokens = int(d.num_draft_tokens)
        self.pard_token = int(d.details["pard_token"])
        self.max_positions = int(cfg["max_position_embeddings"])
        self.vocab_size = int(cfg["vocab_size"])
        self._drafter_setup(engine_dir, manifest, graph)

    def can_draft(self, committed: int) -> bool:
        """True when the K-1 mask slots after the bonus token (position ``committed``) fit the drafter."""
        return committed + self.num_draft_tokens <= self.max_positions

    def draft(self, caches: list[KVCache], bonus_tokens: list[int], contexts: list[np.ndarray],
              query_scale: list[bool] | None = None, num_tokens: int | None = None) -> np.ndarray:
        """Draft K tokens after each row's bonus token (``num_tokens`` is accepted and ignored: K is static in a
        PARD graph and all K come from one forward).

        Args:
            caches: per row, the drafter cache of committed positions 0 .. kv_len - 1.
            bonus_tokens: per row the last token the target produced (position s).
            contexts: per row the committed token ids before the bonus token, int64 ``[s]`` (the whole history;
                only positions kv_len .. s - 1 are fed, the rest is cached).
            query_scale: per row, False = beta 1 through ``query_scale_enabled``; None = on for every row.
        Returns:
            logits ``[batch, K, vocab]`` f32.
        Raises:
            ValueError: a row's history is shorter than its cache, or asks for the scale off without a switch input.
        """
        flags = self._row_flags(query_scale, len(caches))
        k = self.num_draft_tokens
        rows = []
        for cache, bonus, hist in zip(caches, bonus_tokens, contexts):
            if len(hist) < cache.length:
                raise ValueError(f"history of {len(hist)} tokens is shorter than the drafter cache ({cache.length})")
            rows.append([*np.asarray(hist[cache.length:], np.int64).tolist(), int(bonus)])
        lens = [len(r) for r in rows]  # real tokens fed per row (kept in the cache)
        b, q = len(rows), max(lens) + k - 1
        past, l_max = pad_caches(caches)
        # each row: its real tokens, then K - 1 PARD mask tokens (shown), then hidden placeholders
        feed = rows_after_past([c.length for c in caches], rows, l_max, width=q, pad_id=self.pard_token,
                               visible=[n + k - 1 for n in lens], max_positions=self.max_positions).feed()
        feed["logits_start"] = np.asarray(lens, np.int64) - 1
        (logits,) = self._run_drafter(feed, flags, past, caches, l_max, lens)
        return logits


class OrtEagle3Drafter(_Graph):
    """EAGLE-3 drafter: an ``fc`` graph and a step graph (export/families/eagle3/graph.py ``export_eagle3_drafter``),
    chain drafting.

    Drafter position p holds the pair (token p + 1, target feature h_p). One round at bonus position s:
      1. context pass: the pairs of the positions the cache lacks (tokens up to the bonus x_s, ``fc`` of their
         target features) in one batched call; the last row's draft is d_1 and its output is recycled;
      2. K - 1 chain steps: one query per row at the next position, input (d_{j-1}, previous output), no ``fc``;
      3. the chain steps' K/V are dropped (the cache keeps committed positions only).
    Drafts are the draft head's argmax mapped to target ids (``d2t`` in the graph), as vLLM / TensorRT-LLM chain
    drafting does; the returned logits put all mass on them (q is one-hot), so greedy and rejection-sampled
    verification stay exact. Per query row beta is computed in-graph from the causal mask (N = position + 1).
    """

    family = Family.EAGLE3
    verification = Verification.REJECTION
    context = DrafterContext.FEATURES_AND_TOKENS

    def __init__(self, engine_dir: Path, manifest: Manifest, device: str = "auto", threads: int | None = None):
        import onnxruntime as ort

        d = manifest.drafter
        cfg = d.config
        graph = manifest.graphs["drafter"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        super().__init__(engine_dir, graph, (1, cfg["num_key_value_heads"], hd), device, threads)
        self.fc = ort.InferenceSession(str(engine_dir / manifest.graphs["drafter_fc"].file),
                                       session_options(threads, self.role), providers=providers(device))
        self.num_draft_tokens = int(d.num_draft_tokens)
        # the head's own positions where its config says, else the target's (it drafts at the target's positions)
        self.max_positions = int(cfg.get("max_position_embeddings") or manifest.target.max_position_embeddings)
        self.vocab_size = int(manifest.target.vocab_size)
        self._drafter_setup(engine_dir, manifest, graph)

    def can_draft(self, committed: int) -> bool:
        """True when the chain's last position (committed - 1 + K - 1) fits the drafter's positions."""
        return committed + self.num_draft_tokens - 1 <= self.max_positions

    def _step(self, caches, ids, hidden, pos, lens, flags, keep):
        """One step-graph call; rows right-padded to the longest; appends ``keep[r]`` rows' K/V to each cache."""
        b, q = ids.shape
        past, l_max = pad_caches(caches)
        mask = attention_mask([c.length for c in caches], lens, l_max, q)
        feed = {"input_ids": ids, "hidden": hidden, "position_ids": pos, "attention_mask": mask,
                "logits_start": np.asarray(lens, np.int64) - 1}
        _, token, hidden_out = self._run_drafter(feed, flags, past, caches, l_max, keep)
        return token[:, 0], hidden_out

    def draft(self, caches: list[KVCache], bonus_tokens: list[int], contexts: list[tuple[np.ndarray, np.ndarray]],
              query_scale: list[bool] | None = None, num_tokens: int | None = None) -> np.ndarray:
        """Draft K tokens (or the first ``num_tokens``: the chain stops there) after each row's bonus token.

        Args:
            caches: per row, the drafter cache of positions 0 .. kv_len - 1.
            bonus_tokens: per row the bonus token x_s.
            contexts: per row (target features ``[s - kv_len, 3 * target_hidden]`` f32 of positions kv_len .. s - 1,
                committed token ids ``[s]`` int64 before the bonus).
            query_scale: per row, False = beta 1 via ``query_scale_enabled``; None = on for every row.
        Returns:
            logits ``[batch, K, vocab]`` f32: 0 at each draft token, -inf elsewhere.
        Raises:
            ValueError: a row has no pending position, or asks for the scale off without a switch input.
        """
        flags = self._row_flags(query_scale, len(caches))
        b = len(caches)
        k = self.num_draft_tokens if num_tokens is None else max(1, min(int(num_tokens), self.num_draft_tokens))
        lens = [feats.shape[0] for feats, _ in contexts]
        if min(lens) < 1:
            raise ValueError("EAGLE-3 drafting needs at least one pending position per row (the bonus pair)")
        starts = [c.length for c in caches]
        q = max(lens)
        feats = np.zeros((b, q, contexts[0][0].shape[1]), np.float32)
        ids = np.zeros((b, q), np.int64)
        for r, ((f, hist), bonus) in enumerate(zip(contexts, bonus_tokens)):
            n, c = lens[r], starts[r]
            feats[r, :n] = f
            ids[r, :n] = [*np.asarray(hist[c + 1:], np.int64).tolist(), int(bonus)]  # token p + 1 at position p
        pos = positions(starts, q, self.max_positions)
        (hidden,) = self._run(["hidden"], {"target_features": feats}, self.fc)
        token, out = self._step(caches, ids, hidden, pos, lens, flags, lens)
        drafts = [token]
        committed = [c + n for c, n in zip(starts, lens)]
        for j in range(1, k):
            p = np.asarray([[min(c + j - 1, self.max_positions - 1)] for c in committed], np.int64)
            token, out = self._step(caches, drafts[-1][:, None].astype(np.int64), out, p, [1] * b, flags, [1] * b)
            drafts.append(token)
        for cache, c in zip(caches, committed):
            cache.truncate(c)  # chain positions were never verified
        logits = np.full((b, k, self.vocab_size), -np.inf, np.float32)
        for j, tok in enumerate(drafts):
            logits[np.arange(b), j, tok] = 0.0
        return logits


ORT_DRAFTERS: dict[Family, type] = {cls.family: cls for cls in (OrtDFlashDrafter, OrtPardDrafter, OrtEagle3Drafter)}


def ort_drafter_class(family: "Family | str") -> type:
    """The ONNX Runtime drafter class for a manifest's ``drafter.family``.

    Raises:
        EngineDirError: a family this runtime cannot run (a folder from a newer sharpdraft: re-export it).
    """
    try:
        return ORT_DRAFTERS[Family.parse(family)]
    except (KeyError, ValueError):
        from runtime.manifest import EngineDirError

        raise EngineDirError(f"drafter family {family!r} is not supported by this runtime (it runs "
                             f"{', '.join(f.value for f in ORT_DRAFTERS)}); re-export with this version") from None
