"""EAGLE-3 drafter (SafeAILab, arXiv 2503.01840) in PyTorch, faithful to the public checkpoint formats.

Checkpoint format (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, AngelSlim / RedHat speculators heads; ModelOpt's
official export; docs/reference/drafters.md §3.1, §3.3, §6.3): a Llama-style ``config.json`` with
``draft_vocab_size`` (and optionally ``target_hidden_size``, ``eagle_config``), weights

    fc.weight                      [hidden, 3 * target_hidden]   fused target features -> hidden
    midlayer.self_attn.{q,k,v}_proj.weight  [.., 2 * hidden]     q/k/v read [input_layernorm(embed) ; hidden_norm(h)]
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    norm.weight, lm_head.weight    [draft_vocab, hidden]
    d2t                            int64 [draft_vocab]: target id = draft id + d2t[draft id]
    t2d (optional)                 bool [vocab]: which target ids the draft vocabulary covers
    embed_tokens.weight (optional) otherwise the target's embedding is borrowed (passed at run time)

Variants accepted (the ecosystem writes them): ``layers.0.*`` instead of ``midlayer.*`` (vLLM, speculators),
``model.`` key prefixes, missing ``t2d`` (rebuilt from ``d2t``), missing ``embed_tokens``, ``eagle_config`` extras
(``eagle_aux_hidden_state_layer_ids`` picks the target taps), and no ``rope_theta`` (EAGLE's reference then uses
10000, as vLLM does).

Target features: HF ``hidden_states[i]`` (the input of target layer i) for i in the aux layer ids, default
{2, L // 2, L - 3}, concatenated in that order. Drafter position p holds the pair (token p + 1, feature h_p);
attention is causal, so N of a query row = its position + 1 (docs/design.md §1), beta differs per row.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plugins.rule import Family
from runtime.models import attention_probe
from runtime.models.checkpoint_io import CheckpointError, check_finite, check_state
from runtime.models.layers import ROPE_TYPES, RMSNorm, SwiGLUMLP, apply_rope, rope_cos_sin, rope_inv_freq, rope_type_of


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's default taps: the inputs of target layers 2, L // 2 and L - 3."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def _flatten_speculators(d: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """A speculators-format config (vLLM's ``speculators`` library) as the flat Llama-style dict, and its proposal
    length (``speculative_tokens`` of the default proposal method). Other configs pass through unchanged.

    Raises:
        CheckpointError: a speculators config of another algorithm (``speculators_model_type``).
    """
    kind = d.get("speculators_model_type")
    if kind is None:
        return d, None
    if kind != Family.EAGLE3:  # speculators names its algorithms as sharpdraft names its families
        raise CheckpointError(f"speculators_model_type {kind!r}: this is not an EAGLE-3 checkpoint (use the "
                              f"matching --drafter, e.g. --drafter {kind} where sharpdraft supports it)")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("speculators EAGLE-3 config has no transformer_layer_config (the decoder layer's "
                              "Llama config); the checkpoint is incomplete")
    flat = {**layer, **{k: v for k, v in d.items() if k not in ("transformer_layer_config", "speculators_config")
                        and v is not None}}
    sc = d.get("speculators_config") or {}
    methods = sc.get("proposal_methods") or []
    default = sc.get("default_proposal_method")
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
    k = chosen.get("speculative_tokens")
    return flat, int(k) if k else None


@dataclasses.dataclass(slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] | None  # None: default_aux_layer_ids(target layers), resolved against the target
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    query_scale: dict | None = None  # sharpdraft extension: a QueryScaleProfile dict suited to this drafter
    raw: dict = dataclasses.field(default_factory=dict)
    rope_scaling: dict | None = None  # None / "default", or Llama 3.1's "llama3" (runtime/models/dflash.py)
    norm_before_residual: bool = False  # speculators' option: the residual is hidden_norm(h) instead of h
    num_speculative_tokens: int | None = None  # speculators_config's proposal length, the default K

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Eagle3Config":
        """Parse an EAGLE-3 ``config.json`` dict: the Llama-style layout (SafeAILab, SGLang / SpecForge, AngelSlim)
        or vLLM's speculators layout (``speculators_model_type: "eagle3"``, the layer under
        ``transformer_layer_config``, the proposal length in ``speculators_config``). Raises CheckpointError if
        fields are missing or unsupported."""
        raw = dict(d)
        d, spec_k = _flatten_speculators(d)
        ecfg = d.get("eagle_config") or {}
        try:
            if int(d.get("num_hidden_layers", 1)) != 1:
                raise CheckpointError(f"num_hidden_layers {d['num_hidden_layers']}: EAGLE-3 drafters with more than "
                                      "one decoder layer are not supported")
            scaling = d.get("rope_scaling") or (d.get("rope_parameters") or {})
            rope_type = rope_type_of(scaling)
            if rope_type not in ROPE_TYPES:
                raise CheckpointError(f"rope_scaling type {rope_type!r} is not supported for EAGLE-3 drafters "
                                      f"(supported: {', '.join(ROPE_TYPES)})")
            if rope_type != "default":
                rope_inv_freq(8, 10000.0, scaling)  # a llama3 dict missing a field fails here, at load
            rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0
            hidden = int(d["hidden_size"])
            aux = ecfg.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
            return cls(hidden_size=hidden, intermediate_size=int(d["intermediate_size"]),
                       num_attention_heads=int(d["num_attention_heads"]),
                       num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                       head_dim=int(d.get("head_dim") or hidden // int(d["num_attention_heads"])),
                       vocab_size=int(d["vocab_size"]),
                       draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                       target_hidden_size=int(d.get("target_hidden_size") or hidden),
                       aux_layer_ids=[int(i) for i in aux] if aux else None,
                       rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), rope_theta=float(rope_theta),
                       max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                       query_scale=d.get("sharpdraft_query_scale"), raw=raw,
                       rope_scaling=dict(scaling) if rope_type != "default" else None,
                       norm_before_residual=bool(d.get("norm_before_residual", False)),
                       num_speculative_tokens=spec_k)
        except KeyError as e:
            raise CheckpointError(f"EAGLE-3 config is missing field {e.args[0]!r}") from e
        except ValueError as e:
            raise CheckpointError(f"EAGLE-3 config: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


class Eagle3Attention(nn.Module):
    """Causal attention whose q/k/v read the 2H input [input_layernorm(embed) ; hidden_norm(h)]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x, cos, sin, past_k, past_v, add_mask, beta=None):
        """x ``[batch, q, 2H]``; past_k/v ``[batch, kv_heads, past, head_dim]``; add_mask additive
        ``[batch, 1, q, past + q]`` (0 visible, finfo.min hidden); beta ``[batch, 1, q, 1]`` or None.
        Returns (out ``[batch, q, H]``, k, v over past + q)."""
        b, q, _ = x.shape
        heads = lambda t, n: t.view(b, q, n, self.hd).transpose(1, 2)  # noqa: E731
        qs = apply_rope(heads(self.q_proj(x), self.nh), cos, sin)
        if beta is not None:
            qs = qs * beta.to(qs.dtype)  # SharpDraft: after RoPE (linear), before attention; per query row
        k = torch.cat([past_k, apply_rope(heads(self.k_proj(x), self.nkv), cos, sin)], dim=2)
        v = torch.cat([past_v, heads(self.v_proj(x), self.nkv)], dim=2)
        rep = self.nh // self.nkv
        kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(qs, kr.transpose(-1, -2)) * self.hd ** -0.5 + add_mask
        attention_probe.emit(self, scores)
        probs = torch.softmax(scores.float(), dim=-1).to(qs.dtype)
        out = torch.matmul(probs, vr).transpose(1, 2).reshape(b, q, self.nh * self.hd)
        return self.o_proj(out), k, v


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 head: ``fc``, one decoder layer (``midlayer``), ``norm``, ``lm_head`` over the draft vocabulary."""

    def __init__(self, cfg: Eagle3Config, with_embedding: bool = False):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if with_embedding else None

    @property
    def draft_to_target(self) -> torch.Tensor:
        """int64 ``[draft_vocab]``: the target id of each draft id (draft id + d2t)."""
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """``[batch, c, 3 * target_hidden]`` tapped target features -> ``[batch, c, hidden]`` (``fc``)."""
        return self.fc(target_features)

    def forward(self, input_ids, hidden, position_ids, attention_mask, past_kv=None, embed_weight=None,
                beta=None):
        """One drafter forward over q positions (context pass, or one chain step with q = 1).

        Args:
            input_ids: ``[batch, q]`` int64, token p + 1 at drafter position p.
            hidden: ``[batch, q, hidden]``: ``fc`` of target features (context pass) or the drafter's own previous
                output (chain steps).
            position_ids: ``[batch, q]`` int64.
            attention_mask: ``[batch, past + q]`` int64, 1 = visible key (ragged rows: 0 on padding); causal
                order is added here.
            past_kv: (k, v) ``[batch, kv_heads, past, head_dim]`` or None.
            embed_weight: the target's embedding ``[vocab, hidden]`` when the checkpoint has none.
            beta: query scale per query row ``[batch, 1, q, 1]`` (see :func:`row_beta`) or None (frozen).
        Returns:
            (logits ``[batch, q, draft_vocab]`` f32, out ``[batch, q, hidden]`` (pre-``norm``: recycled into the next
            chain step), (k, v) over past + q).
        """
        out, kv = self.body(input_ids, hidden, position_ids, attention_mask, past_kv, embed_weight, beta)
        return self.head(out), out, kv

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output ``[..., hidden]`` -> draft-vocabulary logits ``[..., draft_vocab]``."""
        return self.lm_head(self.norm(out))

    def body(self, input_ids, hidden, position_ids, attention_mask, past_kv=None, embed_weight=None, beta=None):
        """The decoder layer of :meth:`forward` without the head: (out ``[batch, q, hidden]``, (k, v))."""
        b, q = input_ids.shape
        cfg = self.config
        table = embed_weight if embed_weight is not None else self.embed_tokens.weight
        emb = F.embedding(input_ids, table)
        if past_kv is None:
            z = hidden.new_zeros(b, cfg.num_key_value_heads, 0, cfg.head_dim)
            past_kv = (z, z)
        add_mask = causal_mask(attention_mask, q, hidden.dtype)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, hidden.dtype, cfg.rope_scaling)
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        attn, k, v = layer.self_attn(x, cos, sin, past_kv[0], past_kv[1], add_mask, beta)
        h = (normed if cfg.norm_before_residual else hidden) + attn
        return h + layer.mlp(layer.post_attention_layernorm(h)), (k, v)


def causal_mask(attention_mask: torch.Tensor, q: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[batch, 1, q, keys]`` mask: key j visible to query i iff attention_mask[b, j] and j <= past + i."""
    keys = attention_mask.shape[1]
    past = keys - q
    j = torch.arange(keys, device=attention_mask.device)[None, :]
    i = torch.arange(q, device=attention_mask.device)[:, None]
    visible = (j <= past + i)[None] & attention_mask.bool()[:, None, :]  # [batch, q, keys]
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def row_beta(attention_mask: torch.Tensor, q: int, profile, row_switch: torch.Tensor | None = None):
    """beta per query row ``[batch, 1, q, 1]`` f32: N = visible keys of that row (position + 1 without holes)."""
    from plugins.rule import beta_torch, count_visible, switch_rows

    n = count_visible(causal_mask(attention_mask, q, torch.float32) == 0)  # [batch, 1, q, 1]
    return switch_rows(beta_torch(n, profile).float(), row_switch)


_KEY_MAP = (("midlayer.", "midlayer."), ("layers.0.", "midlayer."), ("model.layers.0.", "midlayer."),
            ("model.midlayer.", "midlayer."), ("model.embed_tokens.", "embed_tokens."), ("model.norm.", "norm."),
            ("model.fc.", "fc."))


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        for old, new in _KEY_MAP:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        out[k] = v
    return out


def check_vocab_maps(path: Path, d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> None:
    """Refuse draft-vocabulary maps that would draft the wrong tokens (EAGLE-3 checkpoint format: target id =
    draft id + ``d2t[draft id]``; ``t2d[target id]`` marks the covered target ids).

    Args:
        d2t: ``[draft_vocab]`` integer offsets; t2d: ``[vocab]`` bool (or 0/1) or None (rebuilt by the caller).
    Raises:
        CheckpointError: naming the first bad id: a draft id mapped outside [0, vocab_size); two draft ids mapped
            to one target id; a shipped ``t2d`` of the wrong length or that disagrees with ``d2t`` (a target id
            ``d2t`` maps to but ``t2d`` leaves out, or one ``t2d`` marks that no draft id maps to).
    """
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{path}: d2t must be a 1-D integer tensor, got {d2t.dtype} {list(d2t.shape)}")
    targets = torch.arange(d2t.numel()) + d2t.long()
    bad = ((targets < 0) | (targets >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise CheckpointError(f"{path}: d2t maps draft id {i} to target id {int(targets[i])}, outside the target "
                              f"vocabulary [0, {vocab_size}) ({bad.numel()} such ids); the checkpoint was built for "
                              "another tokenizer or its d2t is corrupt")
    uniq, counts = torch.unique(targets, return_counts=True)
    if (counts > 1).any():
        t = int(uniq[counts > 1][0])
        ids = (targets == t).nonzero().flatten()[:3].tolist()
        raise CheckpointError(f"{path}: d2t maps draft ids {ids} to the same target id {t}; each draft id must map "
                              "to its own target id")
    if t2d is None:
        return
    if t2d.dim() != 1 or t2d.numel() != vocab_size:
        raise CheckpointError(f"{path}: t2d has shape {list(t2d.shape)}, expected [{vocab_size}] (the target "
                              "vocabulary); drop it to have it rebuilt from d2t")
    covered = torch.zeros(vocab_size, dtype=torch.bool)
    covered[targets] = True
    marked = t2d.bool()
    missing = (covered & ~marked).nonzero().flatten()
    extra = (marked & ~covered).nonzero().flatten()
    if missing.numel() or extra.numel():
        what = (f"target id {int(missing[0])} is mapped by d2t but not marked in t2d" if missing.numel() else
                f"target id {int(extra[0])} is marked in t2d but no draft id maps to it")
        raise CheckpointError(f"{path}: t2d disagrees with d2t ({what}; {missing.numel() + extra.numel()} ids "
                              "differ); drop t2d to have it rebuilt from d2t")


def load_eagle3(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """Load an EAGLE-3 checkpoint folder (``config.json`` + ``*.safetensors`` or ``pytorch_model.bin``) strictly.

    Raises:
        CheckpointError: folder / config / weights missing or unreadable; keys missing or unexpected (listed);
            shapes not matching the config; bad ``d2t`` / ``t2d`` maps (:func:`check_vocab_maps`).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; an EAGLE-3 checkpoint folder holds config.json and weights")
    try:
        cfg = Eagle3Config.from_dict(json.loads(cfg_file.read_text()))
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_file}: invalid EAGLE-3 config: {e}") from e
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    try:
        for f in files:
            state.update(load_file(f))
        if not files and (path / "pytorch_model.bin").is_file():
            state.update(torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupt or unreadable weights ({e})") from e
    if not state:
        raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin weights next to config.json")
    check_finite(path, state)
    state = _normalise_keys(state)
    model = Eagle3Drafter(cfg, with_embedding="embed_tokens.weight" in state)
    if "d2t" in state:  # before any use of it: the t2d rebuild below indexes with it
        check_vocab_maps(path, state["d2t"], state.get("t2d"), cfg.vocab_size)
    if "t2d" not in state and "d2t" in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"].long()] = True
        state["t2d"] = t2d
    check_state(path, model.state_dict(), state)
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def save_eagle3(model: Eagle3Drafter, path: str | Path, config: dict, metadata: dict[str, str] | None = None,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the official layout (``midlayer.*``; d2t/t2d kept exact)."""
    from runtime.models.checkpoint_io import save_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in model.state_dict().items()}
    save_safetensors(state, path / "model.safetensors", metadata=metadata or {"format": "pt"})
