"""The PARD drafter graph against the torch drafter with per-row beta (export/checks.py's bound)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export import checks
from export.checks import DRAFTER_ATOL, DRAFTER_RTOL, ValidationError, drafter_bound, max_abs_diff, within
from plugins.rule import QueryScaleProfile


@torch.no_grad()
def validate_pard_drafter(drafter, num_draft_tokens: int, path: Path, io: dict, profile: QueryScaleProfile,
                          embed: torch.Tensor | None, seed: int = 0) -> dict:
    """Check a PARD drafter graph against the torch drafter run with per-row beta (runtime/models/hf_query_scale.py).

    Points: one row whose draft block [last real token, K-1 masks] sees N = past + 1 .. past + K keys, for past
    around 100, ref_keys - K // 2 (the block's rows straddle ref_keys: beta 1 for the first rows, above after) and
    4 ref; then a ragged batch of those rows in one call (right-padded caches and chunks), each row compared with
    its solo torch run; with a switch input, a row switched off equals the frozen drafter.

    Returns:
        ``{"atol", "rtol", "points": [{num_keys: [first, last], max_abs_diff_logits, beta_effect_on_logits,
        bound}], "ragged": [...], "switched_off": {...}}``.
    Raises:
        ValidationError: a point exceeds :func:`drafter_bound`.
    """
    from runtime.models import hf_query_scale as hq

    cfg = drafter.config
    k = num_draft_tokens
    g = torch.Generator().manual_seed(seed)
    sess = checks.session(path)
    past_names = [n for n in io["inputs"] if n.startswith("past_")]
    has_switch = "query_scale_enabled" in io["inputs"]
    kvh = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_real = 3  # committed tokens fed this round, the last one being the bonus token

    def case(past_len: int) -> dict:
        past = [torch.randn(1, kvh, past_len, hd, generator=g) for _ in range(2 * drafter.num_layers)]
        ids = torch.full((1, n_real + k - 1), drafter.pard_token)
        ids[0, :n_real] = torch.randint(0, min(cfg.vocab_size, drafter.pard_token), (n_real,), generator=g)
        pos = torch.arange(past_len, past_len + n_real + k - 1)[None]
        am = torch.ones(1, past_len + n_real + k - 1, dtype=torch.int64)
        run = lambda: drafter(ids, pos, am, past, embed, num_logits=k)[0]  # noqa: E731
        original = drafter.model.config._attn_implementation
        drafter.model.set_attn_implementation(hq.ATTN_IMPLEMENTATION)
        try:
            with hq.query_scale(profile):
                ref = run().numpy()
            with hq.query_scale(None):
                frozen = run().numpy()
        finally:
            drafter.model.set_attn_implementation(original)
        first = past_len + n_real  # N of the last real token's row; the mask rows follow
        return {"past": past, "ids": ids, "pos": pos, "ref": ref, "frozen": frozen, "n": [first, first + k - 1],
                "effect": float(np.abs(ref - frozen).max())}

    def run(cases: list[dict], switch: list[float] | None = None) -> np.ndarray:
        lens = [c["past"][0].shape[2] for c in cases]
        l_max, q = max(lens), n_real + k - 1
        feed = {"input_ids": np.concatenate([c["ids"].numpy() for c in cases]),
                "position_ids": np.concatenate([c["pos"].numpy() for c in cases]),
                "logits_start": np.full(len(cases), n_real - 1, np.int64)}
        mask = np.zeros((len(cases), l_max + q), np.int64)
        for r, n in enumerate(lens):
            mask[r, :n] = 1
            mask[r, l_max:] = 1
        feed["attention_mask"] = mask
        if embed is not None:
            feed["embed_weight"] = embed.numpy()
        if has_switch:
            feed["query_scale_enabled"] = np.asarray(switch or [1.0] * len(cases), np.float32)
        for j, name in enumerate(past_names):
            buf = np.zeros((len(cases), kvh, l_max, hd), np.float32)
            for r, c in enumerate(cases):
                buf[r, :, : lens[r]] = c["past"][j][0].numpy()
            feed[name] = buf
        (logits,) = sess.run(["logits"], feed)
        return logits

    def check(c: dict, logits: np.ndarray, ref_key: str = "ref") -> dict:
        diff = max_abs_diff(logits, c[ref_key][0], f"PARD drafter graph {path} logits at N={c['n']}")
        bound = drafter_bound(c[ref_key], c["n"])
        if not within(diff, bound):
            raise ValidationError(f"PARD drafter graph {path} disagrees with the torch drafter at N={c['n']}: max "
                                  f"abs logit diff {diff:.3g} > {bound:.3g}")
        return {"num_keys": c["n"], "max_abs_diff_logits": diff, "beta_effect_on_logits": c["effect"],
                "bound": bound}

    pasts = sorted({100, max(profile.ref_keys - n_real - k // 2, 1), 4 * profile.ref_keys})
    cases = [case(p) for p in pasts]
    points = [check(c, run([c])[0]) for c in cases]
    logits = run(cases)
    out = {"atol": DRAFTER_ATOL, "rtol": DRAFTER_RTOL, "points": points,
           "ragged": [check(c, logits[r]) for r, c in enumerate(cases)]}
    if has_switch:
        logits = run([cases[-1], cases[-1]], switch=[0.0, 1.0])
        out["switched_off"] = check(cases[-1], logits[0], "frozen")
        check(cases[-1], logits[1])
    return out
