"""Query-scaled drafter classes for vLLM, one per family, each a subclass of vLLM's own class that installs
:func:`plugins.vllm.scale.scale_queries` on every attention module after vLLM builds the model.

| family  | architecture name (config.json)     | vLLM class it extends                 | N             |
|---------|-------------------------------------|---------------------------------------|---------------|
| DFlash  | ``DFlashSharpDraftModel``           | ``qwen3_dflash.DFlashQwen3ForCausalLM`` | s + B (block) |
| EAGLE-3 | ``SharpDraftLlamaForCausalLMEagle3`` | ``llama_eagle3.Eagle3LlamaForCausalLM`` | position + 1  |
| PARD    | ``SharpDraftPardLlamaForCausalLM``  | ``llama.LlamaForCausalLM`` (draft_model) | position + 1  |

Names: vLLM keeps a DFlash architecture that starts with "DFlash" and an EAGLE-3 one that ends with "Eagle3" as
written (``EAGLEConfig``); the speculators format forces ``Eagle3LlamaForCausalLM`` instead, so a query-scaled
EAGLE-3 drafter uses the EAGLE-repo layout (``sharpdraft-export-vllm`` writes it).
"""
from __future__ import annotations

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from plugins.vllm.compat import check_version
from plugins.vllm.scale import profile_of, scale_queries


def _draft_where(vllm_config) -> str:
    spec = vllm_config.speculative_config
    return f"drafter {spec.draft_model_config.model}" if spec is not None else "this model"


def _install(layers, profile, *, block_of, prefix: str) -> None:
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        window = getattr(attn, "sliding_window", None) or getattr(attn.attn, "sliding_window", None)
        scale_queries(attn, profile, block=block_of(attn), window=window, layer=f"{prefix}.{i}")


class SharpDraftDFlash(DFlashQwen3ForCausalLM):
    """DFlash: every query of a block of B = num_speculative_tokens + 1 sees the valid context and the block
    (non-causal layers); causal layers (``dflash_config.causal``) count position + 1."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_version()
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.sharpdraft_profile = profile_of(self.config, _draft_where(vllm_config))
        block = vllm_config.speculative_config.num_speculative_tokens + 1
        _install(self.model.layers, self.sharpdraft_profile, prefix="dflash",
                 block_of=lambda attn: None if attn.causal else block)


class SharpDraftEagle3(Eagle3LlamaForCausalLM):
    """EAGLE-3 (EAGLE-repo layout): causal, N = position + 1 (tree nodes: ancestors + context, the same count)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_version()
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.sharpdraft_profile = profile_of(self.config, _draft_where(vllm_config))
        _install(self.model.layers, self.sharpdraft_profile, prefix="eagle3", block_of=lambda attn: None)


class SharpDraftPard(LlamaForCausalLM):
    """PARD (vLLM ``draft_model`` + ``parallel_drafting``): a causal Llama drafter, N = position + 1."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_version()
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.sharpdraft_profile = profile_of(self.config, _draft_where(vllm_config))
        _install(self.model.layers, self.sharpdraft_profile, prefix="pard", block_of=lambda attn: None)
