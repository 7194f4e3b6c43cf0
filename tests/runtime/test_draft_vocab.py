"""Reduced draft vocabulary (runtime/draft_vocab.py): file format, export, ONNX Runtime and torch drafters; and
the exported default of draft tokens verified per round (``--verify-draft-tokens``), set on the same folder."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from runtime.draft_vocab import DraftVocabError, expand_logits, load_draft_vocab, write_draft_vocab

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\nx = np.arange(10)\n"]


def test_write_orders_by_count_and_drops_unseen(tmp_path):
    counts = np.array([0, 5, 9, 5, 0, 1])
    ids = write_draft_vocab(tmp_path / "v.json", counts, 4, "test")
    assert ids.tolist() == [2, 1, 3, 5]  # ties broken by lower id
    assert write_draft_vocab(tmp_path / "w.json", counts, 10, "test").tolist() == [2, 1, 3, 5]  # unseen dropped
    assert load_draft_vocab(tmp_path / "v.json", 6).tolist() == [2, 1, 3, 5]
    assert json.loads((tmp_path / "v.json").read_text())["coverage_of_counts"] == pytest.approx(20 / 20)


@pytest.mark.parametrize("content, match", [
    ("not json", "not a draft vocabulary file"),
    ('{"ids": [1]}', "not a draft vocabulary file"),
    ('{"draft_ids": []}', "non-empty"),
    ('{"draft_ids": [1, 2, 2]}', "duplicates"),
    ('{"draft_ids": [1, 99]}', r"\[0, 50\)"),
])
def test_bad_files_are_refused(tmp_path, content, match):
    (tmp_path / "v.json").write_text(content)
    with pytest.raises(DraftVocabError, match=match):
        load_draft_vocab(tmp_path / "v.json", 50)


def test_expand_logits():
    full = expand_logits(np.array([[[1.0, 2.0]]], np.float32), np.array([3, 0]), 5)
    assert full.shape == (1, 1, 5)
    np.testing.assert_array_equal(full[0, 0], [2.0, -np.inf, -np.inf, 1.0, -np.inf])


@pytest.fixture(scope="module")
def vocab_engines(tmp_path_factory, tiny_target_dir, tiny_dflash_dir, tiny_engines):
    """The tiny pair exported with a 400-token draft vocabulary: the target's own greedy continuations of the
    prompts (so drafts can be accepted) plus the lowest ids."""
    from export.pipeline import ExportConfig, run_export
    from runtime.engine import SpecEngine

    base = SpecEngine.from_dir(tiny_engines, device="cpu")
    seen = {t for p in PROMPTS for t in base.generate_target_only(base.tokenizer.encode(p), 30).token_ids}
    ids = sorted(seen) + [i for i in range(400) if i not in seen]
    ckpt = tmp_path_factory.mktemp("ckpt") / "dflash"
    shutil.copytree(tiny_dflash_dir, ckpt)
    (ckpt / "draft_vocab.json").write_text(json.dumps({"draft_ids": ids[:400], "source": "test"}))
    out = tmp_path_factory.mktemp("engines") / "engines"
    run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=ckpt, target=str(tiny_target_dir), ref_keys=64,
                            verify_draft_tokens=2))
    return out, np.asarray(ids[:400])


def test_export_records_and_checksums_the_vocab(vocab_engines):
    out, ids = vocab_engines
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["drafter"]["draft_vocab"] == {"file": "drafter/draft_vocab.json", "size": 400}
    assert "drafter/draft_vocab.json" in manifest["graphs"]["drafter"]["sha256"]
    assert load_draft_vocab(out / "drafter" / "draft_vocab.json", 49152).tolist() == ids.tolist()


def test_reduced_head_equals_full_head_rows_and_stays_lossless(vocab_engines):
    from runtime.engine import SpecEngine

    out, ids = vocab_engines
    engine = SpecEngine.from_dir(out, device="cpu", check_invariants=True)
    drafter = engine.drafter
    assert drafter.draft_vocab_enabled and drafter.shared["lm_head_weight"].shape[0] == 400
    prompt = engine.tokenizer.encode(PROMPTS[0])
    _, feats = engine.target.forward([engine.target.new_cache()], [prompt])
    logits = {}
    for on in (True, False):
        drafter.set_draft_vocab(on)
        logits[on] = drafter.draft([drafter.new_cache()], [prompt[-1]], [feats[0, :-1]])
    drafter.set_draft_vocab(True)
    np.testing.assert_allclose(logits[True][..., ids], logits[False][..., ids], atol=1e-4)
    outside = np.setdiff1d(np.arange(logits[True].shape[-1]), ids)
    assert np.isneginf(logits[True][..., outside]).all()
    for p in PROMPTS:
        p_ids = engine.tokenizer.encode(p)
        spec = engine.generate(p_ids, 30)
        assert spec.token_ids == engine.generate_target_only(p_ids, 30).token_ids
        assert spec.stats.rounds >= 1


def test_torch_backend_uses_the_same_vocab(vocab_engines):
    from runtime.engine import SpecEngine

    out, ids = vocab_engines
    ort_engine = SpecEngine.from_dir(out, device="cpu")
    torch_engine = SpecEngine.from_dir(out, device="cpu", backend="torch")
    prompt = ort_engine.tokenizer.encode(PROMPTS[1])
    _, feats = ort_engine.target.forward([ort_engine.target.new_cache()], [prompt])
    got = {}
    for name, eng in (("ort", ort_engine), ("torch", torch_engine)):
        got[name] = eng.drafter.draft([eng.drafter.new_cache()], [prompt[-1]], [feats[0, :-1]])
    np.testing.assert_allclose(got["torch"][..., ids], got["ort"][..., ids], atol=1e-3)
    assert np.isneginf(got["torch"]).sum() == np.isneginf(got["ort"]).sum()


def test_bad_vocab_file_fails_the_export(tmp_path, tiny_target_dir, tiny_dflash_dir):
    from export.pipeline import ExportConfig, ExportError, run_export

    ckpt = tmp_path / "dflash"
    shutil.copytree(tiny_dflash_dir, ckpt)
    (ckpt / "draft_vocab.json").write_text('{"draft_ids": [1, 1]}')
    with pytest.raises(ExportError, match="duplicates.*--full-vocab"):
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=tmp_path / "out", checkpoint=ckpt, target=str(tiny_target_dir)))
    assert not (tmp_path / "out").exists()


def test_verify_draft_tokens_default_and_per_request_override(vocab_engines):
    from runtime.engine import SpecEngine
    from runtime.sampling import SamplingParams

    out, _ = vocab_engines
    engine = SpecEngine.from_dir(out, device="cpu", check_invariants=True)
    assert engine.manifest.to_dict()["drafter"]["verify_draft_tokens"] == 2 and engine.drafter.num_draft_tokens == 3
    ids = engine.tokenizer.encode(PROMPTS[2])
    base = engine.generate_target_only(ids, 24).token_ids
    default = engine.generate(ids, 24)
    assert default.stats.num_draft_tokens_per_round == 2 and len(default.stats.drafted_per_position) == 2
    wide = engine.generate(ids, params=SamplingParams(max_new_tokens=24, num_draft_tokens=3))
    assert wide.stats.num_draft_tokens_per_round == 3
    assert default.token_ids == wide.token_ids == base


def test_verify_draft_tokens_above_the_drafter_is_refused(tmp_path, tiny_target_dir, tiny_dflash_dir):
    from export.pipeline import ExportConfig, ExportError, run_export

    with pytest.raises(ExportError, match="must be in 1..3"):
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=tmp_path / "out", checkpoint=tiny_dflash_dir,
                                target=str(tiny_target_dir), verify_draft_tokens=4))
    with pytest.raises(ExportError, match=">= 1"):
        ExportConfig(family="dflash", out=tmp_path / "out", verify_draft_tokens=0)
    assert not (tmp_path / "out").exists()
