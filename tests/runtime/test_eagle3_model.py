"""EAGLE-3 checkpoints in the layouts the ecosystem writes load strictly into one module, and its forward contract."""
import json

import pytest
import torch
from safetensors.torch import save_file

from runtime.models.checkpoint_io import CheckpointError
from runtime.models.eagle3 import default_aux_layer_ids, load_eagle3, row_beta

V, VD, H = 200, 50, 32


def _config(**extra):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-5, "vocab_size": V, "draft_vocab_size": VD, "max_position_embeddings": 2048}
    cfg.update(extra)
    return cfg


def _state(prefix="midlayer.", embed=False, t2d=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    hd = H // 4
    st = {"fc.weight": w(H, 3 * H), "norm.weight": 1 + w(H), "lm_head.weight": w(VD, H),
          prefix + "self_attn.q_proj.weight": w(4 * hd, 2 * H), prefix + "self_attn.k_proj.weight": w(2 * hd, 2 * H),
          prefix + "self_attn.v_proj.weight": w(2 * hd, 2 * H), prefix + "self_attn.o_proj.weight": w(H, 4 * hd),
          prefix + "mlp.gate_proj.weight": w(64, H), prefix + "mlp.up_proj.weight": w(64, H),
          prefix + "mlp.down_proj.weight": w(H, 64), prefix + "input_layernorm.weight": 1 + w(H),
          prefix + "hidden_norm.weight": 1 + w(H), prefix + "post_attention_layernorm.weight": 1 + w(H)}
    ids = torch.randperm(V, generator=g)[:VD].sort().values
    st["d2t"] = ids - torch.arange(VD)
    if t2d:
        m = torch.zeros(V, dtype=torch.bool)
        m[ids] = True
        st["t2d"] = m
    if embed:
        st["embed_tokens.weight"] = w(V, H)
    return st


def _write(path, cfg, state, fmt="safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        save_file(state, path / "model.safetensors")
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


def test_official_layout_loads_with_defaults(tmp_path):
    st = _state()
    d = load_eagle3(_write(tmp_path / "o", _config(), st))
    assert d.config.rope_theta == 10000.0 and d.config.aux_layer_ids is None and d.embed_tokens is None
    assert torch.equal(d.draft_to_target, torch.arange(VD) + st["d2t"])
    assert torch.equal(d.t2d, st["t2d"]) and default_aux_layer_ids(30) == [2, 15, 27]


@pytest.mark.parametrize("prefix", ["layers.0.", "model.layers.0."])
def test_variant_layouts_load_to_the_same_module(tmp_path, prefix):
    ref = load_eagle3(_write(tmp_path / "ref", _config(), _state()))
    st = {(k.replace("midlayer.", prefix) if k.startswith("midlayer.") else k): v for k, v in _state(t2d=False).items()}
    cfg = _config(rope_theta=10000.0, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 27],
                                                    "use_aux_hidden_state": True})
    d = load_eagle3(_write(tmp_path / "v", cfg, st, fmt="bin"))
    assert d.config.aux_layer_ids == [1, 14, 27]
    assert torch.equal(d.t2d, ref.t2d)  # rebuilt from d2t
    for (k, a), (_, b) in zip(sorted(ref.state_dict().items()), sorted(d.state_dict().items())):
        assert torch.equal(a, b), k


def test_embedding_shipped_or_borrowed(tmp_path):
    d = load_eagle3(_write(tmp_path / "e", _config(), _state(embed=True)))
    assert d.embed_tokens is not None
    ids = torch.randint(0, V, (2, 5))
    hidden = torch.randn(2, 5, H)
    pos = torch.arange(5)[None].expand(2, -1)
    am = torch.ones(2, 5, dtype=torch.int64)
    own, out, (k, v) = d(ids, hidden, pos, am)
    borrowed, _, _ = d(ids, hidden, pos, am, embed_weight=d.embed_tokens.weight)
    assert torch.allclose(own, borrowed) and own.shape == (2, 5, VD) and out.shape == (2, 5, H)
    assert k.shape == (2, 2, 5, H // 4)


def test_cached_chain_step_equals_full_causal_forward(tmp_path):
    d = load_eagle3(_write(tmp_path / "o", _config(), _state(embed=True)))
    ids, hidden = torch.randint(0, V, (1, 7)), torch.randn(1, 7, H)
    pos = torch.arange(7)[None]
    full, _, _ = d(ids, hidden, pos, torch.ones(1, 7, dtype=torch.int64))
    _, _, kv = d(ids[:, :5], hidden[:, :5], pos[:, :5], torch.ones(1, 5, dtype=torch.int64))
    tail, _, _ = d(ids[:, 5:], hidden[:, 5:], pos[:, 5:], torch.ones(1, 7, dtype=torch.int64), kv)
    assert torch.allclose(tail, full[:, 5:], atol=1e-5)


def test_row_beta_is_per_query_row():
    from plugins.rule import QueryScaleProfile

    prof = QueryScaleProfile(ref_keys=40)
    am = torch.ones(1, 42, dtype=torch.int64)  # past 38, q 4: rows see N = 39, 40, 41, 42
    beta = row_beta(am, 4, prof)[0, 0, :, 0]
    assert beta[:2].tolist() == [1.0, 1.0] and beta[2] > 1.0 and beta[3] > beta[2]
    assert beta[3].item() == pytest.approx(prof.beta(42), rel=1e-6)


def _without_t2d_out_of_range(cfg, st):
    st.pop("t2d")
    st["d2t"][7] += V  # draft id 7 -> a target id past the vocabulary; the t2d rebuild used to IndexError here


def _duplicate(cfg, st):
    st["d2t"][3] = st["d2t"][2] + 2 - 3  # draft ids 2 and 3 -> one target id


def _t2d_disagrees(cfg, st):
    covered = (torch.arange(VD) + st["d2t"])[0]
    st["t2d"][covered] = False


@pytest.mark.parametrize("mutate, match", [
    (_without_t2d_out_of_range, r"draft id 7 to target id \d+, outside the target vocabulary"),
    (_duplicate, r"draft ids \[2, 3\] to the same target id"),
    (_t2d_disagrees, r"t2d disagrees with d2t \(target id \d+ is mapped by d2t but not marked"),
    (lambda cfg, st: st.update({"t2d": st["t2d"][:-1]}), r"t2d has shape \[199\], expected \[200\]"),
    (lambda cfg, st: st.update({"d2t": st["d2t"].float()}), "1-D integer tensor"),
])
def test_bad_draft_vocabulary_maps_name_the_bad_id(tmp_path, mutate, match):
    cfg, st = _config(), _state()
    mutate(cfg, st)
    with pytest.raises(CheckpointError, match=match):
        load_eagle3(_write(tmp_path / "b", cfg, st))


def test_a_bad_d2t_ends_sharpdraft_export_with_one_error_line(tmp_path, tiny_target_dir):
    import subprocess
    import sys

    from tests.conftest import write_tiny_eagle3

    ck = write_tiny_eagle3(tmp_path / "ck", tiny_target_dir)
    from safetensors.torch import load_file

    st = load_file(str(ck / "model.safetensors"))
    st.pop("t2d", None)
    st["d2t"] = st["d2t"].clone()
    st["d2t"][5] = 10 ** 6
    save_file(st, ck / "model.safetensors")
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "eagle3", "--checkpoint", str(ck),
                        "--target", str(tiny_target_dir), "--out", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sharpdraft-export: error:") and "draft id 5" in last


@pytest.mark.parametrize("mutate, match", [
    (lambda cfg, st: st.pop("midlayer.hidden_norm.weight"), "missing"),
    (lambda cfg, st: st.update({"d2t": st["d2t"] + V}), "outside the target vocabulary"),
    (lambda cfg, st: cfg.pop("hidden_size"), "hidden_size"),
    (lambda cfg, st: cfg.update(num_hidden_layers=2), "more than one decoder layer"),
    (lambda cfg, st: st.update({"fc.weight": torch.zeros(H, 2 * H)}), "shapes"),
])
def test_bad_checkpoints_are_refused_clearly(tmp_path, mutate, match):
    cfg, st = _config(), _state()
    mutate(cfg, st)
    with pytest.raises(CheckpointError, match=match):
        load_eagle3(_write(tmp_path / "b", cfg, st))
