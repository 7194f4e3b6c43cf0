"""EAGLE-3 (arXiv 2503.01840; SafeAILab / vLLM / TensorRT-LLM checkpoints): one decoder layer on three fused target
layers drafts a chain of K tokens; query row p sees N = p + 1 keys (causal chain drafting)."""
from __future__ import annotations

from pathlib import Path

from export.errors import ExportError
from export.families.base import REPO_ROOT, DrafterFamily, checkpoint_field
from export.rewrite import NumKeysFrom
from plugins.rule import Family


def aux_layers(drafter, num_target_layers: int) -> list[int]:
    """The HF ``hidden_states`` indices an EAGLE-3 drafter reads (its config's, else 2, L // 2, L - 3)."""
    from runtime.models.eagle3 import default_aux_layer_ids

    return drafter.config.aux_layer_ids or default_aux_layer_ids(num_target_layers)


class Eagle3Family(DrafterFamily):
    family = Family.EAGLE3
    default_checkpoint = REPO_ROOT / "drafters" / "eagle3-smollm2-135m"
    rewrite_num_keys = {"num_keys_from": NumKeysFrom.SCORE_MASK}
    num_keys_note = "per query row: visible keys of its attention mask"
    default_draft_tokens = 5  # chain length K when the checkpoint does not say

    def load(self, ckpt: Path):
        from runtime.models.eagle3 import load_eagle3

        return load_eagle3(ckpt)

    def check_pair(self, drafter, target) -> None:
        d, t = drafter.config, target.config  # fc reads 3 target layers; vocabulary and embedding are shared
        layers = aux_layers(drafter, t.num_hidden_layers)
        problems = []
        if d.target_hidden_size != t.hidden_size:
            problems.append(f"target_hidden_size {d.target_hidden_size} vs target {t.hidden_size}")
        if any(not 1 <= i <= t.num_hidden_layers for i in layers):
            problems.append(f"aux hidden-state layers {layers} outside the target's 1..{t.num_hidden_layers}")
        if drafter.embed_tokens is None and d.hidden_size != t.hidden_size:
            problems.append(f"borrows the target's embedding but hidden_size {d.hidden_size} != {t.hidden_size}")
        if d.vocab_size != t.vocab_size:
            problems.append(f"vocab_size {d.vocab_size} vs target {t.vocab_size} (d2t maps into the target's ids)")
        if problems:
            raise ExportError("EAGLE-3 drafter does not fit this target: " + "; ".join(problems)
                              + " (pass the --target it was trained for)")

    def taps(self, drafter, num_target_layers: int) -> list[int]:
        # EAGLE-3 names HF hidden_states indices; tap i of TargetForExport is hidden_states[i + 1]
        return [i - 1 for i in aux_layers(drafter, num_target_layers)]

    def draft_tokens(self, drafter, requested: int | None) -> int:
        """``--num-draft-tokens``, else the checkpoint's ``sharpdraft_num_draft_tokens``, else a speculators config's
        proposal length (``speculative_tokens``), else 5."""
        return int(requested or checkpoint_field(drafter, "sharpdraft_num_draft_tokens")
                   or drafter.config.num_speculative_tokens or self.default_draft_tokens)

    def export_graphs(self, drafter, k, frozen, out_root, drafter_kv_io):
        from export.families.eagle3.graph import export_eagle3_drafter

        io, fc_io = export_eagle3_drafter(drafter, frozen, out_root / "drafter_fc" / "model.onnx")
        return io, {"drafter_fc": fc_io}

    def validate(self, drafter, k, path, io, profile, embed, lm_head, draft_ids):
        from export.families.eagle3.validate import validate_eagle3_drafter

        return validate_eagle3_drafter(drafter, path, io, profile, embed if drafter.embed_tokens is None else None)

    def manifest_entry(self, ckpt, drafter, k):
        c = drafter.config
        return {**self._base_entry(ckpt, drafter, k), "aux_layer_ids": c.aux_layer_ids,
                "draft_vocab_size": c.draft_vocab_size, "borrow_embeddings": drafter.embed_tokens is None,
                "num_keys": "per query row: position + 1 (causal chain drafting)"}

    def calibration_runner(self, drafter, target):
        from export.families.eagle3.calibrate import Eagle3Runner

        return Eagle3Runner(drafter, target, aux_layers(drafter, target.config.num_hidden_layers))
