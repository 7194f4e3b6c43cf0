"""EAGLE-3's calibration runner: one causal pass over the document (token p + 1 at row p), N = p + 1."""
from __future__ import annotations

import torch

from export.probing import CausalRunner


class Eagle3Runner(CausalRunner):
    shift = 1

    def _layers(self) -> list:
        return [self.d.midlayer.self_attn]

    def __init__(self, drafter, target, aux_layers: list[int]):
        self.aux_layers = aux_layers  # the HF hidden_states the drafter reads (export.families.eagle3.aux_layers)
        super().__init__(drafter, target)

    def _taps(self) -> list[int]:
        return self.aux_layers

    def _draft(self, doc, rows, L, profile):
        from runtime.models.eagle3 import row_beta

        mask = torch.ones(1, L, dtype=torch.long)
        beta = None if profile is None else row_beta(mask, L, profile)
        logits, _, _ = self.d(doc["ids"][None, 1:L + 1], self.d.project(doc["feats"][:, :L]),
                              torch.arange(L)[None], mask, beta=beta,
                              embed_weight=self.embed if self.d.embed_tokens is None else None)
        # row p predicts token p + 2, as the target's row p + 1
        return self.d.draft_to_target[logits[0, rows].argmax(-1)], doc["pred"][[r + 1 for r in rows]]
