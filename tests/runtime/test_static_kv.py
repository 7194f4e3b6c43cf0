"""The static KV cache (runtime/kv_cache.py) and the static-KV target graph (export/graphs.py kv_io "static")."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.kv_cache import StaticKVCache, gather_static


def _new(rng, q, kvh=2, hd=4, layers=2, batch=1):
    return [rng.standard_normal((batch, kvh, q, hd)).astype(np.float32) for _ in range(2 * layers)]


def test_append_truncate_and_growth_keep_positions():
    rng = np.random.default_rng(0)
    cache = StaticKVCache(2, 2, 4)
    steps = [_new(rng, q) for q in (300, 7, 1, 5)]
    cache.append(steps[0], 300)
    assert cache.length == 300 and cache.capacity == 512  # aligned up from 300 (ALIGN 256)
    buffers = [id(b) for b in cache.kv_buffers]
    cache.append(steps[1], 7)
    cache.truncate(302)  # rollback: 5 of the 7 rejected
    cache.append(steps[2], 1)
    assert [id(b) for b in cache.kv_buffers] == buffers  # within capacity nothing is re-allocated
    expect = [np.concatenate([a, b[:, :, :2], c], axis=2) for a, b, c in zip(*steps[:3])]
    for got, want in zip(cache.kv, expect):
        np.testing.assert_array_equal(got, want)
    cache.reserve(520)  # growth: at least GROWTH x the capacity (576), aligned up to 768; copies the valid positions
    assert cache.capacity == 768 and [id(b) for b in cache.kv_buffers] != buffers
    for got, want in zip(cache.kv, expect):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(304)


def test_append_takes_one_row_of_a_batch_and_gather_pads():
    rng = np.random.default_rng(1)
    a, b = StaticKVCache(1, 2, 4), StaticKVCache(1, 2, 4)
    new = _new(rng, 3, layers=1, batch=2)
    a.append(new, 3, row=0)
    b.append(new, 1, row=1)
    past, l_max = gather_static([a, b])
    assert l_max == 3 and past[0].shape == (2, 2, 3, 4)
    np.testing.assert_array_equal(past[0][1, :, :1], new[0][1, :, :1])
    np.testing.assert_array_equal(past[0][1, :, 1:], 0)  # padding, masked by the caller
    solo, cap = gather_static([a])
    assert solo[0] is a.kv_buffers[0] and cap == a.capacity  # one row: the buffer itself, no copy


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def _target_only(d: dict):
    """What OrtTarget reads of a typed manifest (runtime/manifest.py), from a target-only dict."""
    from types import SimpleNamespace

    from runtime.manifest import GraphEntry, TargetEntry

    graph = {**d["graphs"]["target"], "sha256": {d["graphs"]["target"]["file"]: ""}}
    return SimpleNamespace(target=TargetEntry(source="tiny", architecture="LlamaForCausalLM", hidden_size=0,
                                              **d["target"]),
                           graphs={"target": GraphEntry.from_dict(graph, "graphs.target")})


def test_static_graph_validates_and_equals_the_concat_graph(tiny_model, tmp_path):
    """Both export forms pass validation (noise in the spare slots included) and give the same logits, taps and
    K/V through their runtime caches, with prefill chunked in 3s and a rollback between steps."""
    from export.graphs import export_target
    from export.validate import validate_target
    from runtime.backends.ort import OrtTarget

    cfg = tiny_model.config
    outs = {}
    for kv_io in ("static", "concat"):
        path = tmp_path / kv_io / "model.onnx"
        io = export_target(tiny_model, [0, cfg.num_hidden_layers - 1], path, kv_io=kv_io)
        assert io["kv_io"] == kv_io
        check = validate_target(tiny_model, [0, cfg.num_hidden_layers - 1], path, io)
        assert check["max_abs_diff_kv"] < 1e-4 and check["max_abs_diff_logits"] < 1e-3
        manifest = {"target": {"num_layers": cfg.num_hidden_layers, "num_key_value_heads": cfg.num_key_value_heads,
                               "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
                               "vocab_size": cfg.vocab_size, "precision": "fp32"},
                    "graphs": {"target": {"file": f"{kv_io}/model.onnx", **io}}}
        target = OrtTarget(tmp_path, _target_only(json.loads(json.dumps(manifest))), device="cpu", threads=1)
        target.prefill_chunk = 3
        cache = target.new_cache()
        assert isinstance(cache, StaticKVCache) == (kv_io == "static")
        prompt = [5, 9, 14, 3, 8, 22, 41, 7]
        last, taps = target.prefill(cache, prompt)
        step1, _ = target.forward([cache], [[11, 12, 13, 14]])
        cache.truncate(len(prompt) + 1)  # keep 1 of the 4 positions
        step2, taps2 = target.forward([cache], [[15, 16]])
        outs[kv_io] = (last, taps, step1, step2, taps2, [np.array(t) for t in cache.kv])
    for got, want in zip(outs["static"][:5], outs["concat"][:5]):
        np.testing.assert_allclose(got, want, atol=1e-4)
    for got, want in zip(outs["static"][5], outs["concat"][5]):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_static_ragged_batch_equals_solo_rows(tiny_model, tmp_path):
    from export.graphs import export_target
    from runtime.backends.ort import OrtTarget

    cfg = tiny_model.config
    io = export_target(tiny_model, [0], tmp_path / "t" / "model.onnx", kv_io="static")
    manifest = {"target": {"num_layers": cfg.num_hidden_layers, "num_key_value_heads": cfg.num_key_value_heads,
                           "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
                           "vocab_size": cfg.vocab_size, "precision": "fp32"},
                "graphs": {"target": {"file": "t/model.onnx", **io}}}
    target = OrtTarget(tmp_path, _target_only(manifest), device="cpu", threads=1)
    prompts, steps = [[3, 4, 5, 6, 7, 8], [9, 10]], [[20, 21, 22], [23]]
    solo = []
    for p, s in zip(prompts, steps):
        c = target.new_cache()
        target.prefill(c, p)
        solo.append((target.forward([c], [s])[0][0, : len(s)], c))
    caches = [target.new_cache() for _ in prompts]
    for c, p in zip(caches, prompts):
        target.prefill(c, p)
    logits, _ = target.forward(caches, steps)
    for r, (s, (want, c_solo)) in enumerate(zip(steps, solo)):
        np.testing.assert_allclose(logits[r, : len(s)], want, atol=1e-4)
        assert caches[r].length == c_solo.length
        for a, b in zip(caches[r].kv, c_solo.kv):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_export_option_concat_form_runs_lossless_and_equals_static(tiny_engines, concat_engines, tmp_path):
    """``--target-kv-io concat --drafter-kv-io concat`` write the former forms; the runtime drives both to the same
    tokens and the same acceptance."""
    from export.pipeline import ExportConfig, ExportError
    from runtime.engine import SpecEngine

    concat = SpecEngine.from_dir(concat_engines, device="cpu", check_invariants=True)
    static = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    concat_m, static_m = concat.manifest.to_dict(), static.manifest.to_dict()
    for graph in ("target", "drafter"):
        assert concat_m["graphs"][graph]["kv_io"] == "concat"
        assert static_m["graphs"][graph]["kv_io"] == "static"
        assert "present_key.0" in concat_m["graphs"][graph]["outputs"]
        assert "new_key.0" in static_m["graphs"][graph]["outputs"]
    assert static_m["validation"]["drafter"]["max_abs_diff_new_kv"] < 2e-3
    ids = static.tokenizer.encode("The quick brown fox")
    want = static.generate_target_only(ids, 20).token_ids
    got_concat, got_static = concat.generate(ids, 20), static.generate(ids, 20)
    assert got_concat.token_ids == got_static.token_ids == want
    assert got_concat.stats.accepted_per_position == got_static.stats.accepted_per_position
    assert got_concat.stats.rounds == got_static.stats.rounds
    with pytest.raises(ExportError, match="target_kv_io"):
        ExportConfig(family="dflash", out=tmp_path / "x", target_kv_io="paged")
    with pytest.raises(ExportError, match="drafter_kv_io"):
        ExportConfig(family="dflash", out=tmp_path / "x", drafter_kv_io="auto")


def test_static_drafter_equals_concat_drafter_over_ragged_steps(tiny_engines, concat_engines):
    """The static-KV drafter graph drafts what the concat one does, step after step, solo and in ragged batches,
    and a step within capacity re-allocates no buffer."""
    from runtime.manifest import load_manifest
    from runtime.backends.ort import OrtDFlashDrafter

    drafters = {name: OrtDFlashDrafter(path, load_manifest(path), device="cpu", threads=1)
                for name, path in (("static", tiny_engines), ("concat", concat_engines))}
    assert drafters["static"].static and not drafters["concat"].static
    rng = np.random.default_rng(0)
    feat = next(i.shape[2] for i in drafters["static"].session.get_inputs() if i.name == "target_hidden")
    caches = {name: [d.new_cache(), d.new_cache()] for name, d in drafters.items()}
    steps = [([0, 1], [40, 25]), ([0, 1], [3, 1]), ([1], [2]), ([0], [0]), ([0, 1], [1, 4])]
    buffers = None
    for rows, lens in steps:
        ctx = [rng.standard_normal((n, feat)).astype(np.float32) for n in lens]
        bonus = rng.integers(0, 100, len(rows)).tolist()
        out = {name: d.draft([caches[name][r] for r in rows], bonus, ctx) for name, d in drafters.items()}
        np.testing.assert_allclose(out["static"], out["concat"], atol=1e-4, rtol=1e-4)
        for r in rows:
            assert caches["static"][r].length == caches["concat"][r].length
            for a, b in zip(caches["static"][r].kv, caches["concat"][r].kv):
                np.testing.assert_allclose(a, b, atol=1e-5)
        if buffers is not None:  # well within capacity after the first step: buffers written in place
            assert [id(b) for c in caches["static"] for b in c.kv_buffers] == buffers
        buffers = [id(b) for c in caches["static"] for b in c.kv_buffers]
