"""``torch.ops.sharpdraft.query_scaled_attention``: the fused attention as a torch.library custom op.

    out = torch.ops.sharpdraft.query_scaled_attention(q, k, v, kv_lens, key_mask, ref_keys, top_k, slope, cap,
                                                      enabled, causal, window, scale)

- CUDA: the OpenAI Triton kernel (plugins/triton_attention.py).
- CPU: the torch reference (plugins/attention_ref.py); set ``SHARPDRAFT_TRITON_CPU=1`` to run the Triton kernel in
  Triton's interpreter instead (tests).
- A fake (meta) implementation gives the output's shape and dtype for torch.compile / torch.export tracing.
Arguments are plain scalars so the op schema stays stable: ``window`` <= 0 means no window, ``scale`` <= 0 means
head_dim ** -0.5. Shapes: q ``[batch, heads, q_len, head_dim]``, k/v ``[batch, kv_heads, kv_len, head_dim]``,
kv_lens int ``[batch]``, key_mask None or bool/int ``[batch, kv_len]`` (nonzero = visible; N counts visible keys
only); returns ``[batch, heads, q_len, head_dim]`` in q's dtype.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from plugins.attention_ref import attention_ref
from plugins.rule import QueryScaleProfile

OP_NAME = "sharpdraft::query_scaled_attention"


@torch.library.custom_op(OP_NAME, mutates_args=())
def query_scaled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor,
                           key_mask: Optional[torch.Tensor], ref_keys: int, top_k: int, slope: float, cap: float, enabled: bool, causal: bool,
                           window: int, scale: float) -> torch.Tensor:
    """See the module docstring. Raises ValueError (reference) / UnsupportedShape (kernel) on bad shapes."""
    profile = QueryScaleProfile(ref_keys=ref_keys, top_k=top_k, slope=slope, cap=cap, enabled=enabled)
    win = window if window > 0 else None
    sc = scale if scale > 0 else None
    if q.is_cuda or os.environ.get("SHARPDRAFT_TRITON_CPU") == "1":
        from plugins.triton_attention import fused_attention

        return fused_attention(q, k, v, kv_lens, profile, causal, win, sc, key_mask)
    return attention_ref(q, k, v, kv_lens, profile, causal, win, sc, key_mask).contiguous()


@query_scaled_attention.register_fake
def _(q, k, v, kv_lens, key_mask, ref_keys, top_k, slope, cap, enabled, causal, window, scale):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be 4-D")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "heads must be a multiple of kv_heads")
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor | None,
              profile: QueryScaleProfile | None, causal: bool = False, window: int | None = None,
              scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Convenience wrapper over the op with a :class:`QueryScaleProfile` (None = no scale); shapes as above."""
    p = profile or QueryScaleProfile(ref_keys=2048, enabled=False)
    if kv_lens is None:
        kv_lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int64, device=q.device)
    return torch.ops.sharpdraft.query_scaled_attention(q, k, v, kv_lens, key_mask, p.ref_keys, p.top_k, float(p.slope),
                                                       float(p.cap), bool(p.enabled), causal, int(window or 0),
                                                       float(scale or 0.0))
