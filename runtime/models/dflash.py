"""DFlash block-diffusion drafter (z-lab, arXiv 2602.06036) in PyTorch, faithful to the public checkpoint format.

Checkpoint format (``z-lab/Qwen3-8B-DFlash-b16`` and peers; docs/reference/drafters.md §1.4, §6.1):
``config.json`` = Qwen3Config fields + ``block_size`` + ``dflash_config: {mask_token_id, target_layer_ids}``;
safetensors keys without a ``model.`` prefix: ``fc``, ``hidden_norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
``layers.{i}.{input,post_attention}_layernorm``, ``norm``. Embedding and LM head are borrowed from the target.

Mask token for targets without a spare id (sharpdraft's scheme, the way vLLM accepts MiMo's separate mask
embedding): the checkpoint may carry one extra tensor ``mask_embedding`` ``[hidden]`` and set
``dflash_config.mask_token_id`` to ``vocab_size`` (one past the target vocabulary). Block slots holding that id
are embedded with ``mask_embedding`` instead of a row of the target's table. SmolLM2 has no unused id, so the demo
drafter uses this scheme; checkpoints whose mask id is a real vocabulary row (Qwen3's 151669) load unchanged.

SharpDraft: the query of every block slot is multiplied by beta(N) after ``q_norm`` (and RoPE), N = s + B:
all s committed context keys plus the B block keys (non-causal).

Attention implementations (``attention_impl`` of :class:`DFlashAttention` / :class:`DFlashDrafter`):
``"eager"`` (default; what ONNX export traces) computes the softmax inline and multiplies a precomputed beta onto
the query; ``"fused"`` calls ``torch.ops.sharpdraft.query_scaled_attention`` (plugins/torch_op.py: torch reference
on CPU, Triton kernel on CUDA), which computes beta(N) itself per row from the visible keys, given a
:class:`plugins.rule.QueryScaleProfile` and per-row on/off flags instead of a beta.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models import attention_probe
from runtime.models.checkpoint_io import CheckpointError, check_state, read_safetensors
from runtime.models.layers import RMSNorm, SwiGLUMLP, apply_rope, rope_cos_sin, rope_type_of
from plugins.rule import Family, beta_torch, count_visible, switch_rows
from runtime.modes import AttentionImpl


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps when the config omits them: spread over [1, L-3]; one draft layer -> [L // 2]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _layer_windows(d: dict[str, Any], dcfg: dict[str, Any], n_layers: int) -> list[int | None]:
    """Per-layer sliding windows from ``layer_types`` + ``sliding_window`` (z-lab, Qwen3.5 / 3.6 DFlash), or from
    ``dflash_config.use_swa`` + ``swa_window_size`` (every layer). [] when every layer is full.

    Raises:
        CheckpointError: unknown layer types, a count that is not the layer count, sliding layers without a window,
            or ``dflash_config.causal: true`` (DFlash layers here are non-causal, as z-lab's reference).
    """
    types = d.get("layer_types") or []
    window = dcfg.get("swa_window_size") or d.get("sliding_window")
    if dcfg.get("causal") or dcfg.get("is_causal") or d.get("is_causal"):
        raise CheckpointError("causal DFlash layers (dflash_config.causal / is_causal: true) are not supported: "
                              "sharpdraft runs DFlash blocks non-causally, as z-lab's reference does")
    if types:
        if len(types) != n_layers:
            raise CheckpointError(f"layer_types has {len(types)} entries for {n_layers} layers")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise CheckpointError(f"layer_types {unknown} are not supported (full_attention, sliding_attention)")
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = [bool(dcfg.get("use_swa"))] * n_layers
    if not any(sliding):
        return []
    if not window or int(window) < 1:
        raise CheckpointError("sliding_attention layers need a window: set sliding_window (or "
                              "dflash_config.swa_window_size)")
    return [int(window) if s else None for s in sliding]


def _neutral_number(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == 1.0)


def refuse_unimplemented(d: dict[str, Any], dcfg: dict[str, Any], head_dim: int, rope_theta: float) -> None:
    """Refuse config fields that change a DFlash drafter's computation and that this runtime does not implement,
    unless they hold their neutral value; a drafter loaded without them would run other math, silently (MiMo's
    DFlash config: partial rotary, a value scale, attention sinks, its own rotary base for the context keys).
    Fields that change nothing at inference (training keys such as ``num_anchors``, ``loss_decay_gamma``) pass.

    ``d``: the top-level config (its ``dflash_config`` popped into ``dcfg``).
    Raises:
        CheckpointError: one line naming each such field, its value and the neutral value it would need.
    """
    rope = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    bad = []

    def check(name: str, value, neutral: bool, want: str) -> None:
        if not neutral:
            bad.append(f"{name}={value!r} (needs {want})")

    for name in ("partial_rotary_factor",):
        for where, src in ((name, d), (f"rope_parameters.{name}", rope)):
            check(where, src.get(name), _neutral_number(src.get(name)), "1.0")
    v_dim = d.get("v_head_dim")
    check("v_head_dim", v_dim, v_dim is None or int(v_dim) == head_dim, f"= head_dim {head_dim}")
    for name in ("rope_scaling", "rope_parameters"):
        kind = rope_type_of(d.get(name) if isinstance(d.get(name), dict) else None)
        check(f"{name}.rope_type", kind, kind == "default", "'default' rotary")
    act = d.get("hidden_act")
    check("hidden_act", act, act in (None, "silu"), "'silu'")
    for name in ("mlp_bias",):
        check(name, d.get(name), not d.get(name), "false")
    for name in ("attention_value_scale", "attention_output_scale", "output_multiplier"):
        for where, src in ((f"dflash_config.{name}", dcfg), (name, d)):
            check(where, src.get(name), _neutral_number(src.get(name)), "1")
    for name in ("attention_sink_bias", "attention_sinks", "use_attention_sink"):
        for where, src in ((f"dflash_config.{name}", dcfg), (name, d)):
            check(where, src.get(name), not src.get(name), "false")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        for where, src in ((f"dflash_config.{name}", dcfg), (name, d)):
            check(where, src.get(name), src.get(name) is None, "null")
    base = dcfg.get("backbone_rotary_base")
    check("dflash_config.backbone_rotary_base", base, base is None or float(base) == float(rope_theta),
          f"= rope_theta {rope_theta:g}")
    neox = d.get("is_neox_style", dcfg.get("is_neox_style"))
    check("is_neox_style", neox, neox in (None, True), "true")
    if bad:
        raise CheckpointError(f"DFlash config fields that change the computation, not implemented by sharpdraft: "
                              f"{'; '.join(bad)}")


def refuse_lookalikes(d: dict[str, Any]) -> None:
    """Refuse, with one message naming what is missing, the drafters whose configs resemble DFlash's but whose
    weights and decoding differ: DFlash2 (conv layers + candidate selector), DSpark (Markov / confidence heads),
    speculators-format DFlash (its own embedding and draft-vocabulary LM head). Raises CheckpointError."""
    arch = " ".join(d.get("architectures") or [])
    dcfg = d.get("dflash_config") or {}
    if "DFlash2" in arch or any(k in dcfg for k in ("conv_kernel_size", "selector_rank", "selector_top_k")):
        raise CheckpointError(f"{arch or 'this config'} is a DFlash2 drafter: sharpdraft supports DFlash v1 only "
                              "(missing: the per-layer attention_conv / mlp_conv kernels and the candidate_selector "
                              "that re-ranks block candidates); it cannot be loaded as plain DFlash. ONNX Runtime "
                              "GenAI's model builder (0.18) exports it with its target for ORT GenAI's own CUDA "
                              "loop: --extra_options use_paged_attention=true dflash2_path=DIR")
    if "DSpark" in arch or "markov_rank" in d or "markov_head_type" in d:
        raise CheckpointError(f"{arch or 'this config'} is a DSpark drafter: not supported (missing: its Markov head, "
                              "confidence head and own embedding / LM head); it cannot be loaded as plain DFlash. "
                              "ONNX Runtime GenAI's model builder (0.18) exports it with its target for ORT GenAI's "
                              "own CUDA loop: --extra_options use_paged_attention=true dspark_path=DIR")
    kind = d.get("speculators_model_type")
    if kind is not None and kind != Family.DFLASH:
        known = kind in {f.value for f in Family}
        raise CheckpointError(f"a speculators-format {kind} drafter (speculators_model_type {kind!r}) is not a DFlash "
                              f"drafter; use --drafter {kind if known else 'with the family it belongs to'}")


def from_speculators(d: dict[str, Any]) -> dict[str, Any]:
    """A speculators-format DFlash ``config.json`` (vLLM's ``speculators_model_type: "dflash"``) as the z-lab
    layout :meth:`DFlashConfig.from_dict` reads, plus ``own_lm_head`` (its draft-vocabulary LM head's rows).

    Conventions (speculators' DFlash config and converter, vLLM's ``update_dflash``): the layer config is nested
    under ``transformer_layer_config``; ``aux_hidden_state_layer_ids`` are z-lab ids + 1 (vLLM maps them back with
    ``i - 1``), so ``target_layer_ids = [i - 1 for i in aux]``; ``mask_token_id`` is top-level; sliding layers are
    causal inside the block unless ``sliding_window_non_causal`` (full layers are always bidirectional); with
    ``sample_from_anchor`` the bonus slot drafts too. The checkpoint's ``lm_head`` scores ``draft_vocab_size``
    rows, mapped to target ids by ``d2t`` (``target = draft + d2t[draft]``) when smaller than the vocabulary; its
    ``embed_tokens`` is a frozen copy of the verifier's (the target's table is used instead).

    Raises:
        CheckpointError: a field this runtime needs is null or a setting it cannot run, named.
    """
    t = d.get("transformer_layer_config")
    if not isinstance(t, dict):
        raise CheckpointError("speculators DFlash config: transformer_layer_config is missing")
    aux = d.get("aux_hidden_state_layer_ids")
    if not aux:
        raise CheckpointError("speculators DFlash config: aux_hidden_state_layer_ids is null, so the target layers the "
                              "drafter reads are unknown; set it to the verifier layers it was trained on "
                              "(speculators' convention: z-lab's target_layer_ids + 1)")
    mask = d.get("mask_token_id", (d.get("dflash_config") or {}).get("mask_token_id"))
    if mask is None:
        raise CheckpointError("speculators DFlash config: mask_token_id is not set (speculators stores it top-level; "
                              "the drafter cannot fill its block without it); set the id it was trained with")
    if d.get("sample_from_anchor"):
        raise CheckpointError("speculators DFlash config: sample_from_anchor true (the bonus slot drafts too) is not "
                              "supported: sharpdraft drafts block slots 1..B-1 after the bonus token")
    if t.get("rope_scaling") not in (None, {}) and (t["rope_scaling"].get("rope_type") or
                                                      t["rope_scaling"].get("type")) not in (None, "default"):
        raise CheckpointError(f"speculators DFlash config: rope_scaling {t['rope_scaling']} is not supported by the "
                              "DFlash drafter (plain RoPE only)")
    sliding = "sliding_attention" in (t.get("layer_types") or []) or bool(t.get("use_sliding_window"))
    flat = {k: v for k, v in t.items() if k not in ("model_type", "architectures")}
    flat.update(block_size=int(d.get("block_size", 8)), model_type="qwen3",
                dflash_config={"mask_token_id": int(mask), "target_layer_ids": [int(i) - 1 for i in aux],
                               "causal": sliding and not d.get("sliding_window_non_causal", False)},
                own_lm_head=int(d.get("draft_vocab_size") or t["vocab_size"]), speculators_config=d.get(
                    "speculators_config"), num_target_layers=None)
    return flat


@dataclasses.dataclass(slots=True)
class DFlashConfig:
    """Fields of a DFlash ``config.json`` that the drafter uses (others are kept in ``extra``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    query_scale: dict | None = None  # sharpdraft extension: a QueryScaleProfile dict suited to this drafter
    extra: dict = dataclasses.field(default_factory=dict)
    # per layer: the sliding window W of a "sliding_attention" layer, None for a full one ([] = all full). A block
    # query at position p sees the keys at positions > p - W (and, non-causal as every DFlash layer, the whole block)
    layer_windows: list = dataclasses.field(default_factory=list)
    # speculators format: rows of the drafter's own LM head (draft vocabulary, target ids through d2t); None: the
    # target's LM head is borrowed (z-lab layout)
    own_lm_head: int | None = None
    # False when the config does not say how many layers the target has (speculators format): the pair check then
    # only asks that every tapped layer exist
    num_target_layers_known: bool = True

    @property
    def windows(self) -> list[int | None]:
        """The window of every layer (None: full attention)."""
        return self.layer_windows or [None] * self.num_hidden_layers

    @property
    def sliding(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (bonus slot + at least one draft slot), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if not self.target_layer_ids or any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be non-empty and within "
                             f"[0, num_target_layers={self.num_target_layers})")

    @property
    def uses_mask_embedding(self) -> bool:
        return self.mask_token_id >= self.vocab_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        """Parse a DFlash ``config.json`` dict (Qwen3Config + DFlash fields): z-lab's layout (``dflash_config`` with
        ``mask_token_id`` / ``target_layer_ids``, ``block_size`` top-level or in ``dflash_config``) and the flat
        variant (those fields top-level). Raises CheckpointError if incomplete, for a drafter of another kind
        that only looks like DFlash (:func:`refuse_lookalikes`), or for fields that change the computation and are
        not implemented (:func:`refuse_unimplemented`)."""
        refuse_lookalikes(d)
        d = from_speculators(d) if d.get("speculators_model_type") == Family.DFLASH else dict(d)
        dcfg = d.pop("dflash_config", None) or {}
        for name in ("mask_token_id", "target_layer_ids", "block_size"):  # flat variant; dflash_config wins
            if name not in dcfg and name in d:
                dcfg[name] = d[name]
        try:
            rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 1_000_000.0
            n_layers = int(d["num_hidden_layers"])
            ids = dcfg.get("target_layer_ids")
            # the target's depth: stated, else unknown when the taps are given (speculators, trimmed z-lab configs:
            # the pair check then asks only that the tapped layers exist), else the drafter's own (old configs)
            known_target = d.get("num_target_layers") is not None or not ids
            n_target = int(d.get("num_target_layers") or (d["num_hidden_layers"] if known_target else max(ids) + 1))
            ids = ids or build_target_layer_ids(n_target, n_layers)
            known = dict(
                hidden_size=int(d["hidden_size"]), num_hidden_layers=n_layers,
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
                intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
                block_size=int(dcfg["block_size"]), mask_token_id=int(dcfg["mask_token_id"]),
                target_layer_ids=[int(i) for i in ids], num_target_layers=n_target,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                attention_bias=bool(d.get("attention_bias", False)), query_scale=d.get("sharpdraft_query_scale"),
                own_lm_head=d.get("own_lm_head"), num_target_layers_known=known_target)
        except KeyError as e:
            where = " (in dflash_config or top-level)" if e.args[0] in ("mask_token_id", "block_size") else ""
            raise CheckpointError(f"DFlash config is missing field {e.args[0]!r}{where}") from e
        refuse_unimplemented(d, dcfg, known["head_dim"], known["rope_theta"])
        known["layer_windows"] = _layer_windows(d, dcfg, n_layers)
        keys = set(known) | {"dflash_config", "rope_parameters", "sharpdraft_query_scale", "target_layer_ids",
                             "layer_types", "sliding_window", "use_sliding_window", "own_lm_head"}
        return cls(**known, extra={k: v for k, v in d.items() if k not in keys})

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict in the public DFlash layout."""
        out = dict(self.extra)
        out.update(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=self.hidden_size,
                   num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                   num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                   intermediate_size=self.intermediate_size, vocab_size=self.vocab_size, block_size=self.block_size,
                   num_target_layers=self.num_target_layers, rms_norm_eps=self.rms_norm_eps,
                   rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
                   attention_bias=self.attention_bias, hidden_act="silu",
                   layer_types=["full_attention" if w is None else "sliding_attention" for w in self.windows],
                   dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids})
        if self.sliding:
            out["sliding_window"] = next(w for w in self.windows if w is not None)
            out["use_sliding_window"] = True
        if not self.num_target_layers_known:  # not stated by the checkpoint: not invented either
            out.pop("num_target_layers")
        if self.query_scale is not None:
            out["sharpdraft_query_scale"] = self.query_scale
        return out


ATTENTION_IMPLS = tuple(AttentionImpl)


def _check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(a.value for a in AttentionImpl)}, got {impl!r}")
    return AttentionImpl(impl)


def _masked(scores: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Scores ``[..., q, keys]`` with ``attn_mask`` applied: a bool mask (True = visible) sets hidden keys to -inf,
    any other dtype is added; None leaves them as they are."""
    if attn_mask is None:
        return scores
    return scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask


class DFlashAttention(nn.Module):
    """DFlash block attention; ``attention_impl`` "eager" (inline softmax) or "fused" (the sharpdraft op)."""

    def __init__(self, cfg: DFlashConfig, attention_impl: str = "eager"):
        super().__init__()
        self.attention_impl = _check_impl(attention_impl)
        # eager path under a per-query mask (a sliding layer): True folds grouped-query heads into the query rows
        # (no K/V copy per head: the exported default drafter); False repeats K/V per head, the graph form
        # export/fuse.py matches for --fused-attention (its op anchors each query row's window at its position)
        self.fold_per_query_masks = True
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.scaling = hd ** -0.5
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.hd).transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K/V of context features ``ctx`` [batch, c, hidden] -> two ``[batch, kv_heads, c, head_dim]``."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(ctx), self.nkv)), cos, sin)
        return k, self._heads(self.v_proj(ctx), self.nkv)

    def forward(self, x, ctx_k, ctx_v, cos, sin, attn_mask=None, query_scale=None, profile=None, rows_on=None,
                window=None):
        """Non-causal block attention.

        Args:
            x: normalised block states ``[batch, B, hidden]``.
            ctx_k, ctx_v: context K/V ``[batch, kv_heads, s, head_dim]`` (cached + new context rows), or tuples of
                such pieces along the key axis (e.g. (cache, new rows)), joined with the block keys in one concat.
            cos, sin: RoPE tables of the block positions ``[batch, 1, B, head_dim]``.
            attn_mask: optional additive/bool mask broadcastable to ``[batch, 1, B, s + B]`` (training; ragged
                batches); None = all visible. The fused path takes only a per-key bool mask ``[batch, 1, 1, s + B]``.
            query_scale: beta, a float or a tensor broadcastable to ``[batch, 1, B, 1]``; None = 1.
            profile: fused path only: a :class:`plugins.rule.QueryScaleProfile`; the op computes beta(N) per row
                from that row's visible keys (N = ``attn_mask`` count). None = beta 1.
            rows_on: fused path only: optional bool ``[batch]``, False = beta 1 for that row; None = all on.
            window: fused path only: this layer's sliding window W (None = full attention); the op anchors it at
                each block query's own position (keys at positions > p - W, positions = ranks of the visible keys),
                which is :meth:`DFlashDrafter.window_mask` on the eager path.
        Returns:
            ``[batch, B, hidden]``.
        Raises:
            ValueError: ``profile``/``rows_on``/``window`` on the eager path, or a mask the fused path cannot take.
        """
        b, q_len, _ = x.shape
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.nh)), cos, sin)
        if query_scale is not None:
            q = q * query_scale  # SharpDraft: after q_norm and RoPE (RoPE is linear), before attention
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.nkv)), cos, sin)
        v_blk = self._heads(self.v_proj(x), self.nkv)
        k = torch.cat([*ctx_k, k_blk] if isinstance(ctx_k, tuple) else [ctx_k, k_blk], dim=2)
        v = torch.cat([*ctx_v, v_blk] if isinstance(ctx_v, tuple) else [ctx_v, v_blk], dim=2)
        if self.attention_impl == AttentionImpl.FUSED:
            out = self._fused(q, k, v, attn_mask, profile, rows_on, window)
            return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.nh * self.hd))
        if window is not None:
            raise ValueError("the eager path takes a sliding layer's window as its mask (DFlashDrafter.window_mask)")
        if profile is not None or rows_on is not None:  # beta per query row from this layer's own mask
            if attn_mask is None or attn_mask.dtype != torch.bool:
                raise ValueError("the eager path computes beta from a bool attn_mask (True = visible); pass one, or "
                                 "a precomputed query_scale")
            beta = switch_rows(beta_torch(count_visible(attn_mask.expand(b, 1, -1, -1)), profile)
                               if profile is not None else torch.ones(b, 1, 1, 1),
                               None if rows_on is None else rows_on.float())
            q = q * beta.to(q.dtype)
        per_query = attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[2] != 1
        if per_query and not self.fold_per_query_masks:  # the form export/fuse.py matches (window per query row)
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = _masked(torch.matmul(q, k.transpose(-1, -2)) * self.scaling, attn_mask)  # [b, heads, B, keys]
            attention_probe.emit(self, scores)
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            return self.o_proj(torch.matmul(probs, v).transpose(1, 2).reshape(b, q_len, self.nh * self.hd))
        return self.o_proj(self._grouped(q, k, v, attn_mask))

    def _grouped(self, q, k, v, attn_mask):
        """Eager attention with grouped-query heads folded into the query rows.

        q ``[b, heads, B, hd]`` -> ``[b, kv_heads, groups * B, hd]`` against k/v ``[b, kv_heads, keys, hd]``, so
        K/V are read once per KV head and never repeated per head (in the exported graph: no ``Expand`` of the
        cache, a third of the reads). ``attn_mask``: None, a per-key ``[b, 1, 1, keys]`` or a per-query
        ``[b, 1, B, keys]`` mask (a sliding layer's window), bool or additive; a per-query mask is repeated over
        the groups (``[b, 1, groups * B, keys]``: the small mask is copied, not the cache). Same result as the
        repeated form (tests/runtime/test_dflash_model.py). Returns ``[b, B, heads * hd]`` before ``o_proj``.
        """
        b, _, q_len, _ = q.shape
        groups = self.nh // self.nkv
        qg = q.reshape(b, self.nkv, groups * q_len, self.hd)
        if attn_mask is not None and attn_mask.dim() < 4:  # broadcastable to [b, 1, B, keys]: make it 4-d
            attn_mask = attn_mask[(None,) * (4 - attn_mask.dim())]
        if attn_mask is not None and attn_mask.shape[2] != 1:
            m = attn_mask.expand(b, 1, q_len, attn_mask.shape[-1])  # row g * B + t of a KV head: query t's mask
            attn_mask = m[:, :, None].expand(b, 1, groups, q_len, m.shape[-1]).reshape(b, 1, groups * q_len,
                                                                                       m.shape[-1])
        scores = _masked(torch.matmul(qg, k.transpose(-1, -2)) * self.scaling, attn_mask)  # [b, kv, g * B, keys]
        if attention_probe.active():
            attention_probe.emit(self, scores.reshape(b, self.nh, q_len, scores.shape[-1]))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v).reshape(b, self.nh, q_len, self.hd)
        return out.transpose(1, 2).reshape(b, q_len, self.nh * self.hd)

    def _fused(self, q, k, v, attn_mask, profile, rows_on, window=None):
        """``torch.ops.sharpdraft.query_scaled_attention`` over q ``[b, heads, B, hd]``, k/v ``[b, kv_heads, keys,
        hd]`` (GQA in the op) -> ``[b, heads, B, hd]``; rows with ``rows_on`` False run with the profile off."""
        from plugins.torch_op import attention

        key_mask = None
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1:3] != (1, 1):
                raise ValueError("attention_impl='fused' takes a per-key bool mask [batch, 1, 1, keys] "
                                 f"(got {attn_mask.dtype} {tuple(attn_mask.shape)})")
            key_mask = attn_mask[:, 0, 0, :].expand(q.shape[0], k.shape[2])
        on = profile is not None and profile.enabled
        off = profile.replace(enabled=False) if on else None

        def run(rows, prof):
            sel = (lambda t: t) if rows is None else (lambda t: None if t is None else t[rows])
            return attention(sel(q), sel(k), sel(v), None, prof, causal=False, window=window, scale=self.scaling,
                             key_mask=sel(key_mask))

        if not on or rows_on is None or bool(rows_on.all()):
            return run(None, profile if on else None)
        if not bool(rows_on.any()):
            return run(None, off)
        idx_on, idx_off = rows_on.nonzero().flatten(), (~rows_on).nonzero().flatten()
        out = torch.empty_like(q)
        out[idx_on] = run(idx_on, profile)
        out[idx_off] = run(idx_off, off)
        return out


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, attention_impl: str = "eager"):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, attention_impl)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, ctx_k, ctx_v, cos, sin, attn_mask=None, query_scale=None, profile=None, rows_on=None,
                window=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx_k, ctx_v, cos, sin, attn_mask, query_scale,
                               profile, rows_on, window)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """DFlash drafter body: ``fc``/``hidden_norm`` context projector, ``layers``, ``norm`` (+ ``mask_embedding``).

    ``attention_impl``: "eager" (default, exported to ONNX) or "fused" (module docstring); settable later.
    """

    def __init__(self, cfg: DFlashConfig, attention_impl: str = "eager"):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, attention_impl) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h)) if cfg.uses_mask_embedding else None
        # speculators format: the drafter's own LM head over its draft vocabulary (d2t: target id - draft id)
        self.lm_head = nn.Linear(h, cfg.own_lm_head, bias=False) if cfg.own_lm_head else None
        if cfg.own_lm_head and cfg.own_lm_head < cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.own_lm_head, dtype=torch.long))
        else:
            self.d2t = None

    def head_target_ids(self) -> torch.Tensor | None:
        """int64 ``[draft_vocab]``: the target id of each row of the drafter's own LM head (``draft + d2t[draft]``);
        None when the head borrows the target's (z-lab layout) or scores the whole vocabulary."""
        if self.lm_head is None or self.d2t is None:
            return None
        return torch.arange(self.d2t.numel()) + self.d2t

    @property
    def attention_impl(self) -> str:
        return self.layers[0].self_attn.attention_impl

    @attention_impl.setter
    def attention_impl(self, impl: str) -> None:
        """Switch every layer to "eager" or "fused". Raises ValueError for another name."""
        _check_impl(impl)
        for layer in self.layers:
            layer.self_attn.attention_impl = impl

    def embed_block(self, block_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Embed block ids ``[batch, B]`` int64 with the target's table ``[vocab, hidden]`` -> ``[batch, B, hidden]``.

        Ids equal to ``mask_token_id`` use ``mask_embedding`` when the checkpoint carries one.
        """
        if self.mask_embedding is None:
            return F.embedding(block_ids, embed_weight)
        is_mask = (block_ids == self.config.mask_token_id)[..., None]
        emb = F.embedding(block_ids.clamp(max=embed_weight.shape[0] - 1), embed_weight)
        return torch.where(is_mask, self.mask_embedding.to(emb.dtype), emb)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Tapped target features ``[batch, c, len(ids) * hidden]`` -> context states ``[batch, c, hidden]``."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, block_embeds, target_hidden, position_ids, past_kv=None, query_scale=None, key_mask=None,
                profile=None, rows_on=None, new_kv_only: bool = False):
        """One draft step (inference form, cached context K/V).

        Args:
            block_embeds: ``[batch, B, hidden]`` block embeddings (bonus token + masks).
            target_hidden: ``[batch, c_new, len(target_layer_ids) * hidden]`` features of context positions not yet
                in ``past_kv`` (c_new may be 0).
            position_ids: ``[batch, c_new + B]`` int64 absolute positions of those context rows, then the block.
            past_kv: list over layers of (k, v) ``[batch, kv_heads, c_past, head_dim]`` or None.
            query_scale: beta (see :meth:`DFlashAttention.forward`), e.g. ``[batch, 1, 1, 1]`` per row; None = 1.
            key_mask: ``[batch, c_past + c_new + B]`` bool/int, 1 = visible key (ragged batches: right-padded
                cache and context rows are 0); None = every key visible. N of row b = ``key_mask[b].sum()``.
            profile: ``attention_impl="fused"`` only: :class:`plugins.rule.QueryScaleProfile`; the op computes
                beta(N) per row from ``key_mask`` (instead of a precomputed ``query_scale``). None = beta 1.
            rows_on: ``attention_impl="fused"`` only: bool ``[batch]``, False = beta 1 for that row.
            new_kv_only: return only the c_new context rows' K/V (static caches append them in place; the
                static-KV drafter graph, export/graphs.py).
        Returns:
            (hidden ``[batch, B, hidden]`` after ``norm``, new_kv: per layer (k, v) over c_past + c_new context rows,
            or the c_new rows only with ``new_kv_only``; block K/V are never cached, so the cache never holds
            unverified keys).
        Raises:
            ValueError: ``profile``/``rows_on`` with the eager implementation.
        """
        c_new = target_hidden.shape[1]
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, block_embeds.dtype)
        ctx = self.project_context(target_hidden)
        attn_mask = None if key_mask is None else key_mask.to(torch.bool)[:, None, None, :]  # [batch, 1, 1, keys]
        windows = self.config.windows
        fused = self.attention_impl == AttentionImpl.FUSED
        c_past = 0 if past_kv is None else past_kv[0][0].shape[2]
        # key positions: the cache holds positions 0..c_past-1 in order, then the new context rows and the block
        key_pos = torch.cat([torch.arange(c_past, device=position_ids.device)[None].expand(position_ids.shape[0], -1),
                             position_ids], dim=1) if self.config.sliding and not fused else None
        h, new_kv = block_embeds, []
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.self_attn.context_kv(ctx, cos[:, :, :c_new], sin[:, :, :c_new])
            if new_kv_only:  # the cache is read where it lies: one concat (cache, new rows, block) per call
                new_kv.append((k_new, v_new))
                if past_kv is not None:
                    k_new, v_new = (past_kv[i][0], k_new), (past_kv[i][1], v_new)
            else:
                if past_kv is not None:
                    k_new = torch.cat([past_kv[i][0], k_new], dim=2)
                    v_new = torch.cat([past_kv[i][1], v_new], dim=2)
                new_kv.append((k_new, v_new))
            mask, window = attn_mask, None
            if fused:  # the op takes the window itself
                window = windows[i]
            elif windows[i] is not None:
                mask = self.window_mask(key_pos, position_ids[:, c_new:], windows[i], attn_mask)
            h = layer(h, k_new, v_new, cos[:, :, c_new:], sin[:, :, c_new:], mask, query_scale, profile, rows_on,
                      window)
        return self.norm(h), new_kv

    @staticmethod
    def window_mask(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int,
                    key_mask: torch.Tensor | None) -> torch.Tensor:
        """A sliding layer's mask ``[batch, 1, B, keys]`` bool: query at position p sees key j iff ``pos(j) > p -
        window`` (and ``key_mask`` shows it); ``key_pos`` ``[batch, keys]``, ``query_pos`` ``[batch, B]``."""
        ok = key_pos[:, None, :] > (query_pos[:, :, None] - window)
        if key_mask is not None:
            ok = ok & key_mask[:, :, 0]  # [batch, 1, keys] over the query axis
        return ok[:, None]


def load_dflash(path: str | Path, *, strict: bool = True, dtype: torch.dtype = torch.float32,
                attention_impl: str = "eager") -> DFlashDrafter:
    """Load a DFlash checkpoint folder (``config.json`` + ``*.safetensors``) in the public key layout.

    ``attention_impl``: "eager" (default) or "fused" (see :class:`DFlashDrafter`).

    Raises:
        CheckpointError: folder/config/weights missing or unreadable, NaN / inf weights, attention-sink tensors,
        config fields that change the math unimplemented (:func:`refuse_unimplemented`), or keys/shapes not
        matching the config (missing and unexpected keys are listed).
        ValueError: an unknown ``attention_impl``.
    """
    _check_impl(attention_impl)
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder (check the path)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; a DFlash checkpoint folder holds config.json and "
                              "model.safetensors")
    try:
        cfg = DFlashConfig.from_dict(json.loads(cfg_file.read_text()))
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_file}: invalid DFlash config: {e}") from e
    state = read_safetensors(path)
    for old, new in (("midlayer.", "layers.0."), ("encoder.fc.", "fc.")):  # third-party variants (vLLM mapping)
        state = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}
    if cfg.own_lm_head:  # speculators: its frozen copies of the verifier's tables are not used (the target's are)
        state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "t2d", "verifier_norm.weight",
                                                             "verifier_lm_head.weight")}
    sinks = sorted(k for k in state if "sink" in k.lower())  # e.g. layers.0.self_attn.sinks (gpt-oss style)
    if sinks:  # named, not lost among "unexpected keys": the drafter would run without them
        raise CheckpointError(f"{path}: tensors {sinks[:4]} are attention sinks, which sharpdraft's DFlash attention "
                              "does not implement; export a drafter trained without sinks")
    # strict loads build the modules without storage and adopt the read tensors as parameters (assign): one copy of
    # the weights in memory, not two (a 1 B-parameter drafter peaked at 7.9 GB instead of 4.2; scripts/bench_scale.py)
    with torch.device("meta" if strict else "cpu"):
        model = DFlashDrafter(cfg, attention_impl)
    check_state(path, model.state_dict(), state, strict=strict)
    model.load_state_dict(state, strict=strict, assign=strict)
    ids = model.head_target_ids()
    if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size
                            or ids.unique().numel() != ids.numel()):
        raise CheckpointError(f"{path}: d2t maps the draft vocabulary outside [0, {cfg.vocab_size}) or onto one target "
                              "id twice; the checkpoint's vocabulary mapping is corrupt")
    return model.to(dtype).eval()


def save_dflash(model: DFlashDrafter, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the public DFlash layout (plus ``mask_embedding``)."""
    from runtime.models.checkpoint_io import save_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_safetensors(state, path / "model.safetensors", metadata=metadata or {"format": "pt"})
