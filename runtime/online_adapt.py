"""Online draft adaptation: the drafter learns from the target's verified tokens while it serves (torch backend).

The baseline SharpDraft (arXiv 2610.05106, Table 1) compares query scaling with: after each verify round, a
gradient step on the drafter whose labels are the tokens the target just produced, either on low-rank adapters
(LoRA, rank r, on the drafter's attention and MLP projections) or on every drafter weight ("full"). Only the
drafter changes, so decoding stays lossless: the target still verifies every draft token.

One step (:meth:`OnlineAdapter.learn`), per drafting row of the round: the block forward of that round is run
again with gradients (the row's cached context K/V, computed by earlier weights, are reused as they are, detached),
the LM head (the target's, frozen) scores slots 1..m, and cross-entropy against the m tokens the target emitted
after the bonus token (accepted drafts and the target's own correction) is minimised with AdamW. ``interval``
rounds are collected per step. LoRA adapters come from ``peft`` (``inject_adapter_in_model``), B initialised to
zero, so the drafter starts exactly as shipped.

Recorded (:meth:`OnlineAdapter.stats`): trainable parameters, steps, mean loss of the last steps, the optimizer
state's bytes, the adapter's extra bytes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from runtime.modes import AttentionImpl
from runtime.backends.pytorch import BlockInputs, TorchDFlashDrafter

MODES = ("lora", "full")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class AdaptConfig:
    """Online adaptation settings.

    Attributes:
        mode: "lora" (adapters on ``LORA_TARGETS`` of every drafter layer) or "full" (every drafter weight).
        rank: LoRA rank r (alpha = 2 r, as peft's common default ratio).
        lr: AdamW learning rate.
        interval: verify rounds collected per gradient step (>= 1).
    Raises:
        ValueError: an unknown mode or a non-positive rank / lr / interval.
    """

    mode: str = "lora"
    rank: int = 8
    lr: float = 1e-4
    interval: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"online adaptation mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.rank < 1 or self.lr <= 0 or self.interval < 1:
            raise ValueError(f"rank, lr and interval must be positive, got {self.rank}, {self.lr}, {self.interval}")


@dataclasses.dataclass
class _Example:
    """One drafting row of a round: the block forward's inputs (the drafter's record) and the target's tokens
    after the bonus token."""

    inputs: BlockInputs
    labels: list[int]  # the target's tokens at block slots 1..m


class OnlineAdapter:
    """Adapts a :class:`runtime.backends.pytorch.TorchDFlashDrafter`'s module in place (module docstring).

    Raises:
        ImportError: ``mode="lora"`` without the ``peft`` package (``pip install peft``).
    """

    @classmethod
    def for_drafter(cls, drafter, config: AdaptConfig) -> "OnlineAdapter":
        """An adapter for a torch-backend engine's drafter (``SpecEngine(..., online_adapt=config)``): the drafter
        runs on the eager attention (gradients flow through it) and records each round's block inputs; the engine
        calls :meth:`on_verified` after every round.

        Raises:
            ValueError: another backend or family (the ONNX graphs are frozen; PARD / EAGLE-3 run on ONNX Runtime).
            ImportError: LoRA without ``peft``.
        """
        if not isinstance(drafter, TorchDFlashDrafter):
            raise ValueError("online adaptation runs on the torch backend with a DFlash drafter (--backend torch); "
                             "the ONNX Runtime graphs are frozen")
        drafter.model.attention_impl = AttentionImpl.EAGER
        adapter = cls(drafter, config)
        drafter.record_examples()
        return adapter

    def __init__(self, drafter, config: AdaptConfig):
        self.drafter, self.config = drafter, config
        model = drafter.model
        if config.mode == "lora":
            from peft import LoraConfig, inject_adapter_in_model

            for p in model.parameters():
                p.requires_grad_(False)
            inject_adapter_in_model(LoraConfig(r=config.rank, lora_alpha=2 * config.rank, lora_dropout=0.0,
                                               target_modules=list(LORA_TARGETS)), model)
            params = [p for n, p in model.named_parameters() if "lora_" in n]
            for p in params:
                p.requires_grad_(True)
        else:
            params = list(model.parameters())
            for p in params:
                p.requires_grad_(True)
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        self.pending: list[_Example] = []
        self.steps = 0
        self.rounds = 0  # rounds in which the drafter drafted
        self.losses: list[float] = []

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    def record(self, example: _Example) -> None:
        """Queue one row's round; a gradient step runs every ``interval`` recorded rounds' worth of rows."""
        if example.labels:
            self.pending.append(example)

    def on_verified(self, emitted: list[list[int]]) -> None:
        """The engine's post-verify callback: ``emitted`` holds, per row the drafter drafted this round (in its
        call order), the tokens the target emitted; each becomes that row's labels (up to the drafter's K)."""
        if not emitted:
            return
        for inputs, tokens in zip(self.drafter.take_examples(), emitted):
            self.record(_Example(inputs, list(tokens[: self.drafter.num_draft_tokens])))
        self.rounds += 1
        self.maybe_step(self.rounds)

    def maybe_step(self, rounds: int) -> float | None:
        """Run a step when ``rounds`` (the engine's round counter) reaches the interval. Returns the loss."""
        if not self.pending or rounds % self.config.interval:
            return None
        return self.learn(self.pending)

    def learn(self, examples: list[_Example]) -> float:
        """One AdamW step on ``examples`` (mean cross-entropy over every labelled slot). Returns the loss."""
        d = self.drafter
        model = d.model
        model.train()
        losses = []
        for ex in examples:
            x = ex.inputs
            emb = model.embed_block(x.block_ids[None], d.embed_weight)
            keys = x.past_kv[0][0].shape[2] + x.position_ids.shape[0]
            h, _ = model(emb, x.target_hidden[None], x.position_ids[None], x.past_kv, profile=d.profile,
                         key_mask=torch.ones(1, keys, dtype=torch.long, device=d.device))
            m = len(ex.labels)
            logits = h[0, 1:1 + m] @ d.lm_head_weight.T
            losses.append(F.cross_entropy(logits.float(), torch.tensor(ex.labels, device=d.device)))
        loss = torch.stack(losses).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        model.eval()
        self.pending = []
        self.steps += 1
        value = float(loss.detach())
        self.losses.append(value)
        return value

    def stats(self) -> dict[str, Any]:
        state_bytes = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                          for t in s.values() if torch.is_tensor(t))
        return {"mode": self.config.mode, "rank": self.config.rank if self.config.mode == "lora" else None,
                "lr": self.config.lr, "interval": self.config.interval,
                "trainable_parameters": self.trainable_parameters, "steps": self.steps,
                "mean_loss_last_10": sum(self.losses[-10:]) / len(self.losses[-10:]) if self.losses else None,
                "optimizer_state_bytes": state_bytes,
                "adapter_bytes": sum(p.numel() * p.element_size() for p in self.params)
                if self.config.mode == "lora" else 0}
