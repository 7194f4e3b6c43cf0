"""Sliding-window DFlash layers (Qwen3.5 / 3.6 DFlash drafters: ``layer_types`` with ``sliding_attention``): the
torch model honours the window, the exported graph computes beta per layer and per query row from each layer's own
mask (so beta acts only where a layer's N exceeds ref_keys), validation holds, and decoding stays lossless."""
import json

import pytest
import torch

from plugins.rule import QueryScaleProfile, beta_torch
from runtime.models.dflash import load_dflash
from tests.conftest import write_tiny_dflash

WINDOW = 8


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory):
    return write_tiny_dflash(tmp_path_factory.mktemp("swa"), sliding_window=WINDOW)


def _inputs(past_len=20, ctx=3, blk=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    past = [torch.randn(1, 2, past_len, 16, generator=g) for _ in range(4)]
    return ([(past[0], past[1]), (past[2], past[3])], torch.randn(1, ctx, 128, generator=g),
            torch.arange(past_len, past_len + ctx + blk)[None], torch.randn(1, blk, 64, generator=g))


def test_the_window_hides_old_keys_and_a_wide_one_is_full_attention(swa_dir, tiny_dflash_dir):
    d, full = load_dflash(swa_dir), load_dflash(tiny_dflash_dir)
    assert d.config.windows == [WINDOW, None]
    pkv, th, pos, emb = _inputs()
    windowed, _ = d(emb, th, pos, pkv)
    assert not torch.allclose(windowed, full(emb, th, pos, pkv)[0])
    d.config.layer_windows = [10 ** 6, None]
    assert torch.allclose(d(emb, th, pos, pkv)[0], full(emb, th, pos, pkv)[0], atol=1e-6)
    # what the window hides: changing keys older than the window changes nothing in the sliding layer alone
    d.config.layer_windows = [WINDOW, None]
    q_pos, key_pos = pos[:, 3:], torch.cat([torch.arange(20)[None], pos], 1)
    mask = d.window_mask(key_pos, q_pos, WINDOW, None)[0, 0]  # [B, keys]
    for i, p in enumerate(q_pos[0].tolist()):
        assert mask[i].nonzero().flatten().tolist() == [j for j, kp in enumerate(key_pos[0].tolist())
                                                        if kp > p - WINDOW]


def test_beta_from_each_layers_mask_equals_the_rule(tiny_dflash_dir):
    """On full layers the per-row path gives beta(s + B), the scalar the rest of the project uses."""
    full = load_dflash(tiny_dflash_dir)
    pkv, th, pos, emb = _inputs()
    prof = QueryScaleProfile(ref_keys=9, top_k=4)
    n = 20 + 3 + 4
    a, _ = full(emb, th, pos, pkv, query_scale=beta_torch(n, prof))
    b, _ = full(emb, th, pos, pkv, profile=prof, key_mask=torch.ones(1, n, dtype=torch.long))
    assert torch.allclose(a, b, atol=1e-6)


def test_export_validates_and_decoding_is_lossless(swa_dir, tiny_target_dir, tmp_path):
    from export.errors import ExportError
    from export.pipeline import ExportConfig, run_export
    from runtime.engine import SpecEngine

    m = run_export(ExportConfig(family="dflash", out=tmp_path / "e", checkpoint=swa_dir, target=str(tiny_target_dir),
                                target_precision="fp32", ref_keys=64))
    assert m["query_scale"]["rewrite"]["beta_subgraphs"] == 2  # one per distinct mask: the window's, the full one
    assert "sliding layers" in m["query_scale"]["num_keys"]
    assert m["drafter"]["config"]["layer_types"] == ["sliding_attention", "full_attention"]
    v = m["validation"]["drafter"]
    assert all(p["max_abs_diff_logits"] <= p["bound"] for p in v["points"] + v["ragged"])
    eng = SpecEngine.from_dir(tmp_path / "e", device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode("def add(a, b):\n    return a + b\n" * 6)
    assert eng.generate(ids, 24).token_ids == eng.generate_target_only(ids, 24).token_ids
    torch_eng = SpecEngine.from_dir(tmp_path / "e", device="cpu", backend="torch", check_invariants=True)
    out = torch_eng.generate(ids, 24)  # the torch backend runs the windowed layer on the fused op
    assert out.token_ids == torch_eng.generate_target_only(ids, 24).token_ids and out.stats.rounds > 0
    assert json.loads((swa_dir / "config.json").read_text())["sliding_window"] == WINDOW


def test_fused_export_takes_the_window_and_validates(swa_dir, tiny_target_dir, tmp_path):
    """--fused-attention on a drafter with a sliding layer: both attentions fused, the windowed one with its
    window; the fused graph equals the portable one on ragged rows (a cache hole inside the window's reach)."""
    import onnx

    from export.fuse import DOMAIN, node_attributes
    from export.pipeline import ExportConfig, run_export

    m = run_export(ExportConfig(family="dflash", out=tmp_path / "f", checkpoint=swa_dir, target=str(tiny_target_dir),
                                target_precision="fp32", ref_keys=64, fused_attention=True))
    fused = m["validation"]["drafter_fused"]
    assert all(p["max_abs_diff_logits"] <= p["bound"] for p in fused["points"]), fused
    assert all(p["beta_effect_on_logits"] > 10 * p["bound"] for p in fused["points"][1:]), fused
    graph = onnx.load(str(tmp_path / "f" / m["graphs"]["drafter_fused"]["file"]), load_external_data=False)
    windows = [node_attributes(n)["window"] for n in graph.graph.node if n.domain == DOMAIN]
    assert windows == [WINDOW, 0] == m["graphs"]["drafter_fused"]["fused_windows"]
