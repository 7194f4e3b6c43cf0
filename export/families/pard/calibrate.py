"""PARD's calibration runner: one causal pass, row p sees N = p + 1 keys; slot-1 agreement."""
from __future__ import annotations

import torch

from export.probing import CausalRunner


class PardRunner(CausalRunner):
    def _layers(self) -> list:
        return [layer.self_attn for layer in self.d.model.model.layers]

    def _draft(self, doc, rows, L, profile):
        from runtime.models.hf_query_scale import query_scale

        with query_scale(profile):
            logits, _ = self.d(doc["ids"][None, :L], torch.arange(L)[None], torch.ones(1, L, dtype=torch.long),
                               embed_weight=self.embed if self.d.borrow_embeddings else None)
        return logits[0, rows].argmax(-1), doc["pred"][rows]  # row p predicts token p + 1, as the target's row p
