"""Real config.json files of public drafters (tests/fixtures/configs/, provenance in its README) load, or are refused
with one message that names what is missing; their weights are random, at shrunk shapes where the true ones would
not fit a unit test."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.models.checkpoint_io import CheckpointError
from runtime.models.dflash import DFlashConfig
from runtime.models.layers import rope_inv_freq
from runtime.models.eagle3 import Eagle3Config, load_eagle3

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def _cfg(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_dflash_configs_load_at_their_true_shapes():
    c = DFlashConfig.from_dict(_cfg("specforge-qwen3-8b-dflash.json"))
    assert (c.hidden_size, c.num_hidden_layers, c.block_size, c.mask_token_id) == (4096, 5, 16, 151669)
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.num_target_layers == 36


@pytest.mark.parametrize("name, needle", [
    ("dflash2-config.z-lab-fixture.json", "DFlash2 drafter: sharpdraft supports DFlash v1 only (missing: the per-layer "
                                          "attention_conv / mlp_conv kernels and the candidate_selector"),
    ("deepseek-ai-dspark_qwen3_4b_block7.TRIMMED.json", "DSpark drafter: not supported (missing: its Markov head"),
    # loads in the speculators layout (tests/export/test_speculators_dflash.py), but this test upload names no taps
    ("speculators-dflash-example.config.json", "aux_hidden_state_layer_ids is null"),
])
def test_lookalikes_are_refused_with_one_clear_message(name, needle):
    with pytest.raises(CheckpointError) as e:
        DFlashConfig.from_dict(_cfg(name))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sliding_window_dflash_config_loads_its_windows():
    c = DFlashConfig.from_dict(_cfg("specforge-qwen3.6-27b-dflash.json"))
    assert c.windows == [2048, 2048, 2048, 2048, None]  # 4 sliding + 1 full, window 2048
    assert DFlashConfig.from_dict(c.to_dict()).windows == c.windows  # written back in the public layout
    d = _cfg("specforge-qwen3.6-27b-dflash.json")
    with pytest.raises(CheckpointError, match="sliding_attention layers need a window"):
        DFlashConfig.from_dict({**d, "sliding_window": None})
    with pytest.raises(CheckpointError, match="causal DFlash layers"):
        DFlashConfig.from_dict({**d, "dflash_config": {**d["dflash_config"], "causal": True}})
    with pytest.raises(CheckpointError, match="layer_types has 2 entries for 5 layers"):
        DFlashConfig.from_dict({**d, "layer_types": ["full_attention"] * 2})


def test_flat_dflash_variant_reads_top_level_fields():
    d = _cfg("specforge-qwen3-8b-dflash.json")
    dcfg = d.pop("dflash_config")
    flat = {**d, **dcfg}
    c = DFlashConfig.from_dict(flat)
    assert c.mask_token_id == dcfg["mask_token_id"] and c.target_layer_ids == dcfg["target_layer_ids"]


def test_speculators_eagle3_config_is_flattened():
    c = Eagle3Config.from_dict(_cfg("nm-testing-EAGLE3-LLaMA3.1-Instruct-8B-converted.config.json"))
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4096, 32, 8, 128)
    assert (c.vocab_size, c.draft_vocab_size, c.target_hidden_size) == (128256, 32000, 4096)  # null -> hidden
    assert c.num_speculative_tokens == 5 and c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.max_position_embeddings == 2048 and not c.norm_before_residual
    official = Eagle3Config.from_dict(_cfg("SafeAILab-EAGLE-traineagle3-config.json"))
    assert (official.hidden_size, official.draft_vocab_size, official.rope_theta) == (4096, 32000, 10000.0)
    with pytest.raises(CheckpointError, match="speculators_model_type 'dflash': this is not an EAGLE-3"):
        Eagle3Config.from_dict(_cfg("speculators-dflash-example.config.json"))


def test_llama3_rope_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = _cfg("llama-3.1-8b-instruct.config.json")
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"}), "cpu")
    ours = rope_inv_freq(128, d["rope_theta"], d["rope_scaling"])
    assert torch.equal(ours, ref.float())
    assert not torch.allclose(ours, rope_inv_freq(128, d["rope_theta"]))  # the scaling does something
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        rope_inv_freq(128, 1e6, {"rope_type": "yarn", "factor": 4.0})


def _shrunk_speculators_eagle3(path: Path, **layer_over) -> dict:
    """The speculators EAGLE-3 config with its layer shrunk (hidden 4096 -> 64) and random weights in speculators'
    key layout (``layers.0.*``, ``d2t`` / ``t2d``; the embedding borrowed from the target)."""
    cfg = _cfg("nm-testing-EAGLE3-LLaMA3.1-Instruct-8B-converted.config.json")
    h, vd = 64, 512
    cfg["transformer_layer_config"].update(hidden_size=h, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=128, **layer_over)
    v = cfg["transformer_layer_config"]["vocab_size"]
    cfg["draft_vocab_size"] = vd
    g = torch.Generator().manual_seed(0)
    w = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    p = "layers.0."
    st = {"fc.weight": w(h, 3 * h), "norm.weight": 1 + w(h), "lm_head.weight": w(vd, h),
          p + "self_attn.q_proj.weight": w(64, 2 * h), p + "self_attn.k_proj.weight": w(32, 2 * h),
          p + "self_attn.v_proj.weight": w(32, 2 * h), p + "self_attn.o_proj.weight": w(h, 64),
          p + "mlp.gate_proj.weight": w(128, h), p + "mlp.up_proj.weight": w(128, h), p + "mlp.down_proj.weight": w(h, 128),
          p + "input_layernorm.weight": 1 + w(h), p + "hidden_norm.weight": 1 + w(h),
          p + "post_attention_layernorm.weight": 1 + w(h)}
    ids = torch.randperm(v, generator=g)[:vd].sort().values
    st["d2t"] = ids - torch.arange(vd)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(st, path / "model.safetensors")
    return cfg


def _run(d, embed):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (1, 6), generator=g)
    hidden = d.project(torch.randn(1, 6, 3 * d.config.target_hidden_size, generator=g))
    logits, _, _ = d(ids, hidden, torch.arange(100, 106)[None], torch.ones(1, 6, dtype=torch.long),
                     embed_weight=embed)
    return logits


def test_speculators_eagle3_checkpoint_loads_and_runs(tmp_path):
    from export.families import get_family

    _shrunk_speculators_eagle3(tmp_path / "plain")
    d = load_eagle3(tmp_path / "plain")
    assert d.embed_tokens is None and d.t2d.sum() == 512  # t2d rebuilt from d2t
    assert get_family("eagle3").draft_tokens(d, None) == 5  # speculators' proposal length
    embed = torch.randn(d.config.vocab_size, 64) * 0.1
    base = _run(d, embed)
    assert torch.isfinite(base).all()
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    _shrunk_speculators_eagle3(tmp_path / "rope", rope_scaling=llama3)
    scaled = load_eagle3(tmp_path / "rope")
    assert scaled.config.rope_scaling["rope_type"] == "llama3"
    assert not torch.allclose(_run(scaled, embed), base)  # same weights, scaled positions: other logits
    _shrunk_speculators_eagle3(tmp_path / "nbr", norm_before_residual=True)
    (tmp_path / "nbr" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "nbr" / "config.json").read_text()), "norm_before_residual": True}))
    nbr = load_eagle3(tmp_path / "nbr")
    assert nbr.config.norm_before_residual and not torch.allclose(_run(nbr, embed), base)


def test_eagle3_refuses_an_unknown_rope_type(tmp_path):
    _shrunk_speculators_eagle3(tmp_path / "y", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope_scaling type 'yarn' is not supported for EAGLE-3"):
        load_eagle3(tmp_path / "y")


def test_speculators_eagle3_with_llama3_rope_exports_and_validates(tmp_path, tiny_target_dir):
    """A speculators-format EAGLE-3 head with llama3 rope scaling (shrunk to the tiny target) through
    sharpdraft-export: ONNX Runtime equals torch at N below, at and above ref_keys, and K comes from the config."""
    from export.pipeline import ExportConfig, run_export
    from tests.conftest import TINY_VOCAB

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    _shrunk_speculators_eagle3(tmp_path / "ck", rope_scaling=llama3, vocab_size=TINY_VOCAB)
    m = run_export(ExportConfig(family="eagle3", out=tmp_path / "e", checkpoint=tmp_path / "ck",
                                target=str(tiny_target_dir), target_precision="fp32", ref_keys=64))
    assert m["drafter"]["num_draft_tokens"] == 5
    assert m["drafter"]["config"]["speculators_model_type"] == "eagle3"  # the checkpoint's own config, kept
    pts = m["validation"]["drafter"]["points"]
    assert pts and all(p["max_abs_diff_logits"] <= p["bound"] for p in pts)


DFLASH_LIKE = sorted(p.name for p in CONFIGS.glob("*.json")
                     if any(k in p.read_text() for k in ("DFlash", "DSpark", "Glimmer", "block_size")))


def _loads(name: str):
    try:
        return DFlashConfig.from_dict(_cfg(name))
    except CheckpointError:
        return None


def _kind(c) -> tuple:
    """What a shrunk copy keeps of a config: layer kinds, tap count, block size, mask-token kind."""
    return (c.sliding, len(c.target_layer_ids), c.block_size, c.uses_mask_embedding)


# one shrunk export per kind of config (the others of a kind differ only in sizes the shrinking replaces)
SHRUNK = sorted({_kind(c): n for n in reversed(DFLASH_LIKE) if (c := _loads(n)) is not None}.values())


@pytest.mark.parametrize("name", DFLASH_LIKE)
def test_every_real_dflash_like_config_loads_or_is_refused(name):
    """Each DFlash-family config file either loads, with the shape facts the file states, or is refused with one
    message: never loaded as something else."""
    raw = _cfg(name)
    try:
        c = DFlashConfig.from_dict(raw)
    except CheckpointError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
        return
    t = raw.get("transformer_layer_config") or raw
    assert (c.hidden_size, c.num_hidden_layers) == (t["hidden_size"], t["num_hidden_layers"])


@pytest.mark.parametrize("name", SHRUNK)
def test_a_shrunk_copy_of_each_kind_of_real_dflash_config_exports_and_validates(name, tmp_path, tiny_target_dir):
    """Shrunk to the tiny target, keeping block size, layer kinds (a sliding and a full layer where the file has
    both), tap count and mask-token kind: export and validation pass."""
    import dataclasses

    from export.pipeline import ExportConfig, run_export
    from runtime.models.dflash import DFlashDrafter, save_dflash
    from tests.conftest import TINY_VOCAB

    c = DFlashConfig.from_dict(_cfg(name))
    n = min(c.num_hidden_layers, 3)
    windows = c.windows[: n - 1] + c.windows[-1:]
    small = dataclasses.replace(
        c, hidden_size=64, num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=TINY_VOCAB, mask_token_id=TINY_VOCAB if c.uses_mask_embedding else 5,
        target_layer_ids=[i % 4 for i in range(len(c.target_layer_ids))], num_target_layers=4,
        num_target_layers_known=True, own_lm_head=None, max_position_embeddings=4096,
        layer_windows=[None if w is None else 32 for w in windows] if c.sliding else [], extra={})
    torch.manual_seed(0)
    d = DFlashDrafter(small)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    save_dflash(d, tmp_path / "ck")
    m = run_export(ExportConfig(family="dflash", out=tmp_path / "e", checkpoint=tmp_path / "ck",
                                target=str(tiny_target_dir), target_precision="fp32", ref_keys=64))
    assert m["drafter"]["block_size"] == c.block_size
    v = m["validation"]["drafter"]
    assert all(p["max_abs_diff_logits"] <= p["bound"] for p in v["points"] + v["ragged"])


EAGLE3_FILES = sorted(p.name for p in CONFIGS.glob("*.json") if "eagle" in p.name.lower())


@pytest.mark.parametrize("name", EAGLE3_FILES)
def test_every_real_eagle3_config_loads_at_its_true_shape(name):
    """Official (SafeAILab), SpecForge, AngelSlim and speculators layouts; a shrunk copy of the speculators one is
    exported and validated above (test_speculators_eagle3_with_llama3_rope_exports_and_validates), the official
    layout by tests/e2e/test_families_real.py on the real target."""
    raw = _cfg(name)
    c = Eagle3Config.from_dict(raw)
    t = raw.get("transformer_layer_config") or raw
    assert (c.hidden_size, c.vocab_size, c.draft_vocab_size) == (t["hidden_size"], t["vocab_size"],
                                                                raw["draft_vocab_size"])
    assert c.rope_theta == float(t.get("rope_theta") or 10000.0)  # EAGLE's reference default when absent


def test_mimo_dflash_fields_that_change_the_math_are_refused_by_name():
    """MiMo's DFlash config loaded as plain DFlash before (outputs bit-identical with and without its fields): now
    one line names each field sharpdraft does not implement."""
    raw = _cfg("mimo-v2.5-pro-fp4-dflash-config.json")
    with pytest.raises(CheckpointError) as e:
        DFlashConfig.from_dict(raw)
    msg = str(e.value)
    assert "\n" not in msg
    for field in ("partial_rotary_factor=0.5", "dflash_config.attention_value_scale=0.612",
                  "dflash_config.attention_sink_bias=True", "dflash_config.backbone_rotary_base=5000000"):
        assert field in msg, msg
    assert "v_head_dim" not in msg and "num_anchors" not in msg  # neutral (= head_dim) / training-only: accepted


def test_neutral_values_and_training_fields_load():
    raw = _cfg("mimo-v2.5-pro-fp4-dflash-config.json")
    d = dict(raw, partial_rotary_factor=1.0, v_head_dim=raw["head_dim"],
             dflash_config=dict(raw["dflash_config"], attention_value_scale=1.0, attention_sink_bias=False,
                                backbone_rotary_base=raw["rope_theta"]))
    c = DFlashConfig.from_dict(d)
    assert c.windows == [1024] * 5 and c.num_hidden_layers == 5  # use_swa + swa_window_size: every layer windowed
    for field, value, needle in (("v_head_dim", 64, "v_head_dim=64"), ("hidden_act", "gelu", "hidden_act='gelu'"),
                                 ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
                                 ("mlp_bias", True, "mlp_bias=True")):
        with pytest.raises(CheckpointError, match=needle):
            DFlashConfig.from_dict({**d, field: value})


def test_sink_tensors_are_refused_by_name(tmp_path):
    from safetensors.torch import load_file

    from runtime.models.dflash import load_dflash
    from tests.conftest import write_tiny_dflash

    ck = write_tiny_dflash(tmp_path / "ck")
    state = load_file(ck / "model.safetensors")
    state["layers.0.self_attn.sinks"] = torch.zeros(4)
    save_file(state, ck / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"\['layers.0.self_attn.sinks'\] are attention sinks"):
        load_dflash(ck)
