"""How the project times things, in one place: the rotated run order, the median run, the geo-mean of ratios,
one request timed step by step, and the plots' figure and file.

On a shared 2-core machine the speed drifts within a run; every benchmark runs its configurations one after another
on each prompt (or round), in an order that rotates so that none always runs first, on a cold or a warm machine,
and reports ratios per prompt, geo-meaned. ``python -m runtime.generate`` (the demo's medians of rotated runs) and
the benchmarks under scripts/ use these; it lives in runtime/ because runtime.generate does (runtime imports only
plugins/), and it needs nothing but the standard library, the loop and (for plots, imported when drawing)
matplotlib.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Iterable, Sequence, TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` starting ``shift`` places further on (modulo their count): ``rotated("abc", 1) == list("bca")``."""
    items = list(items)
    k = shift % len(items) if items else 0
    return items[k:] + items[:k]


def rotations(configs: Sequence[T], rounds: int) -> list[list[T]]:
    """The run order of each round: round r starts ``r * len(configs) // rounds`` configurations further on (round 0
    is the given order), so over the rounds every configuration runs early and late."""
    n = len(configs)
    return [rotated(configs, r * n // rounds) for r in range(rounds)]


def rotated_runs(runs: dict, repeats: int) -> dict:
    """Run each configuration ``repeats`` times, rotating which goes first each time (base, spec, plain; spec,
    plain, base; ...), so drift of a shared machine falls on all alike.

    Args:
        runs: name -> zero-argument callable returning a result with ``stats.tokens_per_s``.
        repeats: runs per configuration, >= 1.
    Returns:
        name -> the median run by tokens/s (the lower middle one for even ``repeats``), plus ``"all"``: name ->
        every run in the order made.
    """
    names = list(runs)
    done = {n: [] for n in names}
    for r in range(repeats):
        for n in rotated(names, r):
            done[n].append(runs[n]())
    out = {n: sorted(v, key=lambda x: x.stats.tokens_per_s)[(len(v) - 1) // 2] for n, v in done.items()}
    out["all"] = done
    return out


def geomean_ratio(pairs: Iterable[tuple[float, float]]) -> float:
    """The geometric mean of ``a / b`` over ``(a, b)`` pairs (a speedup per prompt, then one figure over them; the
    geo-mean is the mean that treats 2x and 0.5x as cancelling)."""
    return statistics.geometric_mean(a / b for a, b in pairs)


def figure(ncols: int = 2, size: tuple[float, float] = (11, 4)):
    """``(fig, axes)``: a headless (Agg) matplotlib figure with ``ncols`` axes side by side (1: one axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size)


def save_figure(fig, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (PNG, 110 dpi, as every benchmark plot) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_timed(engine, ids: list[int], new_tokens: int, speculative: bool, num_draft_tokens: int | None = None,
              draft_vocab: bool = True) -> dict:
    """One request through ``engine`` step by step; per step the wall time and the time inside ONNX Runtime.

    ``num_draft_tokens``: verify only the first k draft tokens of each block (None: all); ``draft_vocab``: False
    scores the drafter's LM head over the whole vocabulary (A/B of runtime/draft_vocab.py).
    """
    from runtime.sampling import SamplingParams

    graphs = [engine.target] + ([engine.drafter] if engine.drafter is not None else [])
    if hasattr(engine.drafter, "set_draft_vocab"):
        engine.drafter.set_draft_vocab(draft_vocab)
    seq = engine.add_request(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, speculative=speculative,
                                                 num_draft_tokens=num_draft_tokens))
    steps = []
    while engine.has_unfinished:
        ort0, t0 = sum(g.ort_s for g in graphs), time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, sum(g.ort_s for g in graphs) - ort0))
    if hasattr(engine.drafter, "set_draft_vocab"):
        engine.drafter.set_draft_vocab(True)
    (prefill_s, _), decode = steps[0], steps[1:]
    s = seq.stats
    n = len(seq.out)
    decode_s = sum(w for w, _ in decode)
    row = {"token_ids": list(seq.out), "new_tokens": n, "prefill_s": round(prefill_s, 4),
           "decode_s": round(decode_s, 4), "tokens_per_s": round(n / (prefill_s + decode_s), 3),
           "decode_tokens_per_s": round((n - 1) / decode_s, 3) if decode_s else None,
           "steps": len(decode),
           "step_ms_median": round(1000 * statistics.median(w for w, _ in decode), 3),
           "ort_ms_per_step": round(1000 * statistics.median(o for _, o in decode), 3),
           "overhead_ms_per_step": round(1000 * statistics.median(w - o for w, o in decode), 3)}
    if speculative:
        row |= {"mal": round(s.mean_accepted_length, 4), "rounds": s.rounds,
                "acceptance": [round(a, 4) for a in s.acceptance_per_position],
                "draft_ms_per_step": round(1000 * s.draft_s / len(decode), 3),
                "verify_ms_per_step": round(1000 * s.verify_s / len(decode), 3),
                "lookup_rounds": s.lookup_rounds, "lookup_accepted": s.lookup_accepted}
    return row

