"""sharpdraft's query scale as a vLLM plugin (``vllm.general_plugins`` entry point ``sharpdraft``).

:func:`register` adds one query-scaled drafter architecture per family to vLLM's model registry (lazily, by
``module:Class`` string, so loading the plugin imports nothing heavy); a drafter's ``config.json`` picks it by name
(``sharpdraft-export-vllm`` writes the names and the ``sharpdraft_query_scale`` profile). The classes, the N rule
per family and the refusals: plugins/vllm/models.py, scale.py, compat.py; docs/vllm.md.

Imports: torch, vLLM and plugins/rule.py only.
"""
from __future__ import annotations

ARCHITECTURES = {
    "DFlashSharpDraftModel": "plugins.vllm.models:SharpDraftDFlash",
    "SharpDraftLlamaForCausalLMEagle3": "plugins.vllm.models:SharpDraftEagle3",
    "SharpDraftPardLlamaForCausalLM": "plugins.vllm.models:SharpDraftPard",
}


def register() -> None:
    """Called by vLLM in every process it starts (possibly more than once: registering again is harmless)."""
    from vllm import ModelRegistry

    for name, target in ARCHITECTURES.items():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, target)
