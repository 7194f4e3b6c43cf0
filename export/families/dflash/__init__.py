"""DFlash (z-lab, arXiv 2602.06036): one non-causal forward drafts a block [bonus, MASK x (B - 1)] from the target's
tapped hidden states; every query of a block sees N = s + B keys (s committed context tokens)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export.errors import ExportError
from export.families.base import REPO_ROOT, DrafterFamily
from export.rewrite import NumKeysFrom
from plugins.rule import Family


class DFlashFamily(DrafterFamily):
    family = Family.DFLASH
    # the shipped default: layer 0 sliding-window (768 keys), layer 1 full; drafters/dflash-smollm2-135m is the
    # all-full-attention drafter it was trained from (the long-context study's diluting drafter, --fused-attention)
    default_checkpoint = REPO_ROOT / "drafters" / "dflash-smollm2-135m-swa768-1full"
    rewrite_num_keys = {"num_keys_input": "attention_mask", "num_keys_from": NumKeysFrom.KEY_MASK}
    # N per batch row from the key mask: ragged batches right-pad rows, so a Shape would overcount them
    num_keys_note = "per batch row: sum of the drafter's attention_mask"
    fused_attention = True
    draft_tokens_option = False
    calibration_proxy = "proxy_mal"
    drafter_precisions = ("fp32", "fp16", "bf16", "int8")

    def load(self, ckpt: Path):
        from runtime.models.dflash import load_dflash

        return load_dflash(ckpt)

    def check_pair(self, drafter, target) -> None:
        d, t = drafter.config, target.config
        problems = []
        if d.hidden_size != t.hidden_size:
            problems.append(f"hidden_size {d.hidden_size} vs target {t.hidden_size}")
        if d.num_target_layers_known and d.num_target_layers != t.num_hidden_layers:
            problems.append(f"num_target_layers {d.num_target_layers} vs target layers {t.num_hidden_layers}")
        elif max(d.target_layer_ids) >= t.num_hidden_layers:  # speculators configs do not state the target's depth
            problems.append(f"target layer {max(d.target_layer_ids)} tapped, the target has {t.num_hidden_layers}")
        if drafter.lm_head is not None and drafter.d2t is None and d.own_lm_head != t.vocab_size:
            problems.append(f"its own LM head scores {d.own_lm_head} rows without a d2t mapping, the target's "
                            f"vocabulary has {t.vocab_size}")
        if problems:
            raise ExportError("drafter checkpoint does not fit this target: " + "; ".join(problems)
                              + " (pass the --target it was trained for)")

    def taps(self, drafter, num_target_layers: int) -> list[int]:
        return list(drafter.config.target_layer_ids)  # DFlash's target_layer_ids are decoder-layer outputs already

    def draft_tokens(self, drafter, requested: int | None) -> int:
        return drafter.config.block_size - 1  # fixed by the checkpoint's block size

    def draft_vocab(self, ckpt: Path, full_vocab: bool, target_vocab_size: int,
                    drafter=None) -> np.ndarray | None:
        """The checkpoint's ``draft_vocab.json``, or, for a drafter with its own draft-vocabulary head
        (speculators format), the target ids of its rows (``d2t``). Raises ExportError."""
        from runtime.draft_vocab import DRAFT_VOCAB_FILE, DraftVocabError, load_draft_vocab

        if drafter is not None and drafter.lm_head is not None:
            if full_vocab and drafter.d2t is not None:
                raise ExportError(f"--full-vocab: this drafter's own LM head scores {drafter.d2t.numel()} "
                                  "draft-vocabulary rows only (speculators format, d2t); export without --full-vocab")
            ids = drafter.head_target_ids()
            return None if ids is None else ids.numpy().astype(np.int64)
        if full_vocab or not (Path(ckpt) / DRAFT_VOCAB_FILE).is_file():
            return None
        try:
            return load_draft_vocab(Path(ckpt) / DRAFT_VOCAB_FILE, target_vocab_size)
        except DraftVocabError as e:
            raise ExportError(f"{e} (or export with --full-vocab)") from e

    def rewrite_options(self, drafter) -> dict:
        """Full layers: N per batch row from the key mask. With sliding-window layers N differs per layer and per
        query row (a row sees the keys within its window), so every attention's N is counted from its own mask
        (score_mask mode: full layers still get s + B, windowed ones min(s + B, their window's keys))."""
        if drafter.config.sliding:
            return {"num_keys_from": NumKeysFrom.SCORE_MASK}
        return dict(self.rewrite_num_keys)

    def num_keys_text(self, drafter) -> str:
        if drafter.config.sliding:
            return "per query row and layer: visible keys of that attention's mask (sliding layers: their window)"
        return self.num_keys_note

    def fused_attention_ok(self, drafter) -> bool:
        # sliding layers fuse with their window (export/fuse.py); the graph form reads the LM head as an input
        return drafter.lm_head is None

    def export_graphs(self, drafter, k, frozen, out_root, drafter_kv_io):
        from export.families.dflash.graph import export_drafter

        return export_drafter(drafter, frozen, kv_io=drafter_kv_io), {}

    def prepare_for_fusion(self, drafter):
        for layer in drafter.layers:  # sliding layers: K/V repeated per head, each query row its own window
            layer.self_attn.fold_per_query_masks = False

    def validate_fused(self, fused, portable, io, config, profile, embed, lm_head):
        from export.families.dflash.validate import validate_fused_drafter

        return validate_fused_drafter(fused, portable, io, config, profile, embed, lm_head)

    def validate(self, drafter, k, path, io, profile, embed, lm_head, draft_ids):
        from export.families.dflash.validate import validate_drafter

        # with a draft vocabulary the graph is checked on the LM-head rows the runtime will feed (or on the
        # drafter's own head, stored in the graph)
        if drafter.lm_head is not None:
            head = drafter.lm_head.weight.detach()
        else:
            head = lm_head if draft_ids is None else lm_head[torch.from_numpy(draft_ids)]
        return validate_drafter(drafter, path, io, profile, embed, head)

    @torch.no_grad()
    def quantization_context(self, drafter, target, tokenizer):
        """The target's taps on a few hundred tokens of real text (the validation sentence and the standard
        library's ``json`` sources, offline on every machine): ``{"ids": [n] int64, "features": [n, taps * hidden]
        float32}``, n <= 640."""
        import inspect
        import json.decoder

        from export.validate import VALIDATION_TEXT

        text = VALIDATION_TEXT + inspect.getsource(json.decoder)
        ids = torch.tensor(tokenizer.encode(text)[:640])[None]
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[t + 1] for t in drafter.config.target_layer_ids], -1)[0].float().numpy()
        return {"ids": ids[0].numpy(), "features": feats}

    def quantization_feeds(self, config, context, embed, lm_head, draft_ids, rows: int = 48, chunk_rows: int = 8):
        """``rows`` blocks drafted after real text, yielded ``chunk_rows`` at a time: row r has the target's taps of
        the first p_r tokens as context (empty past) and token p_r as its bonus; p_r spread over the context's
        tokens. A chunk's ``target_hidden`` is ``[chunk, max p_r of the chunk, taps * hidden]`` float32."""
        from runtime.ragged import dflash_block

        c = config
        ids, feats = context["ids"], context["features"]
        ends = np.linspace(8, ids.shape[0] - 1, rows).astype(int)
        blk = c.block_size
        head = lm_head if draft_ids is None else lm_head[torch.from_numpy(draft_ids)]  # unused by own-head graphs
        tables = {"embed_weight": embed.numpy(), "lm_head_weight": head.numpy(),
                  "draft_slots": np.arange(1, blk, dtype=np.int64)}
        for start in range(0, rows, chunk_rows):
            part = ends[start:start + chunk_rows]
            n = len(part)
            hidden = np.zeros((n, int(part.max()), feats.shape[1]), np.float32)
            tokens = np.full((n, blk), c.mask_token_id, np.int64)
            for r, p in enumerate(part):
                hidden[r, :p] = feats[:p]
                tokens[r, 0] = ids[p]
            pos, mask = dflash_block([0] * n, part.tolist(), 1, blk)  # one masked past slot: static graphs need >= 1
            empty = np.zeros((n, c.num_key_value_heads, 1, c.head_dim), np.float32)
            feed = {**tables, "input_ids": tokens, "target_hidden": hidden, "position_ids": pos,
                    "attention_mask": mask, "query_scale_enabled": np.ones(n, np.float32)}
            for i in range(c.num_hidden_layers):
                feed[f"past_key.{i}"] = feed[f"past_value.{i}"] = empty
            yield feed

    def manifest_entry(self, ckpt, drafter, k):
        c = drafter.config
        return {**self._base_entry(ckpt, drafter, k), "block_size": c.block_size,
                "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
                "mask_embedding": c.uses_mask_embedding, "num_keys": "s + block_size (all queries of a block)"}

    def calibration_runner(self, drafter, target):
        from export.families.dflash.calibrate import DFlashRunner

        return DFlashRunner(drafter, target)
