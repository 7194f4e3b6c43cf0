"""plugins.trtllm_patch on a stand-in TensorRT-LLM module tree (TensorRT-LLM itself cannot be installed here).

The stand-ins mirror, by name, signature and attribute, what the patch hooks in NVIDIA/TensorRT-LLM main (2026-09):
- tensorrt_llm/_torch/attention/attention.py @930bd1a7: Attention.forward -> qkv_proj -> preprocess_qkv(qkv,
  position_ids) [-> apply_rope, overridden by q/k-norm subclasses; RoPE skipped when rope_fusion] -> convert_qkv ->
  forward_impl(q, k, v, attn_metadata, ...); attributes q_size, kv_size, support_fused_qkv, rope_fusion, attn.
- tensorrt_llm/_torch/models/modeling_speculative.py @00679c66: Eagle3Attention(Attention), Eagle3MLAttention,
  Eagle3DecoderLayer (self_attn), Eagle3DraftModel (midlayer), PARDForCausalLM (draft_model_full / model).
- tensorrt_llm/_torch/models/modeling_dflash.py @7c7504c0: DFlashForCausalLM.dflash_forward(noise_embedding,
  query_positions, num_ctx_per_req, ctx_k_cache, ctx_v_cache, ctx_cache_batch_idx, ...) calling
  self._dflash_flash_attention(q=, k_cache=, v_cache=, cache_seqlens=, cache_batch_idx=, causal=, window_size=) or
  self._dflash_trtllm_gen_ops.batch_decode_with_kv_cache(query=, ..., seq_lens=, window_left=, ...) with
  seq_lens = num_ctx_per_req + block_size; DFlashTrtllmGenOps is a frozen dataclass
  (tensorrt_llm/_torch/speculative/dflash_attention.py @58ae162a).
- tensorrt_llm/_torch/attention/backends/fmha/interface.py @b0a6e828: FmhaParams (slots dataclass) with attn,
  qkv_or_q, use_logn_scaling, logn_scaling_ptr, to_thop_params().
The expected beta values are computed here from the paper's formula, independently of plugins.rule.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch
from torch import nn

from plugins import trtllm_patch as tp
from plugins.rule import QueryScaleProfile
from plugins.trtllm_tables import logn_scaling_table

REF = 64
PROF = QueryScaleProfile(ref_keys=REF)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def expected_beta(n: int, ref: int = REF) -> float:
    r = max((n - 32) / (ref - 32), 1.0)
    return min(math.exp(0.5), 1.0 + math.log(r) / 5.0)


# ------------------------------------------------------------------------------------------------ stand-in tree
def _rope(x, pos):  # neox RoPE on [T, heads * hd]
    t = x.view(x.shape[0], -1, HEAD_DIM)
    half = HEAD_DIM // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = pos.reshape(-1, 1, 1).float() * inv
    a, b = t[..., :half], t[..., half:]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).reshape_as(x)


def _build_tree(*, drop: tuple[str, str] | None = None, with_fmha: bool = True) -> dict[str, types.ModuleType]:
    class TrtllmAttention:  # the op backend held in Attention.attn
        def __init__(self):
            self.seen_q = None

    class Attention(nn.Module):
        def __init__(self, *, hidden_size=32, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     max_position_embeddings=4096, rope_fusion=False, fused_qkv=False, q_norm=False):
            super().__init__()
            self.num_heads, self.num_key_value_heads, self.head_dim = num_attention_heads, num_key_value_heads, HEAD_DIM
            self.q_size, self.kv_size = self.num_heads * HEAD_DIM, self.num_key_value_heads * HEAD_DIM
            self.max_position_embeddings, self.rope_fusion = max_position_embeddings, rope_fusion
            self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=False)
            self.attn = TrtllmAttention()
            self.support_fused_qkv = fused_qkv
            self.attn_output_gate = False
            self.seen = []

        def split_qkv(self, q, k=None, v=None):
            if k is None and v is None:
                q, k, v = q.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return q, k, v

        def convert_qkv(self, q, k, v):
            if k is None and v is None and not self.support_fused_qkv:
                q, k, v = self.split_qkv(q)
            elif k is not None and v is not None and self.support_fused_qkv:
                q, k, v = torch.cat([q, k, v], -1), None, None
            return q, k, v

        def apply_rope(self, q, k, v, position_ids):
            if not self.rope_fusion and position_ids is not None:
                q, k, v = self.split_qkv(q, k, v)
                q, k = _rope(q, position_ids), _rope(k, position_ids)
            return q, k, v

        def preprocess_qkv(self, qkv, position_ids):
            q, k, v = self.apply_rope(qkv, None, None, position_ids)
            return q, k, v, None

        def forward_impl(self, q, k, v, attn_metadata, attention_mask, attention_window_size, attention_mask_data,
                         mrope_config, **kwargs):
            self.seen.append((q.clone(), None if k is None else k.clone()))
            return q[:, : self.q_size]

        def forward(self, position_ids, hidden_states, attn_metadata, attention_mask="causal", mrope_config=None,
                    all_reduce_params=None, lora_params=None, attention_window_size=None, attention_mask_data=None,
                    **kwargs):
            qkv = self.qkv_proj(hidden_states)
            q, k, v, gate = self.preprocess_qkv(qkv, position_ids)
            q, k, v = self.convert_qkv(q, k, v)
            return self.forward_impl(q, k, v, attn_metadata, attention_mask, attention_window_size,
                                     attention_mask_data, mrope_config=mrope_config)

    class Qwen3Attention(Attention):  # a target-architecture attention with q/k RMS norm inside apply_rope
        def apply_rope(self, q, k, v, position_ids):
            q, k, v = self.split_qkv(q, k, v)
            q = nn.functional.rms_norm(q.view(q.shape[0], -1, HEAD_DIM), (HEAD_DIM,)).reshape_as(q)
            k = nn.functional.rms_norm(k.view(k.shape[0], -1, HEAD_DIM), (HEAD_DIM,)).reshape_as(k)
            return super().apply_rope(q, k, v, position_ids)

    class Eagle3Attention(Attention):
        pass

    class Eagle3MLAttention(nn.Module):
        pass

    class Eagle3DecoderLayer(nn.Module):
        def __init__(self, use_mla=False, **attn_kw):
            super().__init__()
            self.self_attn = Eagle3MLAttention() if use_mla else Eagle3Attention(**attn_kw)

    class Eagle3DraftModel(nn.Module):
        def __init__(self, model_config=None, start_layer_idx=0, use_mla=False):
            super().__init__()
            self.midlayer = Eagle3DecoderLayer(use_mla, **(model_config or {}))

    class _Inner(nn.Module):
        def __init__(self, **attn_kw):
            super().__init__()
            self.layers = nn.ModuleList([nn.Module()])
            self.layers[0].self_attn = Qwen3Attention(**attn_kw)

    class _TargetArchForCausalLM(nn.Module):
        def __init__(self, **attn_kw):
            super().__init__()
            self.model = _Inner(**attn_kw)
            self.lm_head = nn.Identity()

    class PARDForCausalLM(nn.Module):
        def __init__(self, draft_config):
            super().__init__()
            self.draft_model_full = _TargetArchForCausalLM(**draft_config)
            self.model = self.draft_model_full.model
            self.lm_head = self.draft_model_full.lm_head

    @dataclasses.dataclass(frozen=True)
    class DFlashTrtllmGenOps:
        append_paged_kv_cache: object
        batch_context_with_kv_cache: object
        batch_decode_with_kv_cache: object
        get_multi_ctas_kv_counter_size: object
        get_workspace_size: object

    class DFlashForCausalLM(nn.Module):
        def __init__(self, draft_config=None, *, dflash_attention_backend="VANILLA"):
            super().__init__()
            self.dflash_attention_backend = dflash_attention_backend
            self.qkv = nn.Linear(32, HEADS * HEAD_DIM, bias=False)
            self.kernel_q = []
            if dflash_attention_backend == "VANILLA":
                def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, causal,
                                            window_size):
                    self.kernel_q.append(q.clone())
                    return torch.zeros_like(q)
                self._dflash_flash_attention = flash_attn_with_kvcache
            else:
                def decode(*, query, kv_cache, seq_lens, window_left, out, **kw):
                    self.kernel_q.append(query.clone())
                    out.zero_()
                self._dflash_trtllm_gen_ops = DFlashTrtllmGenOps(None, decode, decode, None, None)
            self.window_size = (-1, -1)

        def dflash_forward(self, noise_embedding, query_positions, num_ctx_per_req, ctx_k_cache, ctx_v_cache,
                           ctx_cache_batch_idx, ctx_kv_cache=None, ctx_page_table=None):
            B, blk = noise_embedding.shape[:2]
            q = _rope(self.qkv(noise_embedding.reshape(B * blk, -1)), query_positions.reshape(-1))
            Q = q.view(B, blk, HEADS, HEAD_DIM)
            seq_lens_after = num_ctx_per_req[:B].to(torch.int32) + blk
            if self.dflash_attention_backend == "VANILLA":
                out = self._dflash_flash_attention(q=Q, k_cache=ctx_k_cache, v_cache=ctx_v_cache,
                                                   cache_seqlens=seq_lens_after, cache_batch_idx=ctx_cache_batch_idx,
                                                   causal=False, window_size=self.window_size)
            else:
                out = torch.empty_like(Q)
                self._dflash_trtllm_gen_ops.batch_decode_with_kv_cache(
                    query=Q.reshape(-1, HEADS, HEAD_DIM), kv_cache=ctx_kv_cache, seq_lens=seq_lens_after,
                    window_left=self.window_size[0], out=out.reshape(-1, HEADS, HEAD_DIM))
            return out.reshape(B * blk, -1)

    class DFlashLagunaForCausalLM(DFlashForCausalLM):  # a subclass whose block decode calls super()
        def dflash_forward(self, *args, **kwargs):
            return super().dflash_forward(*args, **kwargs)

    @dataclasses.dataclass(slots=True)
    class FmhaParams:
        attn: object = None
        qkv_or_q: object = None
        use_logn_scaling: bool = False
        logn_scaling_ptr: object = None

        def to_thop_params(self, context=None):
            return types.SimpleNamespace(use_logn_scaling=self.use_logn_scaling,
                                         logn_scaling_ptr=self.logn_scaling_ptr)

    def mod(name, **attrs):
        m = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    tree = {
        "tensorrt_llm": mod("tensorrt_llm", __version__="9.9.9-standin"),
        "tensorrt_llm._torch": mod("tensorrt_llm._torch"),
        "tensorrt_llm._torch.attention": mod("tensorrt_llm._torch.attention"),
        "tensorrt_llm._torch.attention.attention": mod("tensorrt_llm._torch.attention.attention",
                                                        Attention=Attention),
        "tensorrt_llm._torch.models": mod("tensorrt_llm._torch.models"),
        "tensorrt_llm._torch.models.modeling_speculative": mod(
            "tensorrt_llm._torch.models.modeling_speculative", Attention=Attention, Eagle3Attention=Eagle3Attention,
            Eagle3MLAttention=Eagle3MLAttention, Eagle3DecoderLayer=Eagle3DecoderLayer,
            Eagle3DraftModel=Eagle3DraftModel, PARDForCausalLM=PARDForCausalLM),
        "tensorrt_llm._torch.models.modeling_dflash": mod("tensorrt_llm._torch.models.modeling_dflash",
                                                          DFlashForCausalLM=DFlashForCausalLM,
                                                          DFlashLagunaForCausalLM=DFlashLagunaForCausalLM),
        "tensorrt_llm._torch.models.modeling_qwen3": mod("tensorrt_llm._torch.models.modeling_qwen3",
                                                         Qwen3Attention=Qwen3Attention),
    }
    if with_fmha:
        tree["tensorrt_llm._torch.attention.backends.fmha.interface"] = mod(
            "tensorrt_llm._torch.attention.backends.fmha.interface", FmhaParams=FmhaParams)
    if drop is not None:
        delattr(tree[drop[0]], drop[1])
    return tree


@pytest.fixture
def trt(monkeypatch):
    """Install the stand-in tree into sys.modules; always leave the patch uninstalled afterwards."""
    def make(**kw):
        tree = _build_tree(**kw)
        for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
            monkeypatch.delitem(sys.modules, name)
        for name, m in tree.items():
            monkeypatch.setitem(sys.modules, name, m)
        return types.SimpleNamespace(**{n.rsplit(".", 1)[-1]: m for n, m in tree.items()})

    tp.uninstall()
    yield make
    tp.uninstall()


# Positions straddling ref_keys = 64: N = 1, 63, 64 (beta 1), 65, 66, 501, 4001 (beta > 1, all different).
POS = torch.tensor([0, 62, 63, 64, 65, 500, 4000])


def _run_attention(attn, pos=POS, seed=0):
    torch.manual_seed(seed)
    h = torch.randn(len(pos), 32)
    attn.seen.clear()
    attn(position_ids=pos.view(1, -1), hidden_states=h, attn_metadata=None)
    return attn.seen[-1]


def _expected_ratios(pos):
    return torch.tensor([expected_beta(int(p) + 1) for p in pos], dtype=torch.float32)


def _assert_rows_scaled(scaled, base, pos, cols=slice(None)):
    ratios = _expected_ratios(pos)
    assert ratios[:3].eq(1.0).all() and (ratios[3:].diff() > 0).all()  # the test data straddles ref_keys
    torch.testing.assert_close(scaled[:, cols], base[:, cols] * ratios[:, None], rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------ tests
def test_pure_visible_keys_and_block_scale():
    assert tp.causal_visible_keys(torch.tensor([[0, 5, 9]]), 2).tolist() == [1, 6]
    with pytest.raises(ValueError, match="position_ids=None"):
        tp.causal_visible_keys(None, 3)
    with pytest.raises(ValueError, match="2 entries for 3"):
        tp.causal_visible_keys(torch.tensor([1, 2]), 3)
    kv = torch.tensor([14, 104])
    assert tp.block_visible_keys(kv).tolist() == [14, 104]
    assert tp.block_visible_keys(kv, tp.window_left_of((49, 49))).tolist() == [14, 50]
    assert tp.window_left_of((-1, -1)) is None and tp.window_left_of(None) is None and tp.window_left_of(7) == 7
    q = torch.ones(2 * 4, 3, 2, dtype=torch.bfloat16)  # trtllm-gen layout [B*blk, h, d]
    out = tp.scale_block_query(q, torch.tensor([14, 104]), PROF)
    assert out.dtype == torch.bfloat16 and out[:4].eq(1).all()
    assert out[4:].float().sub(expected_beta(104)).abs().max() < 1e-2 and expected_beta(104) > 1.1
    with pytest.raises(ValueError, match="multiple of the batch"):
        tp.scale_block_query(torch.ones(5, 3, 2), torch.tensor([1, 2]), PROF)


def test_eagle3_multiply_scales_drafter_q_only(trt):
    m = trt()
    target = m.modeling_qwen3.Qwen3Attention()
    target_base = _run_attention(target)[0]
    draft = m.modeling_speculative.Eagle3DraftModel()
    base_q, base_k = _run_attention(draft.midlayer.self_attn)

    report = tp.install_query_scale({"eagle3": PROF})
    assert report.routes == {"eagle3": "multiply"} and "Eagle3DraftModel.__init__" in report.hooks["eagle3"]
    draft2 = m.modeling_speculative.Eagle3DraftModel()
    draft2.load_state_dict(draft.state_dict())
    q, k = _run_attention(draft2.midlayer.self_attn)
    _assert_rows_scaled(q, base_q, POS)
    assert torch.equal(k, base_k)  # keys untouched
    assert torch.equal(_run_attention(target)[0], target_base)  # not a drafter: untouched
    assert tp.stats()["eagle3"]["q_scaled"] == 1


def test_eagle3_fused_rope_fused_qkv_scales_only_q_columns(trt):
    m = trt()
    cfg = dict(rope_fusion=True, fused_qkv=True)  # no q-norm: apply_rope returns the fused qkv (k, v None)
    draft = m.modeling_speculative.Eagle3DraftModel(cfg)
    attn = draft.midlayer.self_attn
    base_q, base_k = _run_attention(attn)
    assert base_k is None and base_q.shape[1] == attn.q_size + 2 * attn.kv_size
    tp.install_query_scale({"eagle3": PROF})
    tp.apply_to_model(draft, "eagle3")
    q, _ = _run_attention(attn)
    _assert_rows_scaled(q, base_q, POS, cols=slice(0, attn.q_size))
    assert torch.equal(q[:, attn.q_size:], base_q[:, attn.q_size:])


def test_pard_scales_after_q_norm_fused_qkv_and_leaves_target_alone(trt):
    m = trt()
    cfg = dict(rope_fusion=True, fused_qkv=True)  # TRTLLM backend: RoPE in the op, fused qkv into the op
    target = m.modeling_qwen3.Qwen3Attention(**cfg)  # same class as the PARD drafter's layers
    draft = m.modeling_speculative.PARDForCausalLM(cfg)
    attn = draft.model.layers[0].self_attn
    attn.load_state_dict(target.state_dict())
    base_q, _ = _run_attention(attn)
    assert base_q.shape[1] == attn.q_size + 2 * attn.kv_size  # fused layout reaches the op

    tp.install_query_scale({"pard": QueryScaleProfile(ref_keys=REF)})
    tp.apply_to_model(draft, "pard")  # built before install: patch it explicitly
    assert tp.apply_to_model(draft, "pard") == 0  # idempotent per module
    q, _ = _run_attention(attn)
    _assert_rows_scaled(q, base_q, POS, cols=slice(0, attn.q_size))  # post-q-norm q scaled
    assert torch.equal(q[:, attn.q_size:], base_q[:, attn.q_size:])  # k, v columns untouched
    assert torch.equal(_run_attention(target)[0], base_q)  # target instance of the same class untouched

    new_draft = m.modeling_speculative.PARDForCausalLM(cfg)  # built after install: patched by __init__ hook
    new_draft.model.layers[0].self_attn.load_state_dict(target.state_dict())
    _assert_rows_scaled(_run_attention(new_draft.model.layers[0].self_attn)[0], base_q, POS, slice(0, attn.q_size))


@pytest.mark.parametrize("backend", ["VANILLA", "TRTLLM"])
def test_dflash_block_uses_s_plus_B_per_request(trt, backend):
    m = trt()
    D = m.modeling_dflash.DFlashForCausalLM
    B, blk = 2, 4
    ctx = torch.tensor([10, 100])  # N = 14 (beta 1) and 104 (beta > 1)
    args = dict(noise_embedding=torch.randn(B, blk, 32),
                query_positions=ctx[:, None] + torch.arange(blk), num_ctx_per_req=ctx,
                ctx_k_cache=None, ctx_v_cache=None, ctx_cache_batch_idx=torch.arange(B))
    model = D(dflash_attention_backend=backend)
    model.dflash_forward(**args)
    base = model.kernel_q[-1].reshape(B, blk, HEADS, HEAD_DIM)
    original_kernel = model.__dict__.get("_dflash_flash_attention", model.__dict__.get("_dflash_trtllm_gen_ops"))

    tp.install_query_scale({"dflash": PROF})
    model.dflash_forward(**args)
    q = model.kernel_q[-1].reshape(B, blk, HEADS, HEAD_DIM)
    assert torch.equal(q[0], base[0])  # N = 14 <= ref: beta 1 for every slot
    torch.testing.assert_close(q[1], base[1] * expected_beta(104), rtol=2e-6, atol=1e-7)  # same beta all slots
    assert expected_beta(104) > 1.1
    # the instance's kernel attribute is restored after the call
    assert model.__dict__.get("_dflash_flash_attention", model.__dict__.get("_dflash_trtllm_gen_ops")) \
        is original_kernel

    model.window_size = (49, 49)  # sliding-window layer: N = min(s + B, W) = 50 -> beta(50)
    model.dflash_forward(**args)
    q = model.kernel_q[-1].reshape(B, blk, HEADS, HEAD_DIM)
    torch.testing.assert_close(q[1], base[1] * expected_beta(50), rtol=2e-6, atol=1e-7)


def test_dflash_subclass_override_is_scaled_once_and_restored(trt):
    m = trt()
    L = m.modeling_dflash.DFlashLagunaForCausalLM
    own = L.__dict__["dflash_forward"]
    ctx = torch.tensor([100])
    args = (torch.randn(1, 4, 32), ctx[:, None] + torch.arange(4), ctx, None, None, torch.tensor([0]))
    model = L()
    model.dflash_forward(*args)
    base = model.kernel_q[-1]
    tp.install_query_scale({"dflash": PROF})
    assert L.__dict__["dflash_forward"] is not own
    model.dflash_forward(*args)
    torch.testing.assert_close(model.kernel_q[-1], base * expected_beta(104), rtol=2e-6, atol=1e-7)  # not beta^2
    tp.uninstall()
    assert L.__dict__["dflash_forward"] is own


def test_double_install_is_noop_and_uninstall_restores(trt):
    m = trt()
    spec, dfl = m.modeling_speculative, m.modeling_dflash
    before = {
        "init_e3": spec.Eagle3DraftModel.__dict__["__init__"], "init_pard": spec.PARDForCausalLM.__dict__["__init__"],
        "dflash": dfl.DFlashForCausalLM.__dict__["dflash_forward"],
    }
    draft = spec.Eagle3DraftModel()
    base_q, _ = _run_attention(draft.midlayer.self_attn)
    profiles = {f: PROF for f in ("eagle3", "pard", "dflash")}
    r1 = tp.install_query_scale(profiles)
    r2 = tp.install_query_scale(dict(profiles))
    assert r1 is r2
    tp.apply_to_model(draft, "eagle3")
    q, _ = _run_attention(draft.midlayer.self_attn)
    _assert_rows_scaled(q, base_q, POS)  # scaled once (beta, not beta^2)
    with pytest.raises(RuntimeError, match="uninstall"):
        tp.install_query_scale({"eagle3": QueryScaleProfile(ref_keys=128)})

    assert tp.uninstall() is True and tp.uninstall() is False
    assert spec.Eagle3DraftModel.__dict__["__init__"] is before["init_e3"]
    assert spec.PARDForCausalLM.__dict__["__init__"] is before["init_pard"]
    assert dfl.DFlashForCausalLM.__dict__["dflash_forward"] is before["dflash"]
    assert "preprocess_qkv" not in draft.midlayer.self_attn.__dict__
    assert torch.equal(_run_attention(draft.midlayer.self_attn)[0], base_q)
    assert tp.installed() is None and tp.stats() == {}


def test_logn_table_route_sets_fmha_params_for_drafter_layers_only(trt):
    m = trt()
    draft = m.modeling_speculative.Eagle3DraftModel()
    target = m.modeling_qwen3.Qwen3Attention()
    base_q, _ = _run_attention(draft.midlayer.self_attn)
    report = tp.install_query_scale({"eagle3": PROF, "dflash": PROF}, route="logn_table", logn_table_length=256)
    assert report.routes == {"eagle3": "logn_table", "dflash": "multiply"}
    tp.apply_to_model(draft, "eagle3")
    assert torch.equal(_run_attention(draft.midlayer.self_attn)[0], base_q)  # no PyTorch multiply on this route
    F = m.interface.FmhaParams
    lowered = F(attn=draft.midlayer.self_attn.attn, qkv_or_q=torch.zeros(1)).to_thop_params()
    assert lowered.use_logn_scaling is True
    assert torch.equal(lowered.logn_scaling_ptr, logn_scaling_table(256, PROF))
    assert lowered.logn_scaling_ptr[63].item() == 1.0 and lowered.logn_scaling_ptr[64].item() > 1.0
    plain = F(attn=target.attn, qkv_or_q=torch.zeros(1)).to_thop_params()
    assert plain.use_logn_scaling is False and plain.logn_scaling_ptr is None
    assert tp.stats()["eagle3"]["logn_applied"] == 1
    tp.uninstall()
    assert "_sharpdraft_logn_route" not in draft.midlayer.self_attn.attn.__dict__
    assert F(attn=draft.midlayer.self_attn.attn).to_thop_params().use_logn_scaling is False


@pytest.mark.parametrize("drop, missing", [
    (("tensorrt_llm._torch.models.modeling_speculative", "PARDForCausalLM"), "modeling_speculative.PARDForCausalLM"),
    (("tensorrt_llm._torch.models.modeling_speculative", "Eagle3Attention"), "modeling_speculative.Eagle3Attention"),
    (("tensorrt_llm._torch.attention.attention", "Attention"), "Attention in any of"),
])
def test_missing_structure_raises_clear_error_and_patches_nothing(trt, drop, missing):
    m = trt(drop=drop)
    init = m.modeling_dflash.DFlashForCausalLM.__dict__["dflash_forward"]
    with pytest.raises(tp.TrtllmStructureError) as e:
        tp.install_query_scale()
    msg = str(e.value)
    assert msg.startswith("TensorRT-LLM 9.9.9-standin lacks ") and missing in msg and "supported: " in msg
    assert tp.installed() is None
    assert m.modeling_dflash.DFlashForCausalLM.__dict__["dflash_forward"] is init  # nothing half-patched


def test_missing_attention_method_and_fmha_fields(trt):
    m = trt()
    del m.attention.Attention.preprocess_qkv, m.attention.Attention.apply_rope
    with pytest.raises(tp.TrtllmStructureError, match="preprocess_qkv or apply_rope"):
        tp.install_query_scale({"pard": PROF})
    m = trt(with_fmha=False)
    with pytest.raises(tp.TrtllmStructureError, match="FmhaParams"):
        tp.install_query_scale({"pard": PROF}, route="logn_table")


def test_unsupported_drafter_layers_and_missing_kernel_raise(trt):
    m = trt()
    tp.install_query_scale({"eagle3": PROF, "dflash": PROF})
    with pytest.raises(tp.TrtllmStructureError, match="Eagle3MLAttention"):
        m.modeling_speculative.Eagle3DraftModel(use_mla=True)
    d = m.modeling_dflash.DFlashForCausalLM()
    del d._dflash_flash_attention
    with pytest.raises(tp.TrtllmStructureError, match="kernel attributes"):
        d.dflash_forward(torch.zeros(1, 2, 32), torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]),
                         None, None, torch.tensor([0]))


def test_no_tensorrt_llm_is_a_clear_import_error(monkeypatch):
    tp.uninstall()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(ImportError, match="needs TensorRT-LLM"):
        tp.install_query_scale()
    with pytest.raises(ValueError, match="route"):
        tp.install_query_scale(route="table")
    with pytest.raises(ValueError, match="unknown drafter family"):
        tp.install_query_scale({"medusa": PROF})
