"""sharpdraft-export-vllm (export/vllm_export.py) on the shipped drafters: what vLLM 0.32 reads is in the files, and
bad input gives one error line and writes nothing. Runs in the main environment (no vLLM needed)."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from export.vllm_export import ARCHITECTURES, VllmExportError, run
from plugins.rule import Family
from runtime.models.target import resolve_target


@pytest.fixture(scope="module")
def target_tables():
    w = load_file(next(resolve_target(None).glob("*.safetensors")))
    return w["model.embed_tokens.weight"]


def _read(out):
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def test_dflash_extra_row(tmp_path, target_tables):
    out = run(Family.DFLASH, tmp_path / "d")
    cfg, w = _read(out)
    src = load_file("drafters/dflash-smollm2-135m/model.safetensors")
    ids = sorted(json.loads(open("drafters/dflash-smollm2-135m/draft_vocab.json").read())["draft_ids"])
    assert cfg["architectures"] == [ARCHITECTURES[Family.DFLASH][1]]
    assert cfg["vocab_size"] == 49153 and cfg["dflash_config"]["mask_token_id"] == 49152
    assert torch.equal(w["embed_tokens.weight"][:49152], target_tables)
    assert torch.equal(w["embed_tokens.weight"][49152], src["mask_embedding"].float())
    assert cfg["draft_vocab_size"] == len(ids) == w["lm_head.weight"].shape[0]
    assert torch.equal(w["d2t"] + torch.arange(len(ids)), torch.tensor(ids))  # vLLM: target = draft + d2t[draft]
    assert torch.equal(w["lm_head.weight"], target_tables[torch.tensor(ids)])  # tied SmolLM2 head, our rows
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["sharpdraft_query_scale"] == json.loads(open(
        "drafters/dflash-smollm2-135m/config.json").read())["sharpdraft_query_scale"]
    assert "mask_embedding" not in w


def test_dflash_in_vocab_and_off(tmp_path):
    out = run(Family.DFLASH, tmp_path / "d", mask="in-vocab", query_scale=False, architecture="stock")
    cfg, w = _read(out)
    state = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["vocab_size"] == 49152
    assert cfg["dflash_config"]["mask_token_id"] == state["mask_token_id"] == 16
    assert cfg["sharpdraft_query_scale"]["enabled"] is False and "embed_tokens.weight" not in w


def test_sliding_windows_kept(tmp_path):
    out = run(Family.DFLASH, tmp_path / "d", checkpoint="drafters/dflash-smollm2-135m-swa768-1full")
    cfg, _ = _read(out)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 768
    assert cfg["dflash_config"]["causal"] is False


def test_eagle3_and_pard(tmp_path, target_tables):
    cfg, w = _read(run(Family.EAGLE3, tmp_path / "e"))
    assert cfg["architectures"] == [ARCHITECTURES[Family.EAGLE3][1]] and "d2t" in w
    cfg, w = _read(run(Family.PARD, tmp_path / "p"))
    mask = load_file("drafters/pard-smollm2-135m/model.safetensors")["mask_embedding"]
    assert cfg["pard_token"] == 16 and cfg["tie_word_embeddings"] is False
    assert torch.equal(w["model.embed_tokens.weight"][16], mask.float())
    assert torch.equal(w["lm_head.weight"], target_tables)


def test_profile_overrides(tmp_path):
    cfg, _ = _read(run(Family.EAGLE3, tmp_path / "e", ref_keys=4096, slope=4.0))
    assert cfg["sharpdraft_query_scale"]["ref_keys"] == 4096 and cfg["sharpdraft_query_scale"]["slope"] == 4.0


def test_bad_input_one_line_nothing_written(tmp_path):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    cfg = json.loads(open("drafters/eagle3-smollm2-135m/config.json").read())
    del cfg["sharpdraft_query_scale"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VllmExportError, match="no sharpdraft_query_scale"):
        run(Family.EAGLE3, tmp_path / "out", checkpoint=ckpt)
    with pytest.raises(VllmExportError, match="cap must be"):
        run(Family.EAGLE3, tmp_path / "out", cap=0.5)
    r = subprocess.run([sys.executable, "-m", "export.vllm_export", "--drafter", "pard", "--out",
                        str(tmp_path / "out"), "--mask-id", "60000"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "--mask-id 60000" in r.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
