"""Drafter families: everything that differs between DFlash, PARD and EAGLE-3, one folder per family.

:class:`DrafterFamily` (export/families/base.py) is the interface ``sharpdraft-export`` (export/pipeline.py) and
``sharpdraft-calibrate`` (export/calibrate.py) run over: loading a checkpoint, the pair checks, which target layers to
tap, how many tokens one round drafts, the drafter graph's export, where the in-graph beta reads N, the
ORT-vs-torch validation, the manifest's ``drafter`` section and the calibration runner. A family's folder holds all
of it: ``__init__.py`` (the family object), ``graph.py`` (the drafter graph's export), ``validate.py`` (the graph
against the torch drafter) and ``calibrate.py`` (its calibration runner); what they share is family-neutral
(export/graphs.py tracing, export/checks.py comparisons, export/probing.py calibration probes). The runtime reads
the manifest the family wrote and picks its drafter class by ``drafter.family``.

Adding a family: one folder here (the four modules above, its object listed in :func:`_registry`) and its runtime
model (the torch module in runtime/models/, the ONNX Runtime drafter class in runtime/backends/ort.py
``ORT_DRAFTERS``, the preset ref_keys in plugins/rule.py ``FAMILY_REF_KEYS``), as vLLM keeps one proposer module
per method.
"""
from __future__ import annotations

from export.errors import ExportError
from export.families.base import REPO_ROOT, DrafterFamily, checkpoint_field
from plugins.rule import Family

__all__ = ["FAMILIES", "REPO_ROOT", "DrafterFamily", "checkpoint_field", "get_family"]


def _registry() -> dict[Family, DrafterFamily]:
    from export.families.dflash import DFlashFamily
    from export.families.eagle3 import Eagle3Family
    from export.families.pard import PardFamily

    return {f.family: f for f in (DFlashFamily(), PardFamily(), Eagle3Family())}


FAMILIES: dict[Family, DrafterFamily] = {}


def get_family(name: "Family | str") -> DrafterFamily:
    """The family object for ``name`` (``"dflash"``, ``"pard"``, ``"eagle3"``, or a :class:`Family`).

    Raises:
        ExportError: an unknown family (the message lists the choices).
    """
    if not FAMILIES:
        FAMILIES.update(_registry())
    try:
        return FAMILIES[Family.parse(name)]
    except ValueError as e:
        raise ExportError(str(e)) from None
