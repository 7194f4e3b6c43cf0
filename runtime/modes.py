"""The runtime's mode vocabularies, one ``str`` enum each (the drafter families are :class:`plugins.rule.Family`).

``str`` enums compare equal to their values (``KvIo.STATIC == "static"``), write to JSON as those values and parse
from CLI / manifest strings with :meth:`_Mode.parse`, whose error lists the choices. Modes owned elsewhere:
``export.rewrite.NumKeysFrom`` (where the rewrite reads N), ``plugins.trtllm_patch.Route`` (how beta reaches
TensorRT-LLM's attention).
"""
from __future__ import annotations

from plugins.rule import Vocabulary


class _Mode(Vocabulary):
    @classmethod
    def _refusal(cls, value) -> str:  # names the field as users write it
        label = _LABELS.get(cls.__name__, cls.__name__)
        return f"{label} must be one of {', '.join(m.value for m in cls)}, got {value!r}"


class Backend(_Mode):
    """What runs the pair: the engines folder's ONNX graphs, or the recorded sources rebuilt in PyTorch."""

    ONNXRUNTIME = "onnxruntime"
    TORCH = "torch"


class KvIo(_Mode):
    """How a graph takes and returns its KV cache (export/graphs.py, export/genai_target.py, runtime/kv_cache.py).

    STATIC: fixed-capacity past buffers in, only the new positions out (the runtime writes them in place).
    CONCAT: present = past + new (the graph allocates; the former default).
    SHARED: past and present are one buffer bound to both (ONNX Runtime GenAI's builder graphs, GQA).
    AUTO: export option only: STATIC where the target's attention allows it, else CONCAT.
    """

    STATIC = "static"
    CONCAT = "concat"
    SHARED = "shared"
    AUTO = "auto"


class Verification(_Mode):
    """Lossless verification of sampled drafts (runtime/sampling.py): Leviathan/Chen rejection sampling, or DFlash's
    exact match against a target sample. Greedy requests verify by argmax under either."""

    REJECTION = "rejection"
    EXACT_MATCH = "exact_match"


class AttentionImpl(_Mode):
    """The torch DFlash drafter's attention (runtime/models/dflash.py): inline softmax, or the fused sharpdraft op."""

    EAGER = "eager"
    FUSED = "fused"


class DrafterContext(_Mode):
    """What a drafter reads of the committed context: the target's tapped hidden states (DFlash), the committed token
    ids themselves (PARD), or both (EAGLE-3: features fused with the next token's embedding)."""

    TARGET_FEATURES = "target_features"
    TOKENS = "tokens"
    FEATURES_AND_TOKENS = "features_and_tokens"


_LABELS = {"Backend": "backend", "KvIo": "kv_io", "Verification": "verification", "AttentionImpl": "attention_impl",
           "DrafterContext": "drafter context"}  # how parse errors name each field
