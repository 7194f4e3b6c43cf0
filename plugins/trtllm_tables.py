"""Plain pieces of the TensorRT-LLM (PyTorch backend) integration that need no TensorRT-LLM install.

TensorRT-LLM's attention op multiplies q by a per-position float32 table ``logn_scaling`` inside its fused
QKV-preprocessing / XQA / masked-MHA kernels (``params.logn_scaling[token_idx_in_seq]``; FmhaParams fields
``use_logn_scaling`` / ``logn_scaling_ptr``; see docs/reference/trtllm_onnx.md §0.2 and §1.5B). For a causal
drafter (PARD, EAGLE-3) the query at 0-based position p sees N = p + 1 keys, so the table ``T[p] = beta(p + 1)``
reproduces SharpDraft's rule inside the kernel at no extra cost. :func:`scale_query` is the Llama-4-style
alternative (an elementwise multiply after q-norm and RoPE, §1.5A) and the oracle the table is checked against.
"""
from __future__ import annotations

import torch

from plugins.rule import QueryScaleProfile, beta_torch


def logn_scaling_table(length: int, profile: QueryScaleProfile, device: str | torch.device = "cpu") -> torch.Tensor:
    """``T[p] = beta(p + 1)`` for p = 0 .. length-1, float32 ``[length]`` (length >= TensorRT-LLM's max_seq_len).

    Raises:
        ValueError: length < 1.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1 (the engine's max_seq_len), got {length}")
    return beta_torch(torch.arange(1, length + 1, device=device), profile).to(torch.float32)


def scale_query(q: torch.Tensor, position_ids: torch.Tensor, profile: QueryScaleProfile) -> torch.Tensor:
    """Option A: ``q * beta(position_ids + 1)`` computed in fp32, cast to q's dtype.

    Args:
        q: ``[num_tokens, heads * head_dim]`` (TensorRT-LLM's packed layout) or ``[..., tokens, head_dim]`` with
            ``position_ids`` broadcastable to q without its last dim.
        position_ids: int 0-based positions of the tokens (``[num_tokens]`` for the packed layout).
    Returns:
        q scaled, same shape and dtype. Apply after q-norm and RoPE (an RMS q-norm after it would cancel it).
    """
    beta = beta_torch(position_ids.to(torch.int64) + 1, profile)
    return (q.float() * beta[..., None].to(q.device)).to(q.dtype)
