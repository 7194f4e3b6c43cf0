"""DFlash's calibration runner: one draft block after s context tokens, N = s + B for every block query."""
from __future__ import annotations

from collections import defaultdict

import torch

from export.probing import Recorder, row_keys, target_pass
from plugins.rule import QueryScaleProfile
from runtime.models import attention_probe


class DFlashRunner:
    def __init__(self, drafter, target):
        self.d, self.target = drafter, target
        self.B = drafter.config.block_size
        self.embed = target.get_input_embeddings().weight
        self.layers = [layer.self_attn for layer in drafter.layers]
        # sliding-window layers (layer_types) do not dilute past their window: only the full layers are fitted
        self.windows = list(drafter.config.windows)
        self.fit_layers = [i for i, w in enumerate(self.windows) if w is None] or list(range(len(self.windows)))

    def prepare(self, ids: list[int]) -> dict:
        t = torch.tensor(ids, dtype=torch.long)
        pred, feats = target_pass(self.target, t, [i + 1 for i in self.d.config.target_layer_ids])
        from runtime.models.layers import rope_cos_sin

        with torch.no_grad():
            ctx = self.d.project_context(feats)
            pos = torch.arange(len(ids))[None]
            cos, sin = rope_cos_sin(pos, self.d.config.head_dim, self.d.config.rope_theta, ctx.dtype)
            kv = [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.d.layers]
        return {"ids": t, "pred": pred, "kv": kv}

    def run(self, doc: dict, n_values: list[int], profile: QueryScaleProfile | None):
        """Per grid point: ({layer: scores [rows*heads*B... ]}, proxy accepted lengths, slot-1 agreement)."""
        out = []
        width = len(self.d.config.target_layer_ids) * self.d.config.hidden_size
        no_new_context = doc["kv"][0][0].new_zeros(1, 0, width)  # every context row is already in the cached K/V
        for n in n_values:
            scores, acc, slot1 = defaultdict(list), [], []
            for nk in row_keys(n):
                s = nk - self.B  # anchor: s context tokens, N = s + B
                if s < 1 or nk > len(doc["ids"]):
                    continue
                rec = Recorder(self.layers)
                block = torch.full((1, self.B), self.d.config.mask_token_id, dtype=torch.long)
                block[0, 0] = doc["ids"][s]
                # beta per layer from that layer's own mask (N = s + B on a full layer; a windowed layer's N stops
                # at its window), as the exported graph and the torch backend compute it
                scale = {} if profile is None else {"profile": profile,
                                                    "key_mask": torch.ones(1, s + self.B, dtype=torch.bool)}
                with torch.no_grad(), attention_probe.record(rec):
                    emb = self.d.embed_block(block, self.embed)
                    h, _ = self.d(emb, no_new_context, torch.arange(s, s + self.B)[None],
                                  [(k[:, :, :s], v[:, :, :s]) for k, v in doc["kv"]], **scale)
                    drafted = (h[0, 1:] @ self.embed.T).argmax(-1)  # slot j predicts position s + j
                truth = doc["pred"][s:s + self.B - 1]  # target's greedy token for positions s+1 .. s+B-1
                ok = (drafted == truth).long()
                acc.append(1 + int(ok.cumprod(0).sum()))
                slot1.append(int(ok[0]))
                for i, sc in rec.scores.items():
                    scores[i].append(sc.reshape(-1, sc.shape[-1]))
            out.append((scores, acc, slot1))
        return out
