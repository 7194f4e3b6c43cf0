"""Teacher-forced acceptance metrics shared by the recipes: the proxy of the accepted length a draft-verify round
gets (the bonus token included, as runtime/metrics.py defines MAL)."""
from __future__ import annotations

import torch


def accept_len(correct: torch.Tensor) -> torch.Tensor:
    """Teacher-forced proxy of accepted length per block: 1 + leading run of correct draft slots.

    ``correct`` bool ``[A, slots]`` (one row per block / anchor) -> int64 ``[A]``.
    """
    return 1 + correct.long().cumprod(-1).sum(-1)


def chain_accept(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Proxy accepted length per anchor of a chain drafter (1 + leading run of correct steps) over the anchors where
    every step is valid. ``correct``, ``valid`` bool ``[steps, T]`` (step-major, as EAGLE-3's TTT) -> ``[anchors]``."""
    full = valid.all(0)
    return 1 + correct[:, full].long().cumprod(0).sum(0)
