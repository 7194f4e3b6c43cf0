"""The DFlash drafter graph (its inputs and outputs: export/graphs.py's module docstring), traced by
:func:`export_drafter`."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from export.graphs import example_table, export_module, kv_names
from runtime.models.dflash import DFlashDrafter


class DrafterForExport(nn.Module):
    """Wraps a DFlash drafter: block embedding and LM head use tensors passed in as graph inputs.

    ``static``: return only the new context rows' K/V (``new_key.i`` ``[batch, kv_heads, ctx_len, head_dim]``);
    the past is then a preallocated buffer whose spare slots ``attention_mask`` hides (kv_io "static", as the
    target's). Otherwise ``present_key.i`` = past + new (kv_io "concat").
    """

    def __init__(self, drafter: DFlashDrafter, static: bool = False):
        super().__init__()
        self.drafter = drafter
        self.static = static

    def forward(self, input_ids, target_hidden, position_ids, attention_mask, past: list[torch.Tensor],
                embed_weight, lm_head_weight, draft_slots):
        emb = self.drafter.embed_block(input_ids, embed_weight)
        n = len(self.drafter.layers)
        past_kv = [(past[2 * i], past[2 * i + 1]) for i in range(n)]
        h, kv = self.drafter(emb, target_hidden, position_ids, past_kv, key_mask=attention_mask,
                             new_kv_only=self.static)
        # the LM head only on the block slots the runtime will verify (draft_slots = 1..k): with a 49k or 8k-row
        # head it is most of a small drafter's cost, and verifying k < B - 1 tokens is the usual setting
        head = self.drafter.lm_head.weight if self.drafter.lm_head is not None else lm_head_weight
        logits = torch.matmul(torch.index_select(h, 1, draft_slots), head.transpose(0, 1))
        return logits, [t for pair in kv for t in pair]


class _OwnHead(nn.Module):
    """:class:`DrafterForExport` without the ``lm_head_weight`` argument (the drafter's own head is used)."""

    def __init__(self, inner: DrafterForExport):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, target_hidden, position_ids, attention_mask, past, embed_weight, draft_slots):
        return self.inner(input_ids, target_hidden, position_ids, attention_mask, past, embed_weight, None,
                          draft_slots)


def export_drafter(drafter: DFlashDrafter, path: Path, kv_io: str = "static") -> dict:
    """Export a DFlash drafter (frozen: no query scale; export/rewrite.py inserts beta) to ``path``.

    ``kv_io``: "static" (past read from a preallocated buffer, new context K/V out only; :class:`DrafterForExport`)
    or "concat" (present = past + new). Returns the graph's input/output names and ``kv_io``.

    Raises:
        ValueError: an unknown ``kv_io``; torch.onnx errors from the exporter.
    """
    if kv_io not in ("static", "concat"):
        raise ValueError(f"kv_io must be static or concat, not {kv_io!r}")
    static = kv_io == "static"
    cfg = drafter.config
    n, f = cfg.num_hidden_layers, len(cfg.target_layer_ids) * cfg.hidden_size
    b, c, p, blk = 2, 3, 6, cfg.block_size
    ids = torch.full((b, blk), cfg.mask_token_id)
    ids[:, 0] = 7
    th = torch.randn(b, c, f)
    pos = torch.arange(p, p + c + blk)[None].expand(b, -1).contiguous()
    am = torch.ones(b, p + c + blk, dtype=torch.int64)
    am[1, p - 2: p] = 0  # a padded row, so the mask is traced as data (never specialised away)
    past = [torch.randn(b, cfg.num_key_value_heads, p, cfg.head_dim) for _ in range(2 * n)]
    emb = example_table(cfg.vocab_size, cfg.hidden_size)
    batch, ctx = torch.export.Dim("batch", max=64), torch.export.Dim("ctx_len", max=cfg.max_position_embeddings)
    past_len = torch.export.Dim("past_len", min=1, max=cfg.max_position_embeddings)
    # The block size is part of the drafter (it was trained with it): static in the graph.
    dyn = ({0: batch}, {0: batch, 1: ctx}, {0: batch, 1: ctx + blk}, {0: batch, 1: torch.export.Dim.DYNAMIC},
           [{0: batch, 2: past_len} for _ in range(2 * n)], {},
           {0: torch.export.Dim("draft_vocab", max=1 << 20)},  # LM-head rows: the full vocab or a draft vocab
           {0: torch.export.Dim("draft_slots", max=blk)})  # which block slots get logits (1..k)
    inputs = ["input_ids", "target_hidden", "position_ids", "attention_mask", *kv_names(n, "past"), "embed_weight",
              "lm_head_weight", "draft_slots"]
    outputs = ["logits", *kv_names(n, "new" if static else "present")]
    head = example_table(cfg.vocab_size, cfg.hidden_size)  # a distinct tensor: aliased inputs would be merged
    slots = torch.arange(1, blk)
    module = DrafterForExport(drafter, static).eval()
    args = (ids, th, pos, am, past, emb, head, slots)
    if drafter.lm_head is not None:  # its own LM head is stored in the graph (speculators format): no head input
        inputs.remove("lm_head_weight")
        dyn = dyn[:6] + dyn[7:]
        args = args[:6] + args[7:]
        module = _OwnHead(module)
    export_module(module, args, inputs, outputs, dyn, path)
    return {"inputs": inputs, "outputs": outputs, "kv_io": kv_io}
