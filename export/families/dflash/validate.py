"""The DFlash drafter graph against the torch drafter, and the fused drafter graph (``--fused-attention``) against
the portable one, within export/checks.py's bound."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export import checks
from export.checks import DRAFTER_ATOL, DRAFTER_RTOL, ROPE_ULP, ValidationError, drafter_bound, max_abs_diff, within
from plugins.rule import QueryScaleProfile
from plugins.rule import beta_torch
from runtime.models.dflash import DFlashDrafter
from runtime.ragged import dflash_block

@torch.no_grad()
def validate_drafter(drafter: DFlashDrafter, path: Path, io: dict, profile: QueryScaleProfile,
                     embed: torch.Tensor, lm_head: torch.Tensor, seed: int = 0) -> dict:
    """Check the drafter graph against the torch drafter run with beta(N) from plugins/rule.py.

    Points: one row at N = 100, ref, 4 ref, 20 ref; then a ragged batch of two rows (right-padded cache, masked)
    with N = 4 ref and ref - 1 in the same call, each compared with its own solo torch run: the beta subgraph
    must read N per row from ``attention_mask``. A static-KV graph (``io["kv_io"] == "static"``) is fed past
    buffers with 5 spare slots of noise behind each row's cache (masked, as the runtime's spare capacity) and its
    new context K/V are checked too.

    Returns:
        ``{"atol", "rtol", "points": [{num_keys, beta, max_abs_diff_logits, beta_effect_on_logits, bound}],
        "ragged": [...same per row...]}``.
    Raises:
        ValidationError: a point exceeds :func:`drafter_bound`.
    """
    cfg = drafter.config
    g = torch.Generator().manual_seed(seed)
    sess = checks.session(path)
    blk, ctx = cfg.block_size, 3
    f = len(cfg.target_layer_ids) * cfg.hidden_size
    past_names = [n for n in io["inputs"] if n.startswith("past_")]
    static = io.get("kv_io") == "static"
    spare = 5 if static else 0
    kv_diffs, kv_scale = [], []

    def case(n_keys: int):
        past_len = n_keys - ctx - blk  # N = s + B with s = past_len + ctx
        past = [torch.randn(1, cfg.num_key_value_heads, past_len, cfg.head_dim, generator=g)
                for _ in range(2 * cfg.num_hidden_layers)]
        ids = torch.full((1, blk), cfg.mask_token_id)
        ids[0, 0] = int(torch.randint(0, cfg.vocab_size if cfg.vocab_size else 1, (1,), generator=g))
        th = torch.randn(1, ctx, f, generator=g) * 3
        pos = torch.arange(past_len, past_len + ctx + blk)[None]
        b = beta_torch(n_keys, profile)
        pkv = [(past[2 * i], past[2 * i + 1]) for i in range(cfg.num_hidden_layers)]
        emb = drafter.embed_block(ids, embed)
        if cfg.sliding:  # beta per layer and row, from each layer's own mask
            h, new_kv = drafter(emb, th, pos, pkv, profile=profile, new_kv_only=True,
                                key_mask=torch.ones(1, n_keys, dtype=torch.long))
        else:
            h, new_kv = drafter(emb, th, pos, pkv, query_scale=b, new_kv_only=True)
        frozen_h, _ = drafter(emb, th, pos, pkv, query_scale=None)
        ref = (h[:, 1:] @ lm_head.T).numpy()
        ref_frozen = (frozen_h[:, 1:] @ lm_head.T).numpy()
        effect = float(np.abs(ref - ref_frozen).max())
        return {"past": past, "ids": ids, "th": th, "pos": pos, "beta": float(b), "ref": ref, "effect": effect,
                "ref_frozen": ref_frozen, "new_kv": [t.numpy() for pair in new_kv for t in pair]}

    has_switch = "query_scale_enabled" in io["inputs"]

    def run(cases: list[dict], switch: list[float] | None = None) -> np.ndarray:
        """One ORT call over the cases as a batch, caches right-padded to the longest and masked."""
        lens = [c["past"][0].shape[2] for c in cases]
        l_max = max(lens) + spare
        feed = {"input_ids": np.concatenate([c["ids"].numpy() for c in cases]),
                "target_hidden": np.concatenate([c["th"].numpy() for c in cases]),
                "position_ids": np.concatenate([c["pos"].numpy() for c in cases]),
                "embed_weight": embed.numpy()}
        if "lm_head_weight" in io["inputs"]:  # else the graph stores its own head (speculators format)
            feed["lm_head_weight"] = lm_head.numpy()
        if "draft_slots" in io["inputs"]:  # every slot: the reference returns logits for all B - 1
            feed["draft_slots"] = np.arange(1, blk, dtype=np.int64)
        _, mask = dflash_block(lens, [ctx] * len(cases), l_max, blk)
        feed["attention_mask"] = mask
        if has_switch:
            feed["query_scale_enabled"] = np.asarray(switch or [1.0] * len(cases), np.float32)
        for j, name in enumerate(past_names):
            buf = np.zeros((len(cases), cfg.num_key_value_heads, l_max, cfg.head_dim), np.float32)
            if static:  # spare capacity holds stale values at run time: noise, which the mask must hide
                buf[:] = torch.randn(buf.shape, generator=g).numpy() * 5
            for r, c in enumerate(cases):
                buf[r, :, : lens[r]] = c["past"][j][0].numpy()
            feed[name] = buf
        logits, *kv = sess.run(io["outputs"], feed)
        if static:  # new context K/V: the same for every row layout
            for r, c in enumerate(cases):
                kv_diffs.append(max(max_abs_diff(o[r], ref[0], f"drafter graph {path} {name}")
                                    for name, o, ref in zip(io["outputs"][1:], kv, c["new_kv"])))
                kv_scale.append(max(float(np.abs(ref).max()) for ref in c["new_kv"]))
        return logits

    def check(c: dict, logits: np.ndarray, n_keys: int) -> dict:
        diff = max_abs_diff(logits, c["ref"][0], f"drafter graph {path} logits at N={n_keys}")
        bound = drafter_bound(c["ref"], n_keys)
        if not within(diff, bound):
            raise ValidationError(f"drafter graph {path} disagrees with the torch drafter at N={n_keys} "
                                  f"(beta {c['beta']:.6f}): max abs logit diff {diff:.3g} > {bound:.3g}")
        return {"num_keys": n_keys, "beta": c["beta"], "max_abs_diff_logits": diff,
                "beta_effect_on_logits": c["effect"], "bound": bound}

    points = []
    for n_keys in sorted({100, profile.ref_keys, 4 * profile.ref_keys, 20 * profile.ref_keys}):
        c = case(n_keys)
        points.append(check(c, run([c])[0], n_keys))
    pair = [4 * profile.ref_keys, max(profile.ref_keys - 1, ctx + blk + 1)]  # a wrong N would give row 2 beta(4 ref)
    cases = [case(n) for n in pair]
    logits = run(cases)
    ragged = [check(c, logits[r], n) for r, (c, n) in enumerate(zip(cases, pair))]
    out = {"atol": DRAFTER_ATOL, "rtol": DRAFTER_RTOL, "points": points, "ragged": ragged,
           "kv_io": io.get("kv_io", "concat")}
    if static:
        # the logits' form without the sum over keys (fp32 reassociation grows with the values' magnitude), plus
        # the rotary term (ROPE_ULP): keys at position 40,960 differed by 5.7e-3 (magnitude ~4.5) in
        # scripts/bench_scale.py, the demo drafter's by 4.7e-3 at 40,000 and 3e-6 at 10 (values: 2e-5)
        top = 20 * profile.ref_keys
        out["max_abs_diff_new_kv"] = max(kv_diffs)
        out["new_kv_bound"] = DRAFTER_ATOL + max(kv_scale) * (DRAFTER_RTOL + top * ROPE_ULP)
        if not within(out["max_abs_diff_new_kv"], out["new_kv_bound"]):
            raise ValidationError(f"drafter graph {path}: new context K/V differ from the torch drafter's by "
                                  f"{out['max_abs_diff_new_kv']:.3g} > {out['new_kv_bound']:.3g}")
    if has_switch:  # rows with the scale switched off must equal the frozen drafter (beta = 1) at any N
        n_keys = 4 * profile.ref_keys
        c = case(n_keys)
        frozen = {**c, "ref": c["ref_frozen"], "beta": 1.0}
        logits = run([c, c], switch=[0.0, 1.0])
        out["switched_off"] = check(frozen, logits[0], n_keys)
        check(c, logits[1], n_keys)
    return out


def validate_fused_drafter(fused: Path, portable: Path, io: dict, cfg, profile: QueryScaleProfile,
                           embed: np.ndarray, lm_head: np.ndarray, seed: int = 0) -> dict:
    """Check the fused drafter graph (``sharpdraft::QueryScaledAttention`` nodes, export/fuse.py) against the
    portable one (beta subgraph + ``Mul`` on Q, already validated against torch) on identical inputs.

    The fused node runs as an ONNX Runtime Python op calling the torch reference (plugins/ort_op.py). Calls: one row
    at N = 100 and one at N = 4 ref, then one ragged batch with rows at N = 4 ref and ref - 1 (row 2's cache is
    right-padded: a hole in its key mask). ``beta_effect_on_logits`` (portable graph with the scale on vs off) shows
    that the comparison would see a wrong beta.

    Returns:
        ``{"atol", "rtol", "points": [{num_keys, max_abs_diff_logits, beta_effect_on_logits, bound}]}``.
    Raises:
        ValidationError: a point exceeds :func:`drafter_bound`.
        ImportError: onnxruntime-extensions is not installed.
    """
    from plugins.ort_op import session as fused_session

    rng = np.random.default_rng(seed)
    sess_fused, sess_port = fused_session(fused), checks.session(portable)
    blk, ctx = cfg.block_size, 3
    f = len(cfg.target_layer_ids) * cfg.hidden_size
    past_names = [n for n in io["inputs"] if n.startswith("past_")]
    fused_inputs = {i.name for i in sess_fused.get_inputs()}

    def feed(n_keys: list[int]) -> dict:
        lens = [n - ctx - blk for n in n_keys]
        l_max, b = max(lens), len(n_keys)
        ids = np.full((b, blk), cfg.mask_token_id, np.int64)
        ids[:, 0] = rng.integers(0, cfg.vocab_size, b)
        pos, mask = dflash_block(lens, [ctx] * b, l_max, blk)
        out = {"input_ids": ids, "target_hidden": rng.standard_normal((b, ctx, f), np.float32) * 3,
               "position_ids": pos, "attention_mask": mask, "embed_weight": embed, "lm_head_weight": lm_head,
               "draft_slots": np.arange(1, blk, dtype=np.int64)}
        for name in past_names:
            buf = rng.standard_normal((b, cfg.num_key_value_heads, l_max, cfg.head_dim), np.float32)
            out[name] = buf * mask[:, None, :l_max, None].astype(np.float32)
        return out

    points = []
    for n_keys in ([100], [4 * profile.ref_keys], [4 * profile.ref_keys, max(profile.ref_keys - 1, ctx + blk + 1)]):
        x = feed(n_keys)
        port_in = {k: v for k, v in x.items()}
        has_switch = "query_scale_enabled" in io["inputs"]
        if has_switch:
            port_in["query_scale_enabled"] = np.ones(len(n_keys), np.float32)
        (want,) = sess_port.run(["logits"], port_in)
        (got,) = sess_fused.run(["logits"], {k: v for k, v in x.items() if k in fused_inputs})
        effect = None
        if has_switch:
            (frozen,) = sess_port.run(["logits"], {**port_in, "query_scale_enabled": np.zeros(len(n_keys), np.float32)})
            effect = float(np.abs(want - frozen).max())
        diff = max_abs_diff(got, want, f"fused drafter graph {fused} logits at N={n_keys}")
        bound = drafter_bound(want, n_keys)
        if not within(diff, bound):
            raise ValidationError(f"fused drafter graph {fused} disagrees with the portable graph at N={n_keys}: "
                                  f"max abs logit diff {diff:.3g} > {bound:.3g}")
        points.append({"num_keys": n_keys, "max_abs_diff_logits": diff, "beta_effect_on_logits": effect,
                       "bound": bound})
    return {"atol": DRAFTER_ATOL, "rtol": DRAFTER_RTOL, "points": points}
