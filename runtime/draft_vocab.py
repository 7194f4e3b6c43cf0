"""Reduced draft vocabulary for drafters that borrow the target's LM head (DFlash).

On a CPU the drafter's LM head, ``[block - 1, hidden] x [hidden, vocab]`` over the target's whole vocabulary
(49,152 rows for SmolLM2), is most of a draft call: its weight is read once per call. A draft vocabulary keeps only
the rows of the tokens the target actually emits (as EAGLE-3's ``d2t`` does for its own head): the drafter scores
those V tokens, and :func:`expand_logits` puts them back at their target ids with -inf elsewhere. A draft
distribution that is zero outside the draft vocabulary is still a distribution over the target's vocabulary, so
greedy verification and rejection sampling stay exact; only tokens outside it can never be drafted.

File format (``draft_vocab.json`` in a drafter checkpoint folder, copied into the engines folder by
sharpdraft-export): ``{"draft_ids": [target ids, most frequent first], "source": "how it was made"}``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DRAFT_VOCAB_FILE = "draft_vocab.json"


class DraftVocabError(ValueError):
    """A draft vocabulary file is malformed or does not fit the target; the message says what to do."""


def load_draft_vocab(path: str | Path, vocab_size: int) -> np.ndarray:
    """Read a ``draft_vocab.json`` file.

    Args:
        path: the file.
        vocab_size: the target's vocabulary size.
    Returns:
        int64 ``[V]`` target token ids, unique, each in ``[0, vocab_size)``.
    Raises:
        DraftVocabError: unreadable, empty, duplicate or out-of-range ids.
    """
    path = Path(path)
    try:
        ids = np.asarray(json.loads(path.read_text())["draft_ids"], np.int64)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DraftVocabError(f"{path}: not a draft vocabulary file ({e}); expected "
                              '{"draft_ids": [token ids]}; delete it to draft over the whole vocabulary') from e
    if ids.ndim != 1 or ids.size == 0:
        raise DraftVocabError(f"{path}: draft_ids must be a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise DraftVocabError(f"{path}: token ids must lie in [0, {vocab_size}) (the target's vocabulary); "
                              f"found {int(ids.min())} .. {int(ids.max())}")
    if np.unique(ids).size != ids.size:
        raise DraftVocabError(f"{path}: draft_ids holds duplicates")
    return ids


def write_draft_vocab(path: str | Path, counts: np.ndarray, size: int, source: str) -> np.ndarray:
    """Write the ``size`` most frequent token ids of ``counts`` (``[vocab]`` int, e.g. the target's argmax labels
    over training data; ties broken by lower id) to ``path``. Tokens never counted are not included, so the file
    may hold fewer than ``size`` ids. Returns the ids written."""
    counts = np.asarray(counts)
    order = np.lexsort((np.arange(counts.size), -counts))
    ids = order[: size][counts[order[: size]] > 0]
    Path(path).write_text(json.dumps({"draft_ids": ids.tolist(), "source": source,
                                      "coverage_of_counts": float(counts[ids].sum() / max(counts.sum(), 1))}) + "\n")
    return ids


def expand_logits(logits: np.ndarray, draft_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Scatter draft-vocabulary logits ``[..., V]`` f32 to the target's vocabulary ``[..., vocab_size]`` (-inf at
    ids outside the draft vocabulary)."""
    full = np.full((*logits.shape[:-1], vocab_size), -np.inf, np.float32)
    full[..., draft_ids] = logits
    return full
