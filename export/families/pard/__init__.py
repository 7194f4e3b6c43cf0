"""PARD (AMD, arXiv 2504.18583): a small causal LM drafts K tokens in one forward from the committed tokens plus
K - 1 mask tokens; query row p sees N = p + 1 keys (its causal mask)."""
from __future__ import annotations

from pathlib import Path

from export.errors import ExportError
from export.families.base import REPO_ROOT, DrafterFamily
from export.rewrite import NumKeysFrom
from plugins.rule import Family


class PardFamily(DrafterFamily):
    family = Family.PARD
    default_checkpoint = REPO_ROOT / "drafters" / "pard-smollm2-135m"
    # N per query row = the keys its own attention mask lets it see (position + 1, ragged holes excluded)
    rewrite_num_keys = {"num_keys_from": NumKeysFrom.SCORE_MASK}
    num_keys_note = "per query row: visible keys of its attention mask"
    default_draft_tokens = 8  # when the checkpoint does not say (sharpdraft_num_draft_tokens); the reference uses 12

    def load(self, ckpt: Path):
        from runtime.models.pard import load_pard

        return load_pard(ckpt)

    def checkpoint_profile(self, drafter) -> dict | None:
        return getattr(drafter.config, "sharpdraft_query_scale", None)

    def check_pair(self, drafter, target) -> None:
        d, t = drafter.config, target.config  # only a borrowed embedding ties a PARD drafter to its target
        if drafter.borrow_embeddings and d.hidden_size != t.hidden_size:
            raise ExportError(f"PARD drafter borrows the target's embedding but its hidden_size {d.hidden_size} "
                              f"differs from the target's {t.hidden_size}; pass the --target it was trained for")

    def taps(self, drafter, num_target_layers: int) -> list[int]:
        return []  # PARD reads token ids only

    def export_graphs(self, drafter, k, frozen, out_root, drafter_kv_io):
        from export.families.pard.graph import export_pard_drafter

        return export_pard_drafter(drafter, k, frozen), {}

    def validate(self, drafter, k, path, io, profile, embed, lm_head, draft_ids):
        from export.families.pard.validate import validate_pard_drafter

        return validate_pard_drafter(drafter, k, path, io, profile, embed if drafter.borrow_embeddings else None)

    def manifest_entry(self, ckpt, drafter, k):
        return {**self._base_entry(ckpt, drafter, k), "pard_token": drafter.pard_token,
                "mask_embedding": drafter.uses_mask_embedding, "borrow_embeddings": drafter.borrow_embeddings,
                "num_keys": "per query row: the keys its causal mask lets it see (position + 1)"}

    def calibration_runner(self, drafter, target):
        from export.families.pard.calibrate import PardRunner

        return PardRunner(drafter, target)

    def prepare_for_calibration(self, drafter) -> None:
        from runtime.models.hf_query_scale import ATTN_IMPLEMENTATION

        drafter.model.set_attn_implementation(ATTN_IMPLEMENTATION)
