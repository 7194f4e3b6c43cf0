"""The EAGLE-3 step graph against the torch drafter with per-row beta (export/checks.py's bound)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export import checks
from export.checks import DRAFTER_ATOL, DRAFTER_RTOL, ValidationError, drafter_bound, max_abs_diff, within
from plugins.rule import QueryScaleProfile


@torch.no_grad()
def validate_eagle3_drafter(drafter, path: Path, io: dict, profile: QueryScaleProfile, embed: torch.Tensor | None,
                            seed: int = 0) -> dict:
    """Check an EAGLE-3 step graph against the torch drafter run with per-row beta (:func:`row_beta`).

    Points: one block of 5 rows whose queries see N = ref - 2 .. ref + 2, read row by row (the batch holds the block
    5 times with ``logits_start`` 0..4): beta is 1 for the first rows and above after, per row; a block at 4 ref;
    a ragged batch of two blocks with different past lengths (holes in the shorter row's mask); with a switch
    input, a row switched off equals the frozen drafter.

    Returns:
        ``{"atol", "rtol", "rows": [{num_keys, beta, max_abs_diff_logits, frozen_diff}], "points": [...],
        "ragged": [...], "switched_off": {...}}``.
    Raises:
        ValidationError: a row exceeds :func:`drafter_bound` or a graph token is not the
            torch argmax mapped through d2t.
    """
    from runtime.models.eagle3 import row_beta

    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    sess = checks.session(path)
    has_switch = "query_scale_enabled" in io["inputs"]
    q = 5

    def block(past_len: int) -> dict:
        pk, pv = (torch.randn(1, cfg.num_key_value_heads, past_len, cfg.head_dim, generator=g) for _ in range(2))
        ids = torch.randint(0, cfg.vocab_size, (1, q), generator=g)
        hidden = torch.randn(1, q, cfg.hidden_size, generator=g)
        pos = torch.arange(past_len, past_len + q)[None]
        am = torch.ones(1, past_len + q, dtype=torch.int64)
        beta = row_beta(am, q, profile)
        ref, _, _ = drafter(ids, hidden, pos, am, (pk, pv), embed, beta=beta)
        frozen, _, _ = drafter(ids, hidden, pos, am, (pk, pv), embed)
        return {"pk": pk, "pv": pv, "ids": ids, "hidden": hidden, "pos": pos, "ref": ref[0].numpy(),
                "frozen": frozen[0].numpy(), "n": list(range(past_len + 1, past_len + q + 1)),
                "beta": beta[0, 0, :, 0].tolist()}

    def run(blocks: list[dict], rows: list[int], switch: list[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        lens = [bl["pk"].shape[2] for bl in blocks]
        l_max = max(lens)
        feed = {"input_ids": torch.cat([bl["ids"] for bl in blocks]).numpy(),
                "hidden": torch.cat([bl["hidden"] for bl in blocks]).numpy(),
                "position_ids": torch.cat([bl["pos"] for bl in blocks]).numpy(),
                "logits_start": np.asarray(rows, np.int64)}
        mask = np.zeros((len(blocks), l_max + q), np.int64)
        pk = np.zeros((len(blocks), cfg.num_key_value_heads, l_max, cfg.head_dim), np.float32)
        pv = np.zeros_like(pk)
        for r, (bl, n) in enumerate(zip(blocks, lens)):
            mask[r, :n] = 1
            mask[r, l_max:] = 1
            pk[r, :, :n], pv[r, :, :n] = bl["pk"][0].numpy(), bl["pv"][0].numpy()
        feed.update({"attention_mask": mask, "past_key.0": pk, "past_value.0": pv})
        if embed is not None:
            feed["embed_weight"] = embed.numpy()
        if has_switch:
            feed["query_scale_enabled"] = np.asarray(switch or [1.0] * len(blocks), np.float32)
        logits, token = sess.run(["logits", "token"], feed)
        return logits[:, 0], token[:, 0]

    def check(bl: dict, row: int, logits: np.ndarray, token: int, key: str = "ref") -> dict:
        want = bl[key][row]
        diff = max_abs_diff(logits, want, f"EAGLE-3 drafter graph {path} logits at N={bl['n'][row]}")
        bound = drafter_bound(want, bl["n"][row])
        if not within(diff, bound):
            raise ValidationError(f"EAGLE-3 drafter graph {path} disagrees with the torch drafter at N="
                                  f"{bl['n'][row]}: max abs logit diff {diff:.3g} > {bound:.3g}")
        best = int(np.argmax(logits))
        if token != best + int(drafter.d2t[best]):
            raise ValidationError(f"EAGLE-3 drafter graph {path}: token {token} is not draft argmax {best} mapped "
                                  "through d2t")
        return {"num_keys": bl["n"][row], "beta": bl["beta"][row], "max_abs_diff_logits": diff,
                "frozen_diff": float(np.abs(logits - bl["frozen"][row]).max()), "bound": bound}

    straddle = block(profile.ref_keys - 3)  # rows see N = ref - 2 .. ref + 2
    logits, token = run([straddle] * q, list(range(q)))
    out = {"atol": DRAFTER_ATOL, "rtol": DRAFTER_RTOL,
           "rows": [check(straddle, r, logits[r], int(token[r])) for r in range(q)]}
    far = block(4 * profile.ref_keys)
    logits, token = run([far], [q - 1])
    out["points"] = [check(far, q - 1, logits[0], int(token[0]))]
    logits, token = run([far, straddle], [q - 1, q - 1])
    out["ragged"] = [check(far, q - 1, logits[0], int(token[0])), check(straddle, q - 1, logits[1], int(token[1]))]
    if has_switch:
        logits, token = run([far, far], [q - 1, q - 1], switch=[0.0, 1.0])
        out["switched_off"] = check(far, q - 1, logits[0], int(token[0]), "frozen")
        check(far, q - 1, logits[1], int(token[1]))
    return out
