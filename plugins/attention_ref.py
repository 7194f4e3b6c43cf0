"""Torch reference of drafter attention with SharpDraft's query scale fused in (arXiv 2610.05106).

This is the oracle the Triton kernel (plugins/triton_attention.py) is tested against, and the CPU fallback.

    out[b, h, i] = softmax(beta(N_bi) * scale * q[b, h, i] . K_visible^T) V_visible

- GQA: query head h reads kv head h // (heads / kv_heads).
- Per-sequence key lengths ``kv_lens[b]`` (keys at index >= kv_lens[b] are padding).
- ``key_mask`` ``[batch, kv_len_max]`` (optional; 0 = hidden): keys hidden per sequence on top of the lengths, e.g.
  the padding holes of a ragged batch whose rows were right-padded piecewise (DFlash: past | context | block).
- Positions: a row's present keys (index < kv_lens[b], key_mask nonzero) hold positions 0..P-1 in index order (a
  key's position is its rank among them; without holes, its index), and the q_len queries are the last q_len of
  them: query i is at position ``p_i = P - q_len + i``. So a row with holes equals the same row with them cut out.
- ``causal=True`` (verify blocks, causal drafters): query i sees the keys at positions <= p_i. ``causal=False``
  (DFlash blocks): every query sees all P keys.
- ``window`` W (sliding-window layers), anchored at each query's own position: query i sees only keys at positions
  > p_i - W (flash-attention's bottom-right aligned ``window_size=(W - 1, 0)`` when causal, ``(W - 1, -1)`` for a
  non-causal block, whose later block keys stay visible): DFlash's sliding layers (runtime/models/dflash.py).
- N_bi = number of keys query (b, i) sees (after lengths, key_mask, causal and window), the visible-key count of
  docs/design.md §1; beta comes from :func:`plugins.rule.beta_torch`. A row that sees no key outputs zeros.
  Accumulation is fp32; the output has q's dtype.
"""
from __future__ import annotations

import torch

from plugins.rule import QueryScaleProfile, beta_torch, visible_keys  # noqa: F401 (visible_keys: re-used here)

# The fused op's identity, shared by the ONNX fusion pass (export/fuse.py), the ORT custom op (plugins/ort_op.py) and
# the TensorRT plugin (plugins/tensorrt_plugin.py): node ``sharpdraft::QueryScaledAttention``, opset version 1.
DOMAIN = "sharpdraft"
OP_TYPE = "QueryScaledAttention"
OP_VERSION = 1
PLUGIN_NAME = f"{DOMAIN}::{OP_TYPE}"  # tensorrt.plugin registration name


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor | None = None,
                  profile: QueryScaleProfile | None = None, causal: bool = False, window: int | None = None,
                  scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference attention with the query scale.

    Args:
        q: ``[batch, heads, q_len, head_dim]`` (fp32/fp16/bf16; any strides).
        k, v: ``[batch, kv_heads, kv_len_max, head_dim]``; heads % kv_heads == 0.
        kv_lens: int ``[batch]`` valid keys per sequence; None = kv_len_max for all.
        profile: the query-scale rule's constants; None = no scale (beta = 1).
        causal, window: see the module docstring.
        scale: softmax scale; None = head_dim ** -0.5.
        key_mask: optional bool/int ``[batch, kv_len_max]``, nonzero = visible (see the module docstring).
    Returns:
        ``[batch, heads, q_len, head_dim]`` in q's dtype.
    Raises:
        ValueError: mismatched shapes (key_mask included), heads not a multiple of kv_heads, kv_lens out of range,
            or a causal block longer than its keys.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, heads, len, head_dim]")
    b, h, q_len, d = q.shape
    kvh, kv_max = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if h % kvh:
        raise ValueError(f"heads {h} must be a multiple of kv_heads {kvh}")
    if kv_lens is None:
        kv_lens = torch.full((b,), kv_max, dtype=torch.int64)
    kv_lens = kv_lens.to(torch.int64).cpu()
    if (kv_lens < 1).any() or (kv_lens > kv_max).any() or (causal and (kv_lens < q_len).any()):
        raise ValueError(f"kv_lens {kv_lens.tolist()} must be in [{q_len if causal else 1}, {kv_max}]")
    if key_mask is not None and tuple(key_mask.shape) != (b, kv_max):
        raise ValueError(f"key_mask {tuple(key_mask.shape)} must be [batch, kv_len_max] = {(b, kv_max)}")
    scale = d ** -0.5 if scale is None else scale
    present = torch.arange(kv_max)[None, :] < kv_lens[:, None]  # [b, kv_max]
    if key_mask is not None:
        present &= key_mask.cpu().bool()
    pos = present.cumsum(-1) - 1  # a present key's position: its rank among the row's present keys
    qpos = present.sum(-1, keepdim=True) - q_len + torch.arange(q_len)[None]  # [b, q_len]: the last q_len positions
    visible = present[:, None, :].expand(-1, q_len, -1)  # [b, q_len, kv_max]
    if causal:
        visible = visible & (pos[:, None, :] <= qpos[:, :, None])
    if window is not None:
        visible = visible & (pos[:, None, :] > qpos[:, :, None] - window)
    n = visible.sum(-1)  # [b, q_len]: N per query row
    beta = beta_torch(n, profile) if profile is not None and profile.enabled else torch.ones_like(n, dtype=torch.float32)
    qf = q.float() * (beta[:, None, :, None].float().to(q.device) * scale)
    rep = h // kvh
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = qf @ kf.transpose(-1, -2)  # [b, h, q_len, kv_max]
    vis = visible[:, None].to(scores.device)
    scores = scores.masked_fill(~vis, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~vis, 0.0)  # rows that see no key: zeros, not NaN
    return (probs @ vf).to(q.dtype)
