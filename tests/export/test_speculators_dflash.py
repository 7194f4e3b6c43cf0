"""Speculators-format DFlash drafters (vLLM's format: ``speculators_model_type: "dflash"``), from the real config
file in tests/fixtures/configs/ with shrunk shapes and random weights: the tap-id convention, the drafter's own
draft-vocabulary LM head (d2t), export, validation and a lossless loop on the tiny target."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from export.pipeline import ExportConfig, ExportError, run_export
from runtime.engine import SpecEngine
from runtime.models.checkpoint_io import CheckpointError
from runtime.models.dflash import DFlashConfig, load_dflash
from tests.conftest import TINY_VOCAB, dflash_layer_state

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "speculators-dflash-example.config.json"
DRAFT_VOCAB = 300


def _config(**over) -> dict:
    d = json.loads(REAL.read_text())
    d["transformer_layer_config"].update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=96, num_hidden_layers=2, vocab_size=TINY_VOCAB,
                                         max_position_embeddings=4096)
    d.update(num_hidden_layers=2, block_size=4, draft_vocab_size=DRAFT_VOCAB, mask_token_id=5,
             aux_hidden_state_layer_ids=[1, 3])  # speculators' ids: z-lab's target_layer_ids [0, 2] + 1
    d.update(over)
    return d


def write_speculators_dflash(path: Path, seed: int = 3, **over) -> Path:
    """config.json + model.safetensors with the keys a speculators DFlashDraftModel saves."""
    g = torch.Generator().manual_seed(seed)
    cfg = _config(**over)
    t = cfg["transformer_layer_config"]
    h, nh, nkv, hd, inter = (t[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "intermediate_size"))

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    d2t_targets = torch.randperm(TINY_VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # draft id -> target id
    state = {"fc.weight": w(h, 2 * h), "hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h),
             "lm_head.weight": w(DRAFT_VOCAB, h), "d2t": d2t_targets - torch.arange(DRAFT_VOCAB),
             "t2d": torch.zeros(TINY_VOCAB, dtype=torch.bool).index_fill_(0, d2t_targets, True),
             "embed_tokens.weight": w(TINY_VOCAB, h)}  # a frozen copy of the verifier's table: not used
    state.update(dflash_layer_state(w, t["num_hidden_layers"], h, nh, nkv, hd, inter))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_config_maps_the_speculators_conventions():
    c = DFlashConfig.from_dict(_config())
    assert c.target_layer_ids == [0, 2]  # aux ids - 1, as vLLM's update_dflash
    assert (c.hidden_size, c.num_hidden_layers, c.block_size, c.mask_token_id) == (64, 2, 4, 5)
    assert c.own_lm_head == DRAFT_VOCAB and not c.num_target_layers_known and not c.uses_mask_embedding
    assert c.rope_theta == 10000.0  # the layer config's, as speculators' rotary embedding reads it


@pytest.mark.parametrize("over, needle", [
    ({"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids is null"),
    ({"mask_token_id": None}, "mask_token_id is not set"),
    ({"sample_from_anchor": True}, "sample_from_anchor true"),
])
def test_what_cannot_run_is_refused_with_one_message(over, needle):
    with pytest.raises(CheckpointError) as e:
        DFlashConfig.from_dict(_config(**over))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_published_example_config_is_refused_for_its_null_taps():
    """The real file (a test upload) states neither its taps nor its mask token: it names the first."""
    with pytest.raises(CheckpointError, match="aux_hidden_state_layer_ids is null"):
        DFlashConfig.from_dict(json.loads(REAL.read_text()))


def test_causal_sliding_layers_are_refused_and_non_causal_ones_load():
    t = {**_config()["transformer_layer_config"], "layer_types": ["sliding_attention", "full_attention"],
         "sliding_window": 64}
    with pytest.raises(CheckpointError, match="causal DFlash layers"):
        DFlashConfig.from_dict(_config(transformer_layer_config=t))  # speculators' default: causal SWA layers
    c = DFlashConfig.from_dict(_config(transformer_layer_config=t, sliding_window_non_causal=True))
    assert c.windows == [64, None]


def test_corrupt_d2t_is_a_checkpoint_error(tmp_path):
    from safetensors.torch import load_file

    ck = write_speculators_dflash(tmp_path / "ck")
    state = load_file(str(ck / "model.safetensors"))
    state["d2t"] = torch.full((DRAFT_VOCAB,), TINY_VOCAB)  # every row mapped past the vocabulary
    save_file(state, ck / "model.safetensors")
    with pytest.raises(CheckpointError, match="d2t maps the draft vocabulary outside"):
        load_dflash(ck)


@pytest.fixture(scope="module")
def speculators_engines(tmp_path_factory, tiny_target_dir):
    ck = write_speculators_dflash(tmp_path_factory.mktemp("spec") / "ck")
    out = tmp_path_factory.mktemp("spec_engines") / "engines"
    run_export(ExportConfig(family="dflash", out=out, checkpoint=ck, target=str(tiny_target_dir), ref_keys=64,
                            target_precision="fp32"))
    return ck, out


def test_export_stores_the_own_head_and_its_draft_vocabulary(speculators_engines):
    ck, out = speculators_engines
    m = json.loads((out / "manifest.json").read_text())
    assert "lm_head_weight" not in m["graphs"]["drafter"]["inputs"] and "lm_head_weight" not in m["shared_weights"]
    ids = json.loads((out / "drafter" / "draft_vocab.json").read_text())["draft_ids"]
    assert ids == load_dflash(ck).head_target_ids().tolist() and len(ids) == DRAFT_VOCAB
    assert m["drafter"]["config"]["dflash_config"]["target_layer_ids"] == [0, 2]
    assert max(p["max_abs_diff_logits"] for p in m["validation"]["drafter"]["points"]) < 1e-2


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_speculators_drafter_is_lossless_and_drafts_only_its_vocabulary(speculators_engines, backend):
    ck, out = speculators_engines
    engine = SpecEngine.from_dir(out, backend=backend, check_invariants=True)
    allowed = set(load_dflash(ck).head_target_ids().tolist())
    g = torch.Generator().manual_seed(4)
    for n in (3, 40):
        ids = torch.randint(0, TINY_VOCAB, (n,), generator=g).tolist()
        spec = engine.generate(ids, 16)
        assert spec.token_ids == engine.generate_target_only(ids, 16).token_ids
    cache = engine.drafter.new_cache()
    logits = engine.drafter.draft([cache], [7], [np.zeros((5, 2 * 64), np.float32)])[0]
    finite = {int(i) for i in np.nonzero(np.isfinite(logits[0]))[0]}
    assert finite == allowed


def test_full_vocab_and_fused_attention_are_refused(tmp_path, tiny_target_dir):
    ck = write_speculators_dflash(tmp_path / "ck")
    with pytest.raises(ExportError, match="--full-vocab: this drafter's own LM head scores 300"):
        run_export(ExportConfig(family="dflash", out=tmp_path / "a", checkpoint=ck, target=str(tiny_target_dir),
                                target_precision="fp32", full_vocab=True))
    with pytest.raises(ExportError, match="stores its own LM head"):
        run_export(ExportConfig(family="dflash", out=tmp_path / "b", checkpoint=ck, target=str(tiny_target_dir),
                                target_precision="fp32", fused_attention=True))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
