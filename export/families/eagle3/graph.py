"""The EAGLE-3 drafter graphs (step and fc), traced by :func:`export_eagle3_drafter`."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from export.graphs import example_table, export_module


class Eagle3StepForExport(nn.Module):
    """Wraps an EAGLE-3 drafter: one forward over q rows (context pass or chain step), head on one row per batch."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, hidden, position_ids, attention_mask, logits_start, past_key, past_value,
                embed_weight=None):
        d = self.drafter
        out, (k, v) = d.body(input_ids, hidden, position_ids, attention_mask, (past_key, past_value), embed_weight)
        row = torch.gather(out, 1, logits_start[:, None, None].expand(-1, 1, out.shape[-1]))  # [batch, 1, hidden]
        logits = d.head(row)  # [batch, 1, draft_vocab]
        token = torch.argmax(logits, dim=-1) + d.d2t[torch.argmax(logits, dim=-1)]  # target ids [batch, 1]
        return logits, token, row, k, v


class Eagle3FcForExport(nn.Module):
    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, target_features):
        return self.drafter.project(target_features)


def export_eagle3_drafter(drafter, path: Path, fc_path: Path) -> tuple[dict, dict]:
    """Export an EAGLE-3 drafter (frozen: export/rewrite.py inserts per-row beta) as two graphs.

    Step graph ``path``: inputs ``input_ids`` ``[batch, q_len]`` int64 (token p + 1 at drafter position p),
    ``hidden`` ``[batch, q_len, hidden]`` f32 (``fc`` of target features, or the drafter's own previous output),
    ``position_ids`` ``[batch, q_len]``, ``attention_mask`` ``[batch, past_len + q_len]`` (1 = visible; causal order is
    added in-graph), ``logits_start`` ``[batch]`` int64 (the row whose draft is read), ``past_key.0``/``past_value.0``
    ``[batch, kv_heads, past_len, head_dim]``, and ``embed_weight`` ``[vocab, hidden]`` when the checkpoint borrows
    the target's; outputs ``logits`` ``[batch, 1, draft_vocab]``, ``token`` ``[batch, 1]`` int64 (target id of the
    draft argmax, via d2t), ``hidden_out`` ``[batch, 1, hidden]`` (pre-norm, recycled by the next chain step),
    ``present_key.0``/``present_value.0``. fc graph ``fc_path``: ``target_features`` ``[batch, ctx, 3 * target_hidden]``
    -> ``hidden`` ``[batch, ctx, hidden]``.
    """
    cfg = drafter.config
    b, q, p = 2, 5, 6
    ids = torch.randint(0, cfg.vocab_size, (b, q))
    hidden = torch.randn(b, q, cfg.hidden_size)
    pos = torch.arange(p, p + q)[None].expand(b, -1).contiguous()
    am = torch.ones(b, p + q, dtype=torch.int64)
    am[1, p - 2: p] = 0
    start = torch.tensor([4, 2])
    pk, pv = (torch.randn(b, cfg.num_key_value_heads, p, cfg.head_dim) for _ in range(2))
    batch, q_len = torch.export.Dim("batch", max=64), torch.export.Dim("q_len", max=8192)
    past_len = torch.export.Dim("past_len", min=1, max=cfg.max_position_embeddings)
    args = [ids, hidden, pos, am, start, pk, pv]
    dyn = [{0: batch, 1: q_len}, {0: batch, 1: q_len}, {0: batch, 1: q_len}, {0: batch, 1: torch.export.Dim.DYNAMIC},
           {0: batch}, {0: batch, 2: past_len}, {0: batch, 2: past_len}]
    inputs = ["input_ids", "hidden", "position_ids", "attention_mask", "logits_start", "past_key.0", "past_value.0"]
    if drafter.embed_tokens is None:
        args.append(example_table(cfg.vocab_size, cfg.hidden_size))
        dyn.append({})
        inputs.append("embed_weight")
    outputs = ["logits", "token", "hidden_out", "present_key.0", "present_value.0"]
    export_module(Eagle3StepForExport(drafter).eval(), tuple(args), inputs, outputs, tuple(dyn), path)
    feats = torch.randn(b, q, 3 * cfg.target_hidden_size)
    export_module(Eagle3FcForExport(drafter).eval(), (feats,), ["target_features"], ["hidden"],
            ({0: batch, 1: torch.export.Dim("ctx_len", max=8192)},), fc_path)
    return ({"inputs": inputs, "outputs": outputs}, {"inputs": ["target_features"], "outputs": ["hidden"]})
