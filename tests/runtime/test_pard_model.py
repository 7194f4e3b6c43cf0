"""PARD drafter loading in the public layouts (and sharpdraft's demo layout), strictly, and its forward contract."""
import json

import pytest
import torch
from safetensors.torch import save_file

from runtime.models.checkpoint_io import CheckpointError
from runtime.models.pard import load_pard

V, H = 300, 64


def _config(**extra):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": V, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "pard_token": 299, "spd_type": "pard"}
    cfg.update(extra)
    return cfg


def _write(path, cfg, drop=(), add=None, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in cfg.items() if k not in ("model_type",)}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in drop}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state.update(add or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, path / "model.safetensors")
    return model, state


def test_public_untied_layout_loads_and_matches_transformers(tmp_path):
    model, _ = _write(tmp_path / "p", _config())
    d = load_pard(tmp_path / "p")
    ids = torch.randint(0, V, (2, 7))
    pos = torch.arange(7)[None].expand(2, -1)
    logits, present = d(ids, pos, torch.ones(2, 7, dtype=torch.int64))
    with torch.no_grad():
        ref = model.eval()(input_ids=ids, position_ids=pos).logits
    assert torch.allclose(logits, ref, atol=1e-5)
    assert len(present) == 4 and present[0].shape == (2, 2, 7, 16)


def test_qwen3_tied_layout_loads(tmp_path):
    cfg = _config(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
    model, state = _write(tmp_path / "q", cfg)
    assert "lm_head.weight" not in state and any("q_norm" in k for k in state)
    d = load_pard(tmp_path / "q")
    ids = torch.randint(0, V, (1, 5))
    logits, _ = d(ids, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.int64))
    with torch.no_grad():
        ref = model.eval()(input_ids=ids, position_ids=torch.arange(5)[None]).logits
    assert torch.allclose(logits, ref, atol=1e-5)


def test_demo_layout_borrows_target_embeddings_and_embeds_the_mask(tmp_path):
    cfg = _config(tie_word_embeddings=True, pard_token=V, sharpdraft_embeddings="target")
    mask_vec = torch.randn(H)
    _write(tmp_path / "d", cfg, drop=("model.embed_tokens.weight",), add={"mask_embedding": mask_vec})
    d = load_pard(tmp_path / "d")
    table = torch.randn(V, H)
    emb = d.embed(torch.tensor([[3, V, V]]), table)
    assert torch.equal(emb[0, 0], table[3]) and torch.equal(emb[0, 1], mask_vec) and torch.equal(emb[0, 2], mask_vec)
    logits, _ = d(torch.tensor([[3, V, V]]), torch.arange(3)[None], torch.ones(1, 3, dtype=torch.int64),
                  embed_weight=table, num_logits=2)
    assert logits.shape == (1, 2, V)


def test_cached_forward_equals_full_forward(tmp_path):
    _write(tmp_path / "p", _config())
    d = load_pard(tmp_path / "p")
    ids = torch.randint(0, V - 1, (1, 9))
    full, _ = d(ids, torch.arange(9)[None], torch.ones(1, 9, dtype=torch.int64))
    _, past = d(ids[:, :6], torch.arange(6)[None], torch.ones(1, 6, dtype=torch.int64))
    tail, _ = d(ids[:, 6:], torch.arange(6, 9)[None], torch.ones(1, 9, dtype=torch.int64), past)
    assert torch.allclose(tail, full[:, 6:], atol=1e-5)


@pytest.mark.parametrize("mutate, match", [
    (lambda cfg, st: cfg.pop("pard_token"), "no pard_token"),
    (lambda cfg, st: st.pop("model.layers.1.mlp.up_proj.weight"), "missing"),
    (lambda cfg, st: st.update({"model.extra.weight": torch.zeros(2)}), "unexpected"),
    (lambda cfg, st: st.update({"model.norm.weight": torch.zeros(H + 1)}), "shapes"),
    # amd/PARD2-Qwen3-8B's fields (../shared/reference/configs/pard/NOTES-pard.md): never loaded as plain PARD
    (lambda cfg, st: cfg.update({"pard2": True, "spd_type": "pard2", "pard2_scale": 0.02,
                                 "pard2_target_layers": [-1, -8, -16, -24], "pard2_target_dim": 16384}),
     "PARD2 drafter.*missing: its target_proj"),
])
def test_bad_checkpoints_are_refused_clearly(tmp_path, mutate, match):
    cfg = _config()
    _, state = _write(tmp_path / "b", cfg)
    mutate(cfg, state)
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    save_file(state, tmp_path / "b" / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        load_pard(tmp_path / "b")


@pytest.mark.parametrize("extra, layers", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}, "[0]"),
    ({"use_sliding_window": True, "sliding_window": 64}, "[0, 1]"),
])
def test_sliding_window_pard_is_refused_with_one_clear_error(tmp_path, tiny_target_dir, extra, layers):
    """Sliding-window layers used to crash sharpdraft-export inside torch.export (a 149-line traceback)."""
    import subprocess
    import sys

    from tests.conftest import write_tiny_pard

    ck = write_tiny_pard(tmp_path / "ck", tiny_target_dir)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(extra)
    (ck / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "pard", "--checkpoint", str(ck),
                        "--target", str(tiny_target_dir), "--out", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sharpdraft-export: error:") and "sliding-window" in last and f"layers {layers}" in last
    assert not (tmp_path / "e").exists()
    # a window the config switches off (Qwen2's use_sliding_window false) is a full-attention checkpoint
    from runtime.models.pard import sliding_layers

    assert sliding_layers({"num_hidden_layers": 2, "sliding_window": 4096, "use_sliding_window": False}) == []
