"""What every family's calibration runner shares (``sharpdraft-calibrate``, export/calibrate.py), family-neutral: the
N sampled per grid point, the attention-score recorder, the target pass, and the runner for causal drafters (row p
sees N = p + 1 keys). Each family's runner lives in export/families/<family>/calibrate.py: it prepares a document
once, then runs the drafter at grid points with an optional profile, returning per grid point (scores per layer,
proxy accepted lengths, slot-1 agreement).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from plugins.rule import QueryScaleProfile
from runtime.models import attention_probe

TOP_K = QueryScaleProfile().top_k
ROWS_PER_N = 16  # anchors (DFlash) or query rows (causal) per document and grid point


def row_keys(n: int) -> list[int]:
    """The N of the ``ROWS_PER_N`` samples taken for grid point ``n``: n, n - step, ... with step = max(1, n // 256)
    (a spread of at most ~6% of n), those > top_k only."""
    step = max(1, n // 256)
    return [n - j * step for j in range(ROWS_PER_N) if n - j * step > TOP_K]


class Recorder:
    """Collects the scores each drafter layer emits during one forward (attention_probe callback)."""

    def __init__(self, layers: list[torch.nn.Module], rows: torch.Tensor | None = None):
        self.index = {id(m): i for i, m in enumerate(layers)}
        self.rows = rows  # causal: the query rows to keep
        self.scores: dict[int, torch.Tensor] = {}

    def __call__(self, module, scores):
        i = self.index.get(id(module))
        if i is None:
            return
        s = scores[0]  # [heads, q, keys]
        if self.rows is not None:
            s = s[:, self.rows]
        self.scores[i] = s.float().clone()


def target_pass(target, ids: torch.Tensor, hidden_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy predictions ``[L]`` int64, features ``[1, L, len(hidden_ids) * hidden]`` f32 = hidden_states[i], or
    None without ``hidden_ids``)."""
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=bool(hidden_ids), use_cache=False)
    feats = torch.cat([out.hidden_states[i] for i in hidden_ids], dim=-1) if hidden_ids else None
    return out.logits[0].argmax(-1), feats


class CausalRunner:
    """PARD and EAGLE-3: one causal pass over the document; row p sees N = p + 1 keys. Subclasses say which
    attentions to probe, what the target pass taps, and how the drafter forward turns rows into drafted ids."""

    shift = 0  # rows the drafter's inputs are shifted by (EAGLE-3 reads token p + 1 at row p)
    windows: list = []  # every layer full attention
    fit_layers = None  # every probed layer is fitted

    def __init__(self, drafter, target):
        self.d, self.target = drafter, target
        self.embed = target.get_input_embeddings().weight
        self.layers = self._layers()

    def _layers(self) -> list:
        raise NotImplementedError

    def _taps(self) -> list[int]:
        return []

    def _draft(self, doc: dict, rows: list[int], L: int, profile: QueryScaleProfile | None):
        """(drafted ids, the target's ids they must equal) for ``rows``."""
        raise NotImplementedError

    def prepare(self, ids: list[int]) -> dict:
        t = torch.tensor(ids, dtype=torch.long)
        pred, feats = target_pass(self.target, t, self._taps())
        return {"ids": t, "pred": pred, "feats": feats}

    def run(self, doc: dict, n_values: list[int], profile: QueryScaleProfile | None):
        length = len(doc["ids"]) - self.shift
        rows_of = {n: [nk - 1 for nk in row_keys(n) if nk - 1 < length - 1] for n in n_values}
        rows = sorted({r for rs in rows_of.values() for r in rs})
        if not rows:
            return [(defaultdict(list), [], []) for _ in n_values]
        L = rows[-1] + 1
        rec = Recorder(self.layers, torch.tensor(rows))
        with torch.no_grad(), attention_probe.record(rec):
            drafted, truth = self._draft(doc, rows, L, profile)
        hit = {r: int(drafted[i] == truth[i]) for i, r in enumerate(rows)}
        pos = {r: i for i, r in enumerate(rows)}
        out = []
        for n in n_values:
            scores = defaultdict(list)
            for i, sc in rec.scores.items():  # [heads, rows, keys]
                for r in rows_of[n]:
                    scores[i].append(sc[:, pos[r], : r + 1])
            out.append((scores, [1 + hit[r] for r in rows_of[n]], [hit[r] for r in rows_of[n]]))
        return out
