"""The query scale inside a vLLM attention module: beta(N) multiplied onto q after RoPE, before ``self.attn``.

vLLM's drafter attention modules (``DFlashQwen3Attention``, ``LlamaAttention`` in EAGLE-3 and PARD drafters) all
run ``q, k = self.rotary_emb(positions, q, k)`` and then ``self.attn(q, k, v)``. :func:`scale_queries` replaces that
one module's ``rotary_emb`` by a :class:`QueryScaledRope` that calls the original and multiplies q by beta(N), so
the scale lands exactly between RoPE and the attention call without copying vLLM's ``forward`` and without touching
vLLM's classes (the shared rotary object of other modules is left as it is). With the profile disabled nothing is
replaced: the module is vLLM's own, bit for bit.

N, the keys a query sees (docs/design.md §1), from vLLM's query positions ``[num_tokens]``:

- causal rows (EAGLE-3, PARD, causal DFlash layers): N = position + 1;
- a DFlash block (non-causal): vLLM lays the queries out request-major in blocks of B = 1 + K at positions
  ``last + 1 + off`` (``off`` = index mod B) and every query sees the whole valid context plus the block:
  N = position - off + B. Example, B = 3, two requests with 5 and 9 context tokens: positions [5, 6, 7, 9, 10, 11]
  -> off [0, 1, 2, 0, 1, 2] -> N [8, 8, 8, 12, 12, 12];
- a sliding window W caps it as ``plugins.rule.visible_keys`` does: min(N, W) causal, min(N, W + B - 1 - off) in a
  block.

beta itself is ``plugins.rule.beta_torch`` (the rule is defined there only). Pure tensor ops, no host syncs, so the
same code runs under torch.compile / CUDA graphs; the trace below (tests only) is the one exception.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from plugins.rule import QueryScaleProfile, beta_torch

PROFILE_KEY = "sharpdraft_query_scale"
TRACE_ENV = "SHARPDRAFT_VLLM_TRACE"  # a JSONL path: every scaled forward appends {layer, N and beta it used}


class ProfileError(ValueError):
    """A drafter config's query-scale profile is missing or cannot be honoured; the message is the line to show."""


def profile_of(config, where: str) -> QueryScaleProfile:
    """The ``sharpdraft_query_scale`` of a (vLLM / transformers) drafter config, validated by plugins/rule.py.

    Raises:
        ProfileError: no profile, or one the rule refuses (unknown field, value out of range), naming ``where``.
    """
    raw = getattr(config, PROFILE_KEY, None)
    if raw is None and hasattr(config, "to_dict"):
        raw = config.to_dict().get(PROFILE_KEY)
    if raw is None:
        raise ProfileError(f"sharpdraft vLLM plugin: {where} has no {PROFILE_KEY} in its config.json; write it with "
                           "`sharpdraft-export-vllm` (or name vLLM's stock architecture to run without the scale)")
    if not isinstance(raw, dict):
        raise ProfileError(f"sharpdraft vLLM plugin: {where}: {PROFILE_KEY} must be an object, got {raw!r}")
    try:
        return QueryScaleProfile.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"sharpdraft vLLM plugin: {where}: {PROFILE_KEY} cannot be honoured: {e}") from None


def visible_keys(positions: torch.Tensor, block: int | None, window: int | None) -> torch.Tensor:
    """N per query token, int64 ``[num_tokens]``; ``block`` = B for a non-causal DFlash block, None when causal."""
    pos = positions.to(torch.int64)
    if block is None:
        n = pos + 1
        return n if window is None else n.clamp(max=window)
    off = torch.arange(pos.numel(), device=pos.device) % block
    n = pos - off + block
    return n if window is None else torch.minimum(n, window + block - 1 - off)


class QueryScaledRope(nn.Module):
    """``rotary_emb`` of one attention module, followed by q *= beta(N). Other attributes (``cos_sin_cache``,
    ``head_size``, ``is_neox_style``, which DFlash's context-KV precompute reads) are the wrapped module's."""

    def __init__(self, rope: nn.Module, profile: QueryScaleProfile, *, num_heads: int, head_dim: int,
                 block: int | None, window: int | None, layer: str):
        super().__init__()
        self.rope = rope
        self.profile, self.block, self.window, self.layer = profile, block, window, layer
        self.num_heads, self.head_dim = num_heads, head_dim

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("rope"), name)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        """positions ``[num_tokens]``, query ``[num_tokens, num_heads * head_dim]`` -> (scaled query, key)."""
        query, key = self.rope(positions, query, key)
        n = visible_keys(positions, self.block, self.window)  # [num_tokens]
        beta = beta_torch(n, self.profile)  # [num_tokens] float32
        shape = query.shape
        query = (query.view(shape[0], -1, self.head_dim) * beta.to(query.dtype)[:, None, None]).view(shape)
        if os.environ.get(TRACE_ENV):
            _trace(self.layer, n, beta)
        return query, key


def _trace(layer: str, n: torch.Tensor, beta: torch.Tensor) -> None:
    """Append the distinct (N, beta) pairs of one call (tests check beta against plugins/rule.py on them)."""
    if n.numel() == 0:
        return
    pairs = torch.unique(torch.stack([n.double(), beta.double()], 1), dim=0).tolist()
    with open(os.environ[TRACE_ENV], "a") as f:
        f.write(json.dumps({"layer": layer, "n_min": int(n.min()), "n_max": int(n.max()), "pairs": pairs}) + "\n")


def scale_queries(attn: nn.Module, profile: QueryScaleProfile, *, block: int | None, window: int | None,
                  layer: str) -> bool:
    """Install the scale on one attention module (one with ``rotary_emb``, ``num_heads``, ``head_dim``); a disabled
    profile installs nothing (the module stays vLLM's own). Returns whether it was installed."""
    if not profile.enabled:
        return False
    attn.rotary_emb = QueryScaledRope(attn.rotary_emb, profile, num_heads=attn.num_heads, head_dim=attn.head_dim,
                                      block=block, window=window, layer=layer)
    return True
