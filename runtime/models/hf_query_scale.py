"""Torch reference of SharpDraft's per-query-row query scale for Hugging Face causal drafters (PARD, EAGLE-3).

A transformers attention function, registered as ``attn_implementation="sharpdraft_eager"``, that multiplies each
query row by beta(N) (:func:`plugins.rule.beta_torch`), N = the keys that row can see, counted from the attention
mask the layer receives, then runs the model's own eager attention. It is the PyTorch side the
``num_keys_from="score_mask"`` ONNX rewrite (``export/rewrite.py``) is validated against: both count N from the
same 4-D mask, so holes (padding) and sliding windows (each layer gets its own windowed mask) are respected.

Usage::

    from runtime.models.hf_query_scale import ATTN_IMPLEMENTATION, query_scale

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION)
    # or: model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with query_scale(QueryScaleProfile(ref_keys=2048), row_switch=torch.tensor([1.0, 0.0])):
        logits = model(input_ids, attention_mask=mask, ...).logits

The profile travels in a context variable (:func:`query_scale`), so one model object serves scaled and frozen runs.
Outside any :func:`query_scale` block (or with ``profile.enabled == False``) the function is plain eager attention:
beta = 1. Importing this module registers the name (:func:`register`, idempotent) both as an attention function and
as a mask kind (transformers' eager mask: additive float, 0 visible / finfo.min hidden, always materialised).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterator

import torch

from plugins.rule import QueryScaleProfile, beta_torch, count_visible, switch_rows
from plugins.rule import visible_keys as rule_visible_keys
from runtime.models import attention_probe

ATTN_IMPLEMENTATION = "sharpdraft_eager"
HIDDEN_BELOW = -1e30  # same threshold rule as export/rules/decomposed.py: max(-1e30, finfo(dtype).min / 2)


@dataclasses.dataclass(frozen=True, slots=True)
class _Active:
    profile: QueryScaleProfile
    row_switch: torch.Tensor | None


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("sharpdraft_query_scale", default=None)


@contextlib.contextmanager
def query_scale(profile: QueryScaleProfile | None, row_switch: torch.Tensor | None = None) -> Iterator[None]:
    """Scale the queries of every ``sharpdraft_eager`` attention run inside the block.

    Args:
        profile: the rule's constants; None or ``enabled=False`` gives the frozen model (beta = 1).
        row_switch: optional float tensor [batch]: 1 scales that batch row, 0 leaves it frozen
            (beta_row = 1 + (beta - 1) * switch[b], as the ONNX ``row_switch_input``).

    Raises:
        ValueError: ``row_switch`` is not 1-D.
    """
    if row_switch is not None:
        row_switch = torch.as_tensor(row_switch, dtype=torch.float32)
        if row_switch.ndim != 1:
            raise ValueError(f"row_switch must be a 1-D [batch] tensor, got shape {tuple(row_switch.shape)}")
    token = _ACTIVE.set(None if profile is None else _Active(profile, row_switch))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_profile() -> QueryScaleProfile | None:
    """The profile of the innermost :func:`query_scale` block, or None outside any."""
    active = _ACTIVE.get()
    return None if active is None else active.profile


def hidden_threshold(dtype: torch.dtype) -> float:
    """Additive-mask value at or below which a key counts as hidden: max(-1e30, finfo(dtype).min / 2)."""
    return max(HIDDEN_BELOW, torch.finfo(dtype).min / 2)


def visible_keys(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, *, causal: bool = True) -> torch.Tensor:
    """N per query row, float32, shaped to broadcast onto a query [batch, heads, q_len, head_dim].

    Args:
        attention_mask: 4-D [batch, 1 or heads, q_len, >= kv_len] mask as transformers passes it to attention
            functions: bool (True = visible) or additive float (0 visible, finfo.min / -inf hidden); only the first
            ``kv_len`` columns are counted. None: no mask.
        q_len, kv_len: query rows and keys of this call.
        causal: with no mask, count causally (row i sees kv_len - q_len + i + 1 keys) if True, else all kv_len.

    Returns:
        float32 [batch, 1 or heads, q_len, 1] from a mask; [1, 1, q_len, 1] without one.

    Raises:
        ValueError: a mask that is not 4-D, or not bool / floating.
    """
    if attention_mask is None:
        n = rule_visible_keys([kv_len], q_len, causal).clamp(min=1).to(torch.float32)
        return n.view(1, 1, q_len, 1)
    if attention_mask.ndim != 4:
        raise ValueError(f"expected a 4-D attention mask, got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[..., :kv_len]
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        visible = mask > hidden_threshold(mask.dtype)
    else:
        raise ValueError(f"attention mask must be bool or floating, got {mask.dtype}")
    return count_visible(visible)


def row_betas(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, profile: QueryScaleProfile | None,
              row_switch: torch.Tensor | None = None, *, causal: bool = True) -> torch.Tensor:
    """float32 beta per query row (shape of :func:`visible_keys`), with the per-batch-row switch applied."""
    if profile is None:
        return torch.ones(1, 1, q_len, 1)
    return switch_rows(beta_torch(visible_keys(attention_mask, q_len, kv_len, causal=causal), profile), row_switch)


def _eager_for(module: torch.nn.Module):
    """The eager attention of the module's own modeling file (softcapping, sinks, ... stay model-specific)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def sharpdraft_eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs):
    """transformers attention function: ``eager(module, beta(N) * query, key, value, attention_mask, ...)``.

    Args:
        module: the attention module (its ``is_causal`` (default True) decides the no-mask count).
        query: [batch, heads, q_len, head_dim], after RoPE and any q_norm (beta commutes with RoPE: it is linear).
        key, value: [batch, kv_heads, kv_len, head_dim] (cache included).
        attention_mask: see :func:`visible_keys`.
        scaling, dropout, kwargs: passed through to the model's eager attention.

    Returns:
        what the model's eager attention returns: (attn_output [batch, q_len, heads, head_dim], attn_weights).
    """
    active = _ACTIVE.get()
    if active is not None and active.profile.enabled:
        beta = row_betas(attention_mask, query.shape[-2], key.shape[-2], active.profile, active.row_switch,
                         causal=getattr(module, "is_causal", True))
        query = query * beta.to(device=query.device, dtype=query.dtype)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if attention_probe.active():
        _emit_scores(module, query, key, attention_mask, scaling)
    return _eager_for(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _emit_scores(module, query, key, attention_mask, scaling) -> None:
    """Pre-softmax scores ``[batch, heads, q_len, kv_len]`` (mask added) to :mod:`runtime.models.attention_probe`."""
    rep = query.shape[1] // key.shape[1]
    scores = torch.matmul(query, key.repeat_interleave(rep, dim=1).transpose(-1, -2)) * scaling
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    attention_probe.emit(module, scores)


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`sharpdraft_eager_attention` (attention) and transformers' eager mask under ``name``.

    Idempotent. Returns ``name`` (pass it as ``attn_implementation``).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(name, sharpdraft_eager_attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name


register()
