"""Layers the drafters share (DFlash, EAGLE-3; the Qwen3 / Llama building blocks their checkpoints assume):
RMSNorm, the SwiGLU MLP and NeoX-style rotary position embedding (RoPE) with ``rope_scaling``.

Parameter names follow the Hugging Face Llama / Qwen3 modules (``weight``; ``gate_proj`` / ``up_proj`` /
``down_proj``), so checkpoints in those layouts load into them unchanged. Numerics follow transformers'
``LlamaRMSNorm`` (float32 statistics) and ``rotate_half`` RoPE.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension: ``weight * x / sqrt(mean(x^2) + eps)``, statistics in
    float32, result in ``x``'s dtype. ``x`` ``[..., dim]``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (Llama / Qwen3 MLP). ``x`` ``[..., hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


ROPE_TYPES = ("default", "llama3")


def rope_type_of(scaling: dict | None) -> str:
    """The rope type of a config's ``rope_scaling`` / ``rope_parameters`` dict (None or no type: "default")."""
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` float32, with ``rope_scaling`` applied.

    ``scaling``: None / type "default", or type "llama3" (Llama 3.1's frequency-dependent scaling: ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; wavelengths longer than
    ``original / low_freq_factor`` are divided by ``factor``, shorter than ``original / high_freq_factor`` kept,
    and those between interpolated), as transformers' ``ROPE_INIT_FUNCTIONS["llama3"]`` computes it.

    Raises:
        ValueError: another rope type, or a llama3 dict missing a field.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = rope_type_of(scaling)
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    try:
        factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), \
            float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"llama3 rope_scaling is missing {e.args[0]!r}") from None
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None):
    """NeoX-style RoPE tables. position_ids ``[batch, seq]`` int64 -> cos, sin ``[batch, 1, seq, head_dim]``;
    ``scaling``: a config's ``rope_scaling`` (:func:`rope_inv_freq`)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [batch, seq, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by the tables of :func:`rope_cos_sin`
    (``[batch, 1, seq, head_dim]``, broadcast over heads): ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
