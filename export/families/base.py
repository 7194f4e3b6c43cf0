"""What every drafter family implements (:class:`DrafterFamily`) and the helpers they share; family-neutral: no
family is named here (export/families/__init__.py lists them)."""
from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

import numpy as np

from plugins.rule import Family

REPO_ROOT = Path(__file__).resolve().parents[2]


class DrafterFamily(abc.ABC):
    """One drafter family's behaviour during export and calibration.

    Attributes:
        family: the :class:`plugins.rule.Family` member.
        default_checkpoint: the shipped demo drafter (``--checkpoint`` omitted).
        rewrite_num_keys: keyword arguments of ``export.rewrite.rewrite_file`` saying where the in-graph beta reads
            N: ``{"num_keys_input": "attention_mask"}`` (per batch row, the mask's sum) or
            ``{"num_keys_from": NumKeysFrom.SCORE_MASK}`` (per query row, the keys its mask lets it see).
        num_keys_note: the manifest's ``query_scale.num_keys`` text (how N is counted for this family).
        fused_attention: whether ``--fused-attention`` (export/fuse.py) supports this family's attention.
        draft_tokens_option: whether ``--num-draft-tokens`` applies (the draft length is a graph constant chosen at
            export) or the checkpoint fixes it (DFlash: block size - 1).
        calibration_proxy: the acceptance proxy ``sharpdraft-calibrate`` plots for this family.
    """

    family: Family
    default_checkpoint: Path
    rewrite_num_keys: dict[str, Any]
    num_keys_note: str
    fused_attention: bool = False
    draft_tokens_option: bool = True
    calibration_proxy: str = "slot1_agreement"
    drafter_precisions: tuple[str, ...] = ("fp32",)  # --drafter-precision choices (export/drafter_quant.py)

    # ---------------------------------------------------------------- checkpoint and pair
    @abc.abstractmethod
    def load(self, ckpt: Path):
        """The torch drafter from its checkpoint folder (public format). Raises runtime.models CheckpointError."""

    def checkpoint_profile(self, drafter) -> dict | None:
        """The ``sharpdraft_query_scale`` profile the checkpoint ships, or None."""
        return getattr(drafter.config, "query_scale", None)

    @abc.abstractmethod
    def check_pair(self, drafter, target) -> None:
        """Refuse a drafter that cannot run on ``target`` (an HF causal LM). Raises ExportError saying what to pass."""

    @abc.abstractmethod
    def taps(self, drafter, num_target_layers: int) -> list[int]:
        """Target layers whose outputs the drafter reads, in ``export.graphs.TargetForExport``'s convention
        (tap i = the output of decoder layer i = HF ``hidden_states[i + 1]``); [] for a token-only drafter."""

    def draft_tokens(self, drafter, requested: int | None) -> int:
        """Tokens one drafting round proposes (K): ``requested`` (``--num-draft-tokens``), else the checkpoint's
        ``sharpdraft_num_draft_tokens``, else the family default."""
        return int(requested or checkpoint_field(drafter, "sharpdraft_num_draft_tokens") or self.default_draft_tokens)

    default_draft_tokens: int = 1

    def draft_vocab(self, ckpt: Path, full_vocab: bool, target_vocab_size: int,
                    drafter=None) -> np.ndarray | None:
        """The reduced draft vocabulary (target ids) the checkpoint ships, or None. Raises ExportError."""
        return None

    # ---------------------------------------------------------------- graphs
    def rewrite_options(self, drafter) -> dict[str, Any]:
        """``rewrite_file`` keyword arguments for this drafter (where beta reads N)."""
        return dict(self.rewrite_num_keys)

    def num_keys_text(self, drafter) -> str:
        """The manifest's ``query_scale.num_keys`` for this drafter."""
        return self.num_keys_note

    def fused_attention_ok(self, drafter) -> bool:
        """Whether ``--fused-attention`` can fuse this drafter's attentions."""
        return self.fused_attention

    def prepare_for_fusion(self, drafter) -> None:
        """Put the torch drafter in the graph form export/fuse.py matches, before ``--fused-attention`` exports it
        (default: nothing to change)."""

    def validate_fused(self, fused: Path, portable: Path, io: dict, config, profile, embed: np.ndarray,
                       lm_head: np.ndarray) -> dict:
        """The fused drafter graph (export/fuse.py, ``sharpdraft::QueryScaledAttention`` nodes) against the portable
        one on identical inputs; returns the manifest's ``validation.drafter_fused`` entry.

        Raises:
            ValidationError: the two graphs disagree beyond export/checks.py's bound.
            NotImplementedError: the family has no fused form (:attr:`fused_attention` False).
        """
        raise NotImplementedError(f"{self.family.value} drafters have no fused attention graph")

    @abc.abstractmethod
    def export_graphs(self, drafter, k: int, frozen: Path, out_root: Path, drafter_kv_io: str) -> tuple[dict, dict]:
        """Export the drafter graph (before the query-scale rewrite) to ``frozen``.

        Returns ``(drafter_io, extra)``: the graph's io entry, and ``{graph name: io}`` of further graphs written
        under ``out_root`` (EAGLE-3's ``drafter_fc``)."""

    @abc.abstractmethod
    def validate(self, drafter, k: int, path: Path, io: dict, profile, embed, lm_head,
                 draft_ids: np.ndarray | None) -> dict:
        """ORT vs torch on the rewritten graph at N below, at and above ref_keys (export/validate.py). ``embed`` /
        ``lm_head``: the tables the runtime will feed, ``[vocab, hidden]`` float32 torch tensors. Returns the
        manifest's ``validation.drafter`` entry; raises export.validate's ValidationError."""

    def quantization_context(self, drafter, target, tokenizer) -> dict:
        """What :meth:`quantization_feeds` needs of the torch target (its features on real text), computed while the
        target is loaded so that the export can release it before the target graph is built. Only families listing
        a precision other than "fp32" in :attr:`drafter_precisions` implement it."""
        raise NotImplementedError(f"{self.family.value} drafters export in fp32 only")

    def quantization_feeds(self, config, context: dict, embed, lm_head, draft_ids: np.ndarray | None,
                           rows: int = 48, chunk_rows: int = 8):
        """Batched feeds of the exported drafter graph on real text, ``chunk_rows`` rows each, ``rows`` in all
        (``config``: the drafter's config; ``context``: :meth:`quantization_context`; ``embed`` / ``lm_head``: the
        tables the runtime will feed, float32 ``[vocab, hidden]``), on which ``--drafter-precision int8 / fp16 /
        bf16`` measures how often the converted graph drafts the float graph's tokens (export/drafter_quant.py
        ``proposal_agreement``). A generator: each chunk is made when it is run."""
        raise NotImplementedError(f"{self.family.value} drafters export in fp32 only")

    @abc.abstractmethod
    def manifest_entry(self, ckpt: Path, drafter, k: int) -> dict:
        """The manifest's ``drafter`` section (family, checkpoint, config, and the facts the runtime reads)."""

    def _base_entry(self, ckpt: Path, drafter, k: int) -> dict:
        return {"family": self.family.value, "checkpoint": str(Path(ckpt).resolve()), "num_draft_tokens": k,
                "config": drafter.config.to_dict()}

    # ---------------------------------------------------------------- calibration
    @abc.abstractmethod
    def calibration_runner(self, drafter, target):
        """The ``export.calibrate`` runner that measures this family's attention and acceptance proxy vs N."""

    def prepare_for_calibration(self, drafter) -> None:
        """Set the drafter up for attention probing (in place)."""


def checkpoint_field(drafter, name: str):
    """A field of the checkpoint's config.json the family's config class does not parse (``sharpdraft_*``)."""
    cfg = drafter.config
    extra = getattr(cfg, "extra", None)
    if isinstance(extra, dict) and name in extra:
        return extra[name]
    raw = getattr(cfg, "raw", None)
    return raw.get(name) if isinstance(raw, dict) else getattr(cfg, name, None)
