"""Validate exported graphs: ONNX Runtime output vs the torch modules they came from.

The drafter is checked at several visible-key counts N (below, at and far above ref_keys) against the torch drafter
run with beta(N) from plugins/rule.py: this is what proves beta is computed in-graph from the KV length (a constant
folded at export would match at most one N).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from plugins.rule import QueryScaleProfile, beta_torch
from runtime.models.dflash import DFlashDrafter
from runtime.ragged import dflash_block

TARGET_ATOL = 2e-3  # fp32 logits, 30 layers: ORT vs torch differ by reassociation only (measured ~1e-4)
DRAFTER_ATOL = 2e-3
# Softmax over up to 20 * ref_keys keys sums in a different order in ORT and torch: allow an error relative to the
# logit scale too (measured 5e-3 on logits of magnitude ~40 at N = 10,240, i.e. ~1e-4 relative).
DRAFTER_RTOL = 5e-4
# ... and with the number of keys N (a sum over N softmax-weighted values, added in another order: the bound widens as
# sqrt(N / 8192) past 8,192 keys) and with the position, through RoPE: the rotary angle pos * inv_freq is held in fp32,
# one ulp of it is 2^-23 * pos radians, and ORT and torch round it in their own order, so queries and keys at
# position 40,000 rotate up to ~5e-3 rad apart; the bound adds that much of the logits' magnitude. Measured with
# scripts/bench_scale.py (1 B-parameter drafter, hidden 4096): 1.0e-3 at N = 8,192 and 8.9e-3 at N = 40,960, the
# growth of the rotary term; a Qwen3-0.6B-width drafter exceeded the former flat bound (3.65e-3 > 3.64e-3) there.
DRAFTER_KEYS_AT_BASE = 8192
ROPE_ULP = 2.0 ** -23  # relative spacing of fp32: the angle error per radian of pos * inv_freq (inv_freq <= 1)


def drafter_bound(ref: np.ndarray, num_keys) -> float:
    """The validation bound of a drafter graph's logits ``ref`` at ``num_keys`` visible keys (an int, or per-row
    counts: the largest is used; the positions are at most about as large):
    ``DRAFTER_ATOL * s + max|ref| * (DRAFTER_RTOL * s + N * ROPE_ULP)`` with ``s = max(1, sqrt(N / 8192))``."""
    n = max(num_keys) if isinstance(num_keys, (list, tuple)) else int(num_keys)
    s = max(1.0, (n / DRAFTER_KEYS_AT_BASE) ** 0.5)
    return DRAFTER_ATOL * s + float(np.abs(ref).max()) * (DRAFTER_RTOL * s + n * ROPE_ULP)


class ValidationError(ValueError):
    """An exported graph disagrees with its torch source beyond tolerance."""


def max_abs_diff(got, want, what: str) -> float:
    """``max |got - want|`` of a graph output against its reference, refusing values that are not finite.

    ``got`` (the graph's output) and ``want`` (the torch reference) are arrays of one shape (any dtype). An
    infinity in ``got`` is accepted only where ``want`` holds the same infinity (the design puts -inf in logits
    outside the draft vocabulary, for instance); a NaN anywhere, or an inf where the reference is finite, is an
    error naming ``what`` (e.g. ``"drafter graph logits at N=256"``): a ``diff > bound`` test would let a NaN
    through, since every comparison with NaN is false.

    Returns: the largest absolute difference over the finite entries (0.0 for empty arrays).
    Raises:
        ValidationError: NaN in either array, or an inf in ``got`` that ``want`` does not hold at that position
            (the count and the first index named).
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    for arr, side in ((want, "the torch reference"), (got, "the exported graph")):
        nan = np.isnan(arr)
        if nan.any():
            first = tuple(int(i) for i in np.unravel_index(int(nan.argmax()), arr.shape))
            raise ValidationError(f"{what}: {side} holds {int(nan.sum())} NaN values (first at index {first}): a "
                                  "non-finite weight or table in the checkpoint, or an overflow; fix the weights")
    same_inf = np.isinf(want) & (got == want)
    bad = np.isinf(got) & ~same_inf
    if bad.any():
        first = tuple(int(i) for i in np.unravel_index(int(bad.argmax()), got.shape))
        raise ValidationError(f"{what}: the exported graph holds {int(bad.sum())} infinite values where the torch "
                              f"reference is finite (first at index {first}): an overflow or a non-finite weight")
    if not got.size:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(same_inf, 0.0, got - want))
    return float(diff.max())  # inf where the reference is infinite and the graph is not: fails any bound


def within(diff: float, bound: float) -> bool:
    """``diff <= bound`` (False for a NaN ``diff``: a check must fail on it, never pass by a false ``>``)."""
    return bool(diff <= bound)


def _session(path: Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _dims(cfg) -> dict:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"num_layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": hd,
            "hidden_size": cfg.hidden_size}


@torch.no_grad()
def target_reference(model, tap_ids: list[int], static: bool, seed: int = 0) -> dict:
    """The torch half of :func:`validate_target`, computed while the torch target is loaded so that it can be
    released before ONNX Runtime loads the graph (export holds one model at a time).

    Two steps through transformers' own forward (``TargetForExport``): an 11-token prefill, then a 4-token block
    verified with the cache. Each step keeps its feed (``input_ids`` / ``position_ids`` / ``attention_mask``
    int64, past buffers float32 ``[1, kv_heads, past + spare, head_dim]``) and the expected logits
    ``[1, q, vocab]``, taps ``[1, q, len(tap_ids) * hidden]`` and new K/V. ``static``: the buffers carry 5 spare
    slots of noise behind the cached positions, masked out as the runtime masks them (static-KV graphs).

    Returns ``{"static", "steps": [...]}`` (a few MB: the logits of 15 positions dominate).
    """
    from export.graphs import TargetForExport

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    wrap = TargetForExport(model, tap_ids).eval()
    spare = 5 if static else 0
    hd = _dims(cfg)["head_dim"]
    past = [torch.zeros(1, cfg.num_key_value_heads, 0, hd) for _ in range(2 * cfg.num_hidden_layers)]
    steps, start = [], 0
    for q in (11, 4):
        ids = torch.randint(0, cfg.vocab_size, (1, q), generator=g)
        pos = torch.arange(start, start + q)[None]
        am = torch.ones(1, start + q, dtype=torch.int64)
        ref_logits, ref_taps, present = wrap(ids, pos, am, past)
        buffers = [torch.cat([t, torch.randn(*t.shape[:2], spare, hd, generator=g)], 2) for t in past]
        mask = torch.cat([am[:, :start], torch.zeros(1, spare, dtype=torch.int64), am[:, start:]], 1)
        new_kv = [t[:, :, start:] for t in present] if static else present
        steps.append({"feed": {"input_ids": ids.numpy(), "position_ids": pos.numpy(), "attention_mask": mask.numpy()},
                      "buffers": [t.float().numpy() for t in buffers], "logits": ref_logits.float().numpy(),
                      "taps": ref_taps.float().numpy(), "kv": [t.float().numpy() for t in new_kv]})
        past, start = list(present), start + q
    return {"static": static, "steps": steps}


def check_target(reference: dict, path: Path, io: dict) -> dict:
    """The ONNX Runtime half of :func:`validate_target`: run the graph at ``path`` on ``reference``'s feeds
    (:func:`target_reference`) and compare logits, taps and new K/V. Returns max diffs.

    Raises:
        ValidationError: a difference above ``TARGET_ATOL``.
    """
    sess = _session(path)
    diffs = {"logits": 0.0, "taps": 0.0, "kv": 0.0}
    for step in reference["steps"]:
        feed = dict(step["feed"])
        feed.update(dict(zip(io["inputs"][3:], step["buffers"])))
        logits, taps, *kv = sess.run(io["outputs"], feed)
        diffs["logits"] = max(diffs["logits"], max_abs_diff(logits, step["logits"], f"target graph {path} logits"))
        if taps.size:  # a drafter that reads no target features (PARD) exports taps of width 0
            diffs["taps"] = max(diffs["taps"], max_abs_diff(taps, step["taps"], f"target graph {path} taps")
                                / float(np.abs(step["taps"]).max()))
        diffs["kv"] = max(diffs["kv"], max(max_abs_diff(a, b, f"target graph {path} {name}")
                                           for name, a, b in zip(io["outputs"][2:], kv, step["kv"])))
    if not within(max(diffs.values()), TARGET_ATOL):
        raise ValidationError(f"target graph {path} disagrees with torch: {diffs} (tolerance {TARGET_ATOL})")
    return {"max_abs_diff_logits": diffs["logits"], "max_rel_diff_taps": diffs["taps"],
            "max_abs_diff_kv": diffs["kv"], "kv_io": io.get("kv_io", "concat"), "atol": TARGET_ATOL}


def validate_target(model, tap_ids: list[int], path: Path, io: dict, seed: int = 0) -> dict:
    """Prefill 11 tokens then verify a 4-token block with the cache; compare logits, taps and the new K/V with
    transformers' own forward (``TargetForExport``). Returns max diffs.

    A static-KV graph (``io["kv_io"] == "static"``) is fed past buffers with 5 spare slots of noise behind the
    cached positions, masked out as the runtime masks them, so a mask bug shows up as a logits difference.
    :func:`target_reference` then :func:`check_target` (the export computes the first, frees the torch target, then
    runs the second).

    Raises:
        ValidationError: a difference above ``TARGET_ATOL``.
    """
    return check_target(target_reference(model, tap_ids, io.get("kv_io") == "static", seed), path, io)


SHARED_ATOL = 1e-3  # quantized graph vs itself (cached vs one pass, after a rollback): same kernels
MIN_TOP1_AGREEMENT = 0.5  # int4 / int8 vs fp32 on real text: another model, but not a broken one
MIN_TAP_COSINE = 0.9
VALIDATION_TEXT = ("The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four papers that "
                   "changed physics: on the photoelectric effect, Brownian motion, special relativity and the "
                   "equivalence of mass and energy.\ndef add(a, b):\n    return a + b\n")


@torch.no_grad()
def shared_target_reference(model, tokenizer) -> dict:
    """The torch half of :func:`validate_shared_target`: ``VALIDATION_TEXT``'s ids ``[1, n]`` int64, the fp32 torch
    target's argmax per position ``[n]`` and every hidden state (``hidden_states[i]`` float32 ``[n, hidden]``,
    i = 0 the embeddings), with the KV dimensions of the config. Computed before the graph is built, so the torch
    target is released before ONNX Runtime GenAI's builder and ONNX Runtime load theirs."""
    ids = np.asarray(tokenizer.encode(VALIDATION_TEXT), np.int64)[None]
    out = model(input_ids=torch.from_numpy(ids), output_hidden_states=True)
    return {"ids": ids, "argmax": out.logits[0].argmax(-1).numpy(),
            "hidden_states": [h[0].float().numpy() for h in out.hidden_states], **_dims(model.config)}


def validate_shared_target(model, tap_ids: list[int], path: Path, io: dict, tokenizer, seed: int = 0) -> dict:
    """Check a quantized builder graph (kv_io "shared", export/genai_target.py) against ``model`` (the fp32
    torch target): :func:`shared_target_reference` then :func:`check_shared_target`, which documents the checks,
    the result and the raised ValidationError."""
    return check_shared_target(shared_target_reference(model, tokenizer), tap_ids, path, io, seed)


def check_shared_target(reference: dict, tap_ids: list[int], path: Path, io: dict, seed: int = 0) -> dict:
    """Check a quantized builder graph (kv_io "shared", export/genai_target.py) before it is shipped.

    1. Against itself: a prefill of n - 4 tokens then a cached 4-token verify block in one shared buffer (noise in
       the spare slots behind) must equal one pass over all n tokens; then, rolled back to n - 4 cached positions
       (a length change, the stale slots left in place), another 4-token block must equal one pass over its
       tokens: the KV writes, the positions and the rollback contract the runtime relies on.
    2. Against the fp32 torch target on real text (``reference``: :func:`shared_target_reference`): the share of
       positions whose argmax agrees (a quantized target is another model, so this is a sanity floor,
       ``MIN_TOP1_AGREEMENT``), and per tap the cosine similarity with the transformers hidden state it must equal
       (``hidden_states[id + 1]``), which must beat both neighbouring layers' (an off-by-one tap fails here).

    Returns:
        ``{"kv_io", "precision", "max_abs_diff_cached_vs_full", "max_abs_diff_after_rollback", "top1_agreement_fp32",
        "tap_cosine": [...], "tap_cosine_neighbours": [[prev, next], ...], "atol"}``.
    Raises:
        ValidationError: any check above fails.
    """
    from runtime.ort_engines import run_shared

    sess = _session(path)
    n_layers, kvh, hd = reference["num_layers"], reference["kv_heads"], reference["head_dim"]
    past = [n for n in io["inputs"] if n.startswith("past")]
    present = [n for n in io["outputs"] if n.startswith("present")]
    taps_out = io.get("taps_output")
    ids = reference["ids"]
    n = ids.shape[1]
    rng = np.random.default_rng(seed)

    kv_dtype = np.float16 if sess.get_inputs()[io["inputs"].index(past[0])].type == "tensor(float16)" else np.float32

    def buffers(batch: int, cap: int, noise: bool) -> list[np.ndarray]:
        return [rng.standard_normal((batch, kvh, cap, hd)).astype(kv_dtype) if noise else
                np.zeros((batch, kvh, cap, hd), kv_dtype) for _ in range(2 * n_layers)]

    def call(x, lengths, bufs):
        mask = np.zeros((x.shape[0], max(lengths)), np.int64)
        for r, length in enumerate(lengths):
            mask[r, :length] = 1
        return run_shared(sess, x, mask, bufs, past, present, taps_out)

    full, full_taps = call(ids, [n], buffers(1, n + 5, False))
    bufs = buffers(1, n + 5, True)
    first, _ = call(ids[:, : n - 4], [n - 4], bufs)
    block, _ = call(ids[:, n - 4:], [n], bufs)
    what = f"quantized target graph {path} logits"
    for name, out in (("one pass", full), ("prefill", first), ("verify block", block)):
        max_abs_diff(out, np.zeros_like(out), f"{what} ({name})")  # finite everywhere
    if full_taps is not None and full_taps.size:
        max_abs_diff(full_taps, np.zeros_like(full_taps), f"quantized target graph {path} taps")
    cached = max(max_abs_diff(first, full[:, : n - 4], f"{what} (cached prefill)"),
                 max_abs_diff(block, full[:, n - 4:], f"{what} (cached verify block)"))
    # rollback: back to n - 4 cached positions (a length change) and another 4-token block over the stale slots
    other = ids[:, n - 4:][:, ::-1].copy()
    ref, _ = call(np.concatenate([ids[:, : n - 4], other], 1), [n], buffers(1, n, False))
    again, _ = call(other, [n], bufs)
    rollback = max_abs_diff(again, ref[:, n - 4:], f"{what} (after a rollback)")
    # against fp32 torch
    agree = float((reference["argmax"] == full[0].argmax(-1)).mean())
    hidden_states = reference["hidden_states"]
    cos, neigh = [], []
    if taps_out:
        width = reference["hidden_size"]
        for j, t in enumerate(tap_ids):
            seg = torch.from_numpy(full_taps[0, :, j * width: (j + 1) * width].astype(np.float32))

            def c(layer: int) -> float:
                if not 0 <= layer < len(hidden_states):
                    return -1.0
                ref = torch.from_numpy(hidden_states[layer])
                return float(torch.nn.functional.cosine_similarity(seg, ref, dim=-1).mean())

            cos.append(c(t + 1))
            neigh.append([c(t), c(t + 2)])
    result = {"kv_io": "shared", "precision": io.get("precision"), "max_abs_diff_cached_vs_full": cached,
              "max_abs_diff_after_rollback": rollback, "top1_agreement_fp32": agree, "tap_cosine": cos,
              "tap_cosine_neighbours": neigh, "atol": SHARED_ATOL, "text_tokens": n}
    problems = []
    if not within(cached, SHARED_ATOL):
        problems.append(f"cached verify block differs from one pass by {cached:.3g}")
    if not within(rollback, SHARED_ATOL):
        problems.append(f"a block verified after a rollback differs from one pass by {rollback:.3g}")
    if not agree >= MIN_TOP1_AGREEMENT:
        problems.append(f"argmax agrees with the fp32 target at {agree:.0%} of positions only")
    for t, cs, (a, b) in zip(tap_ids, cos, neigh):
        if not (cs >= MIN_TAP_COSINE and cs > max(a, b)):  # written so that a NaN cosine fails
            problems.append(f"tap of layer {t}: cosine {cs:.3f} with hidden_states[{t + 1}], neighbours {a:.3f} / "
                            f"{b:.3f} (wrong layer tapped?)")
    if problems:
        raise ValidationError(f"quantized target graph {path}: " + "; ".join(problems))
    return result


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
    sess = _session(path)
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
    sess_fused, sess_port = fused_session(fused), _session(portable)
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
    sess = _session(path)
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
    sess = _session(path)
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
