import json

import pytest
import torch

from runtime.models.checkpoint_io import CheckpointError
from runtime.models.dflash import DFlashConfig, load_dflash, save_dflash
from tests.conftest import TINY_VOCAB, write_tiny_dflash

PUBLIC_LAYER_KEYS = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {"self_attn.q_norm.weight",
                                                                       "self_attn.k_norm.weight"} | \
    {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {"input_layernorm.weight",
                                                                 "post_attention_layernorm.weight"}


def test_synthetic_public_checkpoint_loads_strictly(tiny_dflash_dir):
    d = load_dflash(tiny_dflash_dir)
    keys = set(d.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding"} | \
        {f"layers.{i}.{k}" for i in range(2) for k in PUBLIC_LAYER_KEYS}
    assert keys == expected
    assert d.config.block_size == 4 and d.config.target_layer_ids == [0, 2]
    assert d.config.mask_token_id == TINY_VOCAB and d.config.uses_mask_embedding


def test_real_mask_id_checkpoint_has_no_extra_tensor(tmp_path):
    d = load_dflash(write_tiny_dflash(tmp_path / "c", mask_embedding=False))
    assert d.mask_embedding is None
    emb = torch.randn(TINY_VOCAB, 64)
    ids = torch.tensor([[5, 7, 7, 7]])
    assert torch.equal(d.embed_block(ids, emb), emb[ids])


def test_mask_embedding_scheme(tiny_dflash_dir):
    d = load_dflash(tiny_dflash_dir)
    emb = torch.randn(TINY_VOCAB, 64)
    ids = torch.tensor([[5, TINY_VOCAB, TINY_VOCAB, 9]])
    out = d.embed_block(ids, emb)
    assert torch.equal(out[0, 0], emb[5]) and torch.equal(out[0, 3], emb[9])
    assert torch.equal(out[0, 1], d.mask_embedding.detach()) and torch.equal(out[0, 2], out[0, 1])


def test_third_party_midlayer_names_are_mapped(tmp_path):
    from safetensors.torch import load_file, save_file

    src = write_tiny_dflash(tmp_path / "c")
    state = load_file(src / "model.safetensors")
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    save_file(state, src / "model.safetensors")
    assert set(load_dflash(src).state_dict()) >= {"layers.0.self_attn.q_proj.weight"}


def test_missing_key_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    src = write_tiny_dflash(tmp_path / "c")
    state = load_file(src / "model.safetensors")
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_dflash(src)


@pytest.mark.parametrize("damage", ["no_config", "bad_json", "no_weights", "truncated", "no_mask_id", "shape"])
def test_bad_checkpoints(tmp_path, damage):
    src = write_tiny_dflash(tmp_path / "c")
    if damage == "no_config":
        (src / "config.json").unlink()
    elif damage == "bad_json":
        (src / "config.json").write_text("{not json")
    elif damage == "no_weights":
        (src / "model.safetensors").unlink()
    elif damage == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "no_mask_id":
        cfg = json.loads((src / "config.json").read_text())
        del cfg["dflash_config"]["mask_token_id"]
        (src / "config.json").write_text(json.dumps(cfg))
    elif damage == "shape":
        cfg = json.loads((src / "config.json").read_text())
        cfg["intermediate_size"] = 80
        (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        load_dflash(src)


def test_save_round_trip(tmp_path, tiny_dflash_dir):
    d = load_dflash(tiny_dflash_dir)
    save_dflash(d, tmp_path / "out")
    d2 = load_dflash(tmp_path / "out")
    for k, v in d.state_dict().items():
        assert torch.equal(v, d2.state_dict()[k])
    assert DFlashConfig.from_dict(json.loads((tmp_path / "out" / "config.json").read_text())).block_size == 4


def _step_inputs(d, ctx_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = d.config
    th = torch.randn(1, ctx_len, 2 * cfg.hidden_size, generator=g)
    ids = torch.tensor([[11] + [cfg.mask_token_id] * (cfg.block_size - 1)])
    emb = d.embed_block(ids, torch.randn(TINY_VOCAB, cfg.hidden_size, generator=g))
    return th, emb


@torch.no_grad()
def test_cached_context_equals_one_shot(tiny_dflash_dir):
    """Context fed in two calls through the KV cache gives the same block states as in one call."""
    d = load_dflash(tiny_dflash_dir)
    blk = d.config.block_size
    th, emb = _step_inputs(d, 10)
    h_full, kv_full = d(emb, th, torch.arange(10 + blk)[None])
    _, kv = d(emb, th[:, :6], torch.arange(6 + blk)[None])
    h_two, kv_two = d(emb, th[:, 6:], torch.arange(6, 10 + blk)[None], past_kv=kv)
    torch.testing.assert_close(h_two, h_full, atol=1e-5, rtol=1e-5)
    assert kv_two[0][0].shape[2] == 10  # context only: block keys are never cached


@torch.no_grad()
def test_query_scale_acts_after_q_norm(tiny_dflash_dir):
    d = load_dflash(tiny_dflash_dir)
    th, emb = _step_inputs(d, 7)
    pos = torch.arange(7 + d.config.block_size)[None]
    h0, _ = d(emb, th, pos)
    h_beta, _ = d(emb, th, pos, query_scale=1.4)
    for layer in d.layers:  # scaling q_proj is erased by q_norm: beta must come after it
        layer.self_attn.q_proj.weight.mul_(1.4)
    h_proj, _ = d(emb, th, pos)
    torch.testing.assert_close(h_proj, h0, atol=1e-5, rtol=1e-5)
    assert (h_beta - h0).abs().max() > 1e-3


@pytest.mark.parametrize("per_query,fold", [(False, True), (True, True), (True, False)],
                         ids=["per-key mask", "per-query window mask", "per-query, the fusable repeated form"])
def test_grouped_attention_equals_repeated_heads(tiny_dflash_dir, tmp_path, per_query, fold):
    """The eager attention folds grouped-query heads into the query rows for every mask shape (no K/V repeated per
    head in the exported graph): equal to the textbook form with K/V repeated per head (repeat_interleave) under a
    per-key mask and under a sliding layer's per-query mask."""
    from runtime.models.layers import apply_rope, rope_cos_sin

    drafter = load_dflash(write_tiny_dflash(tmp_path / "swa", sliding_window=5) if per_query else tiny_dflash_dir)
    attn = drafter.layers[0].self_attn
    attn.fold_per_query_masks = fold
    torch.manual_seed(0)
    b, blk, ctx_len, cfg = 2, 4, 9, drafter.config
    h = torch.randn(b, blk, cfg.hidden_size)
    ctx_k = torch.randn(b, cfg.num_key_value_heads, ctx_len, cfg.head_dim)
    ctx_v = torch.randn(b, cfg.num_key_value_heads, ctx_len, cfg.head_dim)
    pos = torch.arange(ctx_len, ctx_len + blk)[None].expand(b, -1)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)
    key_mask = torch.ones(b, ctx_len + blk, dtype=torch.bool)
    key_mask[1, 6:ctx_len] = False  # a right-padded row: a hole in its cache
    if per_query:
        key_pos = torch.arange(ctx_len + blk)[None].expand(b, -1)
        mask = drafter.window_mask(key_pos, pos, 5, key_mask[:, None, None, :])
        assert mask.shape == (b, 1, blk, ctx_len + blk) and not bool((mask == mask[:, :, :1]).all())
    else:
        mask = key_mask[:, None, None, :]
    with torch.no_grad():
        got = attn(h, ctx_k, ctx_v, cos, sin, mask)
        # reference: the same projections, K/V repeated per head, one softmax per head
        heads = lambda x, n: x.view(b, blk, n, cfg.head_dim).transpose(1, 2)  # noqa: E731
        q = apply_rope(attn.q_norm(heads(attn.q_proj(h), cfg.num_attention_heads)), cos, sin)
        k = torch.cat([ctx_k, apply_rope(attn.k_norm(heads(attn.k_proj(h), cfg.num_key_value_heads)), cos, sin)], 2)
        v = torch.cat([ctx_v, heads(attn.v_proj(h), cfg.num_key_value_heads)], 2)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * attn.scaling
        scores = scores.masked_fill(~mask, float("-inf"))
        ref = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, blk, -1)
        ref = attn.o_proj(ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
