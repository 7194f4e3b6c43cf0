"""torch -> ONNX for the target (logits + tapped hidden states + KV cache), and the tracing helpers every family's
drafter export uses (export/families/<family>/graph.py: DFlash's drafter graph below, PARD's and EAGLE-3's in their
own docstrings).

Both graphs take and return their KV cache as flat tensors so any ONNX runtime can drive them:

target   inputs  input_ids [batch, q_len] int64, position_ids [batch, q_len] int64,
                 attention_mask [batch, past_len + q_len] int64, past_key.{i}/past_value.{i} [batch, kv_heads, past_len, head_dim]
         outputs logits [batch, q_len, vocab] f32, taps [batch, q_len, len(tap_ids) * hidden] f32 (hidden_states[id + 1]
                 concatenated in order, DFlash's convention), then per layer:
                 kv_io "static" (default): new_key.{i}/new_value.{i} [batch, kv_heads, q_len, head_dim], the new
                   positions only. past_len is the capacity of the caller's preallocated buffers (slots past a row's
                   length are masked out by attention_mask), so no step copies the cache: the caller writes the q_len
                   new positions into its buffers and rolls back by changing a length (runtime/kv_cache.py).
                 kv_io "concat" (HF's own forward; any architecture): present_key.{i}/present_value.{i}
                   [batch, kv_heads, past_len + q_len, head_dim]
drafter  inputs  input_ids [batch, block] int64 (bonus token, then mask ids), target_hidden [batch, ctx_len, F] f32
                 (features of context positions not yet cached), position_ids [batch, ctx_len + block] int64,
                 attention_mask [batch, past_len + ctx_len + block] int64 (1 = visible key; ragged rows are
                 right-padded: N of row b = sum(attention_mask[b]), read by the beta subgraph),
                 past_key.{i}/past_value.{i} [batch, kv_heads, past_len, head_dim],
                 embed_weight [vocab, hidden], lm_head_weight [draft_vocab, hidden] (the target's own tensors, fed at
                 run time so the drafter graph never duplicates them: see runtime/manifest.py; the LM head's rows are
                 dynamic, so the runtime may feed only a draft vocabulary's rows, runtime/draft_vocab.py);
                 lm_head_weight is absent when the drafter has its own LM head, stored in the graph (speculators
                 format)
         outputs logits [batch, block - 1, draft_vocab] f32 for slots 1..B-1 (block is static: the drafter's trained
                 block size), then per layer, context rows only (block keys are never cached):
                 kv_io "static" (default): new_key.{i}/new_value.{i} [batch, kv_heads, ctx_len, head_dim], as the
                   target's (past_len = the caller's buffer capacity, spare slots masked by attention_mask).
                 kv_io "concat": present_key.{i}/present_value.{i} [batch, kv_heads, past_len + ctx_len, head_dim].
                 Grouped-query heads are folded into the query rows (no per-head copy of the cache).
"""
from __future__ import annotations

import inspect
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)
OPSET = 18


def cache_kwarg_name(model: nn.Module) -> str:
    """transformers >= 5.24 calls the cache ``cache``; older 5.x only knows ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TargetForExport(nn.Module):
    """Wraps an HF causal LM: flat KV in/out, tapped hidden states out."""

    def __init__(self, model: nn.Module, tap_ids: list[int]):
        super().__init__()
        self.model = model
        self.tap_ids = list(tap_ids)
        self.num_layers = model.config.num_hidden_layers
        self.cache_kwarg = cache_kwarg_name(model.model)

    def forward(self, input_ids, position_ids, attention_mask, past: list[torch.Tensor]):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=True, output_hidden_states=True, **{self.cache_kwarg: cache})
        if self.tap_ids:
            taps = torch.cat([out.hidden_states[i + 1] for i in self.tap_ids], dim=-1)
        else:  # a drafter that reads no target features (PARD): a [batch, q_len, 0] output keeps the contract
            taps = out.hidden_states[-1][..., :0]
        kv = out["cache"] if "cache" in out else out["past_key_values"]  # key lookup: no deprecation warning
        present = [t for layer in kv.layers for t in (layer.keys, layer.values)]
        return out.logits, taps, present


STATIC_ATTENTION = "sharpdraft_split_past"


def _split_past_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sharpdraft_past=None,
                          **kwargs):
    """Attention of q new positions over a preallocated past buffer and the new keys, without concatenating K/V.

    Args (transformers attention-interface signature):
        query: ``[batch, heads, q_len, head_dim]`` (after RoPE / q-norm); key, value: ``[batch, kv_heads, q_len,
            head_dim]``, the new positions only; attention_mask: additive ``[batch, 1, q_len, past_len + q_len]``
            (0 = visible, float32 min = hidden); sharpdraft_past: the flat ``[K0, V0, K1, ...]`` past buffers
            ``[batch, kv_heads, past_len, head_dim]``, indexed by ``module.layer_idx``.
    Returns:
        ``([batch, q_len, heads, head_dim], None)`` as transformers' eager attention.

    Grouped-query heads are folded into the query rows (``[batch, kv_heads, groups * q_len, head_dim]``), so K/V
    are never repeated per head, and scores over the past and over the new keys are computed apart and joined
    (``[.., q_len, past_len + q_len]``: small), so the whole cache is read once and copied never.
    """
    past_k, past_v = sharpdraft_past[2 * module.layer_idx], sharpdraft_past[2 * module.layer_idx + 1]
    b, heads, q, d = query.shape
    kvh = key.shape[1]
    g = heads // kvh
    qg = (query * scaling).reshape(b, kvh, g * q, d)
    scores = torch.cat([torch.matmul(qg, past_k.transpose(-1, -2)), torch.matmul(qg, key.transpose(-1, -2))], -1)
    total = scores.shape[-1]
    scores = scores.reshape(b, kvh, g, q, total) + attention_mask[:, :, None]
    probs = torch.softmax(scores, dim=-1).reshape(b, kvh, g * q, total)
    p = past_k.shape[2]
    out = torch.matmul(probs[..., :p], past_v) + torch.matmul(probs[..., p:], value)  # [b, kvh, g * q, d]
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


class _NewKV:
    """A stand-in for transformers' cache: records each layer's new K/V and returns them unchanged."""

    def __init__(self, num_layers: int):
        self.kv: list[torch.Tensor | None] = [None] * (2 * num_layers)

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.kv[2 * layer_idx], self.kv[2 * layer_idx + 1] = key, value
        return key, value


def static_kv_supported(model: nn.Module) -> bool:
    """True for decoder-only models the static form reproduces: every layer full attention (no sliding window),
    the standard ``model.model.{embed_tokens, layers, norm, rotary_emb}`` layout (Llama, Mistral without window,
    Qwen2/Qwen3)."""
    cfg = model.config
    inner = getattr(model, "model", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    return (inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and all(t == "full_attention" for t in layer_types) and not getattr(cfg, "sliding_window", None))


class StaticKVTargetForExport(nn.Module):
    """The target with the static KV interface (module docstring, kv_io "static"): HF's own decoder layers, norms
    and rotary embedding, with :func:`_split_past_attention` in place of their attention function.

    The attention implementation is switched on the model's config while this wrapper runs (restored after), so
    the same HF modules serve both forms; the mask is built here from ``attention_mask``: a key is visible if its
    mask bit is 1 and, among the new positions, it is not after the query.
    """

    def __init__(self, model: nn.Module, tap_ids: list[int]):
        super().__init__()
        if not static_kv_supported(model):
            raise ValueError(f"{type(model).__name__}: the static-KV form needs full-attention Llama-style layers")
        from transformers import AttentionInterface

        AttentionInterface.register(STATIC_ATTENTION, _split_past_attention)
        self.model = model
        self.tap_ids = list(tap_ids)
        self.num_layers = model.config.num_hidden_layers

    def forward(self, input_ids, position_ids, attention_mask, past: list[torch.Tensor]):
        inner, cfg = self.model.model, self.model.config
        q = input_ids.shape[1]
        p = past[0].shape[2]
        causal = torch.ones(q, q, dtype=torch.bool, device=input_ids.device).tril()
        allowed = torch.cat([torch.ones(q, p, dtype=torch.bool, device=input_ids.device), causal], dim=1)
        visible = allowed[None] & attention_mask[:, None, :].bool()  # [batch, q_len, past_len + q_len]
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=input_ids.device)
        bias = bias.masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]  # [batch, 1, q, past + q]
        h = inner.embed_tokens(input_ids)
        rope = inner.rotary_emb(h, position_ids=position_ids)
        cache = _NewKV(self.num_layers)
        hidden = [h]
        saved = cfg._attn_implementation
        cfg._attn_implementation = STATIC_ATTENTION
        try:
            for layer in inner.layers[: self.num_layers]:
                h = layer(h, attention_mask=bias, position_embeddings=rope, position_ids=position_ids, cache=cache,
                          use_cache=True, sharpdraft_past=past)
                hidden.append(h)
        finally:
            cfg._attn_implementation = saved
        h = inner.norm(h)
        hidden[-1] = h  # transformers' hidden_states: the last entry is the final-norm output
        logits = self.model.lm_head(h)
        if self.tap_ids:
            taps = torch.cat([hidden[i + 1] for i in self.tap_ids], dim=-1)
        else:
            taps = h[..., :0]
        return logits, taps, cache.kv


def example_table(rows: int, cols: int) -> torch.Tensor:
    """An example input for a borrowed table (embedding / LM head), ``[rows, cols]`` fp32, never written.

    Tracing reads only its shape and dtype, and ``torch.empty``'s pages stay unmapped until touched: a
    151,936 x 4,096 table (Qwen3-8B's) costs no resident memory instead of 2.5 GB. Filled example tables were
    most of the 1 B DFlash drafter's export peak (9.0 GB for 4.2 GB of weights; 4.4 GB without them).
    """
    return torch.empty(rows, cols)


def kv_names(num_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]


def export_module(module, args, input_names, output_names, dynamic_shapes, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, args, dynamo=True, input_names=input_names, output_names=output_names,
                                 dynamic_shapes=dynamic_shapes, opset_version=OPSET, verbose=False)
    prog.save(str(path), external_data=True)


def export_target(model: nn.Module, tap_ids: list[int], path: Path, kv_io: str = "auto") -> dict:
    """Export the target to ``path`` (+ ``path.data``). Returns the graph's input/output names and ``kv_io``.

    ``kv_io``: "static" (new K/V out only; module docstring), "concat" (HF's forward, present = past + new), or
    "auto" = static where :func:`static_kv_supported`, else concat.

    Raises:
        torch.onnx.errors.* / RuntimeError from the exporter (the caller turns them into an export error).
    """
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    b, q, p = 2, 5, 7  # batch 2 so the exporter keeps batch symbolic (1 would be specialised)
    ids = torch.randint(0, cfg.vocab_size, (b, q))
    pos = torch.arange(p, p + q)[None].expand(b, -1).contiguous()
    am = torch.ones(b, p + q, dtype=torch.int64)
    past = [torch.randn(b, kvh, p, hd) for _ in range(2 * n_layers)]
    batch, q_len, past_len = torch.export.Dim("batch", max=64), torch.export.Dim("q_len", max=8192), \
        torch.export.Dim("past_len", min=1, max=cfg.max_position_embeddings)
    total = torch.export.Dim.DYNAMIC
    dyn = ({0: batch, 1: q_len}, {0: batch, 1: q_len}, {0: batch, 1: total},
           [{0: batch, 2: past_len} for _ in range(2 * n_layers)])
    if kv_io == "auto":
        kv_io = "static" if static_kv_supported(model) else "concat"
    if kv_io not in ("static", "concat"):
        raise ValueError(f"kv_io must be static, concat or auto, not {kv_io!r}")
    static = kv_io == "static"
    inputs = ["input_ids", "position_ids", "attention_mask", *kv_names(n_layers, "past")]
    outputs = ["logits", "taps", *kv_names(n_layers, "new" if static else "present")]
    wrapper = (StaticKVTargetForExport if static else TargetForExport)(model, tap_ids).eval()
    export_module(wrapper, (ids, pos, am, past), inputs, outputs, dyn, path)
    return {"inputs": inputs, "outputs": outputs, "kv_io": kv_io}
