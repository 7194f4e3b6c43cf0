"""Validate exported graphs: ONNX Runtime output vs the torch modules they came from.

Here: the target graphs (fp32 against transformers; a builder graph against itself and its taps). Each family's
drafter graph is checked by its own ``validate.py`` (export/families/<family>/) at several visible-key counts N (below, at and far above ref_keys) against the torch
drafter run with beta(N) from plugins/rule.py: this is what proves beta is computed in-graph from the KV length (a
constant folded at export would match at most one N); the fused drafter graph (``--fused-attention``) is checked
against the portable one by its family too (``validate_fused``). The tolerances and comparisons all share are in
export/checks.py (re-exported here).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export import checks
from export.checks import (DRAFTER_ATOL, DRAFTER_KEYS_AT_BASE, DRAFTER_RTOL, ROPE_ULP, TARGET_ATOL,  # noqa: F401
                           ValidationError, drafter_bound, max_abs_diff, within)

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
    hd = checks.dims(cfg)["head_dim"]
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
    sess = checks.session(path)
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
            "hidden_states": [h[0].float().numpy() for h in out.hidden_states], **checks.dims(model.config)}


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
    from runtime.backends.ort import run_shared

    sess = checks.session(path)
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
