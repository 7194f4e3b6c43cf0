"""The PARD drafter graph, traced by :func:`export_pard_drafter`."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from export.graphs import cache_kwarg_name, example_table, export_module, kv_names


class PardForExport(nn.Module):
    """Wraps a PARD drafter: flat KV in/out, logits of the K rows starting at ``logits_start`` per batch row."""

    def __init__(self, drafter, num_draft_tokens: int):
        super().__init__()
        self.drafter = drafter
        self.k = num_draft_tokens

    def forward(self, input_ids, position_ids, attention_mask, logits_start, past: list[torch.Tensor],
                embed_weight=None):
        d = self.drafter
        cache_kwarg = cache_kwarg_name(d.model.model)
        from transformers import DynamicCache

        cache = DynamicCache(config=d.config)
        for i in range(d.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        emb = d.embed(input_ids, embed_weight)
        out = d.model.model(inputs_embeds=emb, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=True, **{cache_kwarg: cache})
        h = out.last_hidden_state  # [batch, q, hidden]
        idx = logits_start[:, None] + torch.arange(self.k, device=h.device)[None]  # [batch, K]
        rows = torch.gather(h, 1, idx[..., None].expand(-1, -1, h.shape[-1]))
        logits = torch.matmul(rows, d.lm_head_weight(embed_weight).transpose(0, 1))
        kv = out["cache"] if "cache" in out else out["past_key_values"]
        return logits, [t for layer in kv.layers for t in (layer.keys, layer.values)]


def export_pard_drafter(drafter, num_draft_tokens: int, path: Path) -> dict:
    """Export a PARD drafter (frozen: no query scale; export/rewrite.py inserts per-row beta) to ``path``.

    Graph: inputs ``input_ids`` / ``position_ids`` ``[batch, q_len]`` int64 (pending committed tokens, then K-1
    ``pard_token``; ragged rows right-padded with placeholders), ``attention_mask`` ``[batch, past_len + q_len]``,
    ``logits_start`` ``[batch]`` int64 (index of each row's last real token), ``past_key.{i}``/``past_value.{i}``
    ``[batch, kv_heads, past_len, head_dim]``, and ``embed_weight`` ``[vocab, hidden]`` when the checkpoint borrows
    the target's table; outputs ``logits`` ``[batch, K, vocab]`` f32 (K = ``num_draft_tokens``, static) and
    ``present_*`` over past_len + q_len.
    """
    cfg = drafter.config
    n = drafter.num_layers
    kvh = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    k = num_draft_tokens
    b, q, p = 2, k + 3, 6
    ids = torch.randint(0, cfg.vocab_size, (b, q))
    pos = torch.arange(p, p + q)[None].expand(b, -1).contiguous()
    am = torch.ones(b, p + q, dtype=torch.int64)
    am[1, p - 2: p] = 0  # a padded row, so the mask is traced as data
    start = torch.tensor([3, 2])
    past = [torch.randn(b, kvh, p, hd) for _ in range(2 * n)]
    batch, q_len = torch.export.Dim("batch", max=64), torch.export.Dim("q_len", min=k, max=8192)
    past_len = torch.export.Dim("past_len", min=1, max=cfg.max_position_embeddings)
    dyn = [{0: batch, 1: q_len}, {0: batch, 1: q_len}, {0: batch, 1: torch.export.Dim.DYNAMIC}, {0: batch},
           [{0: batch, 2: past_len} for _ in range(2 * n)]]
    args = [ids, pos, am, start, past]
    inputs = ["input_ids", "position_ids", "attention_mask", "logits_start", *kv_names(n, "past")]
    if drafter.borrow_embeddings:
        args.append(example_table(cfg.vocab_size, cfg.hidden_size))
        dyn.append({})
        inputs.append("embed_weight")
    outputs = ["logits", *kv_names(n, "present")]
    export_module(PardForExport(drafter, k).eval(), tuple(args), inputs, outputs, tuple(dyn), path)
    return {"inputs": inputs, "outputs": outputs}
