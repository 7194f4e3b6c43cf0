"""PARD parallel drafter (AMD, arXiv 2504.18583): an ordinary HF causal LM that drafts K tokens in one forward.

Checkpoint format (``amd/PARD-Llama-3.2-1B``, ``amd/PARD-Qwen3-0.6B`` and peers; docs/reference/drafters.md
§2.3, §6.2): a standard Llama / Qwen2 / Qwen3 ``config.json`` plus ``pard_token`` (the mask id; vLLM also reads
``ptd_token_id``) and optionally ``spd_type: "pard"``; safetensors with HF keys ``model.embed_tokens``,
``model.layers.{i}.*``, ``model.norm``, ``lm_head`` (absent when ``tie_word_embeddings``). The model is built with
transformers (``AutoModelForCausalLM.from_config``), so every layout transformers knows (llama3 RoPE scaling, Qwen3
q/k norms, sliding windows) is computed exactly as upstream.

Drafting (``PardInfer.generate``): input = the committed tokens not yet in the drafter's cache, ending with the last
real token, then K-1 ``pard_token`` slots, at contiguous positions under the ordinary causal mask; the last K rows'
logits are the K draft tokens; the drafter cache is then rewound to drop the mask slots. N of a query row = its
position + 1 (causal), so beta differs per row (docs/design.md §1).

sharpdraft extensions, for demo drafters of targets without a spare id or whose embedding is large:
- ``pard_token == vocab_size`` with an extra tensor ``mask_embedding`` ``[hidden]``: slots holding the mask id are
  embedded with it (the DFlash demo drafter's scheme, runtime/models/dflash.py);
- ``"sharpdraft_embeddings": "target"``: no ``embed_tokens`` / ``lm_head`` in the checkpoint; the (tied) table of the
  target is used, passed at run time like DFlash's.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.checkpoint_io import CheckpointError, check_state, read_safetensors


def pard_token_of(config: dict[str, Any]) -> int:
    """The mask id of a PARD ``config.json`` dict (``pard_token``, else ``ptd_token_id``, as vLLM reads them).

    Raises:
        CheckpointError: neither field is present (not a PARD checkpoint).
    """
    for key in ("pard_token", "ptd_token_id"):
        if config.get(key) is not None:
            return int(config[key])
    raise CheckpointError("config.json has no pard_token: not a PARD drafter checkpoint (PARD configs carry the "
                          "mask id as pard_token)")


class PardDrafter(nn.Module):
    """A PARD drafter: an HF causal LM body + the mask-token embedding rule.

    Attributes:
        model: the transformers ``*ForCausalLM`` (its ``model`` is the decoder; ``lm_head`` may be unused).
        pard_token: mask id; ``mask_embedding`` ``[hidden]`` or None (the id is a real vocabulary row).
        borrow_embeddings: True when embedding / LM head are the target's (passed to :meth:`forward`).
    """

    def __init__(self, model: nn.Module, pard_token: int, borrow_embeddings: bool):
        super().__init__()
        self.model = model
        self.config = model.config
        self.pard_token = int(pard_token)
        self.borrow_embeddings = bool(borrow_embeddings)
        hidden = model.config.hidden_size
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if self.uses_mask_embedding else None

    @property
    def uses_mask_embedding(self) -> bool:
        return self.pard_token >= self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed(self, ids: torch.Tensor, embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[batch, q]`` int64 -> ``[batch, q, hidden]``; mask ids use ``mask_embedding`` if present."""
        table = embed_weight if embed_weight is not None else self.model.get_input_embeddings().weight
        if self.mask_embedding is None:
            return F.embedding(ids, table)
        is_mask = (ids == self.pard_token)[..., None]
        emb = F.embedding(ids.clamp(max=table.shape[0] - 1), table)
        return torch.where(is_mask, self.mask_embedding.to(emb.dtype), emb)

    def lm_head_weight(self, embed_weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.borrow_embeddings or getattr(self.config, "tie_word_embeddings", False):
            return embed_weight if embed_weight is not None else self.model.get_input_embeddings().weight
        return self.model.get_output_embeddings().weight

    def forward(self, input_ids, position_ids, attention_mask, past: list[torch.Tensor] | None = None,
                embed_weight: torch.Tensor | None = None, num_logits: int | None = None):
        """One draft forward with a flat KV cache.

        Args:
            input_ids: ``[batch, q]`` int64 (pending committed tokens, then K-1 ``pard_token``).
            position_ids: ``[batch, q]`` int64 absolute positions.
            attention_mask: ``[batch, past_len + q]`` int64, 1 = visible key (ragged rows: 0 on padding).
            past: ``2 * layers`` tensors ``[batch, kv_heads, past_len, head_dim]`` (key, value per layer) or None.
            embed_weight: the target's table ``[vocab, hidden]`` when the checkpoint borrows it.
            num_logits: return logits of the last ``num_logits`` rows only (None = all).
        Returns:
            (logits ``[batch, rows, vocab]`` f32, present: ``2 * layers`` tensors over past_len + q).
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        for i in range(self.num_layers if past else 0):
            cache.update(past[2 * i], past[2 * i + 1], i)
        emb = self.embed(input_ids, embed_weight)
        kwarg = "cache" if "cache" in inspect.signature(self.model.model.forward).parameters else "past_key_values"
        out = self.model.model(inputs_embeds=emb, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=True, **{kwarg: cache})
        h = out.last_hidden_state if num_logits is None else out.last_hidden_state[:, -num_logits:]
        logits = torch.matmul(h, self.lm_head_weight(embed_weight).transpose(0, 1))
        kv = out["cache"] if "cache" in out else out["past_key_values"]
        present = [t for layer in kv.layers for t in (layer.keys, layer.values)]
        return logits, present


def sliding_layers(raw: dict) -> list[int]:
    """Indices of the layers a transformers config (``config.json`` as a dict) makes sliding-window: those whose
    ``layer_types`` entry is ``sliding_attention``, or every layer when ``use_sliding_window`` is true (Qwen2 /
    Qwen3) or the model type always windows (Mistral) and ``sliding_window`` is set."""
    n = int(raw.get("num_hidden_layers") or 0)
    types = raw.get("layer_types")
    if isinstance(types, list) and types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = raw.get("sliding_window")
    if window and (raw.get("use_sliding_window") or raw.get("model_type") in ("mistral", "mixtral")):
        return list(range(n))
    return []


def load_pard(path: str | Path, *, dtype: torch.dtype = torch.float32) -> PardDrafter:
    """Load a PARD checkpoint folder (``config.json`` + ``*.safetensors``) strictly.

    Raises:
        CheckpointError: folder / config / weights missing or unreadable, no ``pard_token``, sliding-window
            layers (not supported yet), an architecture transformers cannot build, keys missing or unexpected
            (listed), shapes not matching the config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json; a PARD checkpoint folder holds config.json and "
                              "model.safetensors")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from e
    pard_token = pard_token_of(raw)
    if raw.get("pard2") or raw.get("spd_type") == "pard2" or any(k.startswith("pard2_") for k in raw):
        raise CheckpointError(f"{cfg_file}: a PARD2 drafter (spd_type pard2): not supported yet (missing: its "
                              "target_proj, which adds the target's hidden states of pard2_target_layers to the "
                              "drafter's embeddings; loaded as plain PARD it would draft without them); use a PARD v1 "
                              "checkpoint")
    sliding = sliding_layers(raw)
    if sliding:
        raise CheckpointError(f"{cfg_file}: {len(sliding)} sliding-window layer(s) (layers {sliding[:6]}, "
                              f"sliding_window {raw.get('sliding_window')}): sharpdraft cannot run PARD drafters with "
                              "sliding-window attention yet (the window would be dropped and N not capped per "
                              "layer); use a checkpoint whose layers are all full_attention")
    borrow = raw.get("sharpdraft_embeddings") == "target"
    model_type = raw.get("model_type")
    try:
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
        config = AutoConfig.for_model(model_type, **fields)
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{cfg_file}: transformers cannot build model_type {model_type!r} ({e}); PARD "
                              "drafters are Llama / Qwen2 / Qwen3 causal LMs") from e
    drafter = PardDrafter(model, pard_token, borrow)
    state = read_safetensors(path)
    state = {("model." + k if not k.startswith("mask_embedding") else k): v for k, v in state.items()}
    expected = drafter.state_dict()
    optional = set()
    if borrow:
        optional |= {"model.model.embed_tokens.weight", "model.lm_head.weight"}
    if getattr(config, "tie_word_embeddings", False):
        optional.add("model.lm_head.weight")
    check_state(path, expected, state, optional=optional,
                show=lambda k: k[len("model."):] if k.startswith("model.") else k)
    drafter.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False) and not borrow:
        model.tie_weights()
    return drafter.to(dtype).eval()
