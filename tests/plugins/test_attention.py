"""The fused query-scale attention kernel (OpenAI Triton, under TRITON_INTERPRET=1 on CPU) against its torch
reference, and the reference against the rule.

Tolerances: fp32 inputs atol 2e-5 (measured ~5e-7: reassociation of the online softmax); fp16 / bf16 inputs
compare against the reference run on the same rounded inputs, atol 2e-3 / 1.6e-2 (the output's own rounding:
half an ulp at |out| <= 4 is 2e-3 in fp16, 1.6e-2 in bf16).
"""
import math

import pytest
import torch

from plugins.attention_ref import attention_ref, visible_keys
from plugins.rule import QueryScaleProfile

triton_attention = pytest.importorskip("plugins.triton_attention")
if triton_attention.triton is None:
    pytest.skip("OpenAI Triton is not installed", allow_module_level=True)
fused_attention, UnsupportedShape = triton_attention.fused_attention, triton_attention.UnsupportedShape

PROF = QueryScaleProfile(ref_keys=64)
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _qkv(b, h, kvh, q_len, kv, d, dtype=torch.float32, seed=0, mag=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, q_len, d, generator=g) * mag).to(dtype)
    k = (torch.randn(b, kvh, kv, d, generator=g) * mag).to(dtype)
    v = torch.randn(b, kvh, kv, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("b, h, kvh, q_len, kv, d, causal, window", [
    (1, 2, 2, 1, 1, 16, False, None),       # decode, one key
    (2, 4, 2, 5, 97, 32, False, None),      # odd lengths, q_len != kv_len, GQA 2
    (2, 6, 2, 8, 130, 64, True, None),      # verify block, GQA 3, causal with offset
    (3, 4, 1, 7, 203, 64, True, 50),        # sliding window, MQA
    (1, 2, 1, 16, 16, 128, True, None),     # q_len == kv_len (prefill-like), head_dim 128
])
def test_fused_matches_reference(b, h, kvh, q_len, kv, d, causal, window):
    q, k, v = _qkv(b, h, kvh, q_len, kv, d)
    lens = torch.tensor([kv - 3 * i for i in range(b)])  # per-sequence kv lengths in one batch
    out = fused_attention(q, k, v, lens, PROF, causal, window)
    ref = attention_ref(q, k, v, lens, PROF, causal, window)
    assert (out - ref).abs().max().item() < ATOL[torch.float32]


def test_non_contiguous_and_different_kv_layouts():
    q, k, v = _qkv(2, 4, 2, 6, 90, 32)
    q_nc = q.transpose(1, 2).contiguous().transpose(1, 2)  # [b, q_len, h, d] memory, viewed as [b, h, q_len, d]
    k_nc = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # K stored [b, kv, kvh, d]
    v_nc = torch.empty(2, 2, 32, 90).transpose(2, 3).copy_(v)  # V stored [b, kvh, d, kv]: another layout
    assert not q_nc.is_contiguous() and not k_nc.is_contiguous() and not v_nc.is_contiguous()
    out = fused_attention(q_nc, k_nc, v_nc, None, PROF, causal=True)
    assert (out - attention_ref(q, k, v, None, PROF, causal=True)).abs().max().item() < ATOL[torch.float32]


def test_rows_straddling_ref_keys_get_their_own_beta():
    """A causal block whose rows see N = ref-4 .. ref+3 keys: the first rows are unscaled, the later ones not."""
    q_len, kv = 8, 64 + 4
    q, k, v = _qkv(1, 2, 2, q_len, kv, 32, mag=3.0)
    n = visible_keys(torch.tensor([kv]), q_len, causal=True)[0]
    assert n.tolist() == list(range(64 - 3, 64 + 5))
    out = fused_attention(q, k, v, None, PROF, causal=True)
    frozen = attention_ref(q, k, v, None, None, causal=True)
    diff = (out - frozen).abs().amax(dim=(0, 1, 3))  # per query row
    assert diff[:4].max().item() < ATOL[torch.float32]  # N <= ref_keys: beta == 1
    assert diff[4:].min().item() > 1e-4  # N > ref_keys: beta > 1 changes the output
    assert (out - attention_ref(q, k, v, None, PROF, causal=True)).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v = _qkv(2, 4, 2, 4, 150, 64, dtype=dtype)
    out = fused_attention(q, k, v, None, PROF, causal=False)
    assert out.dtype == dtype
    ref = attention_ref(q, k, v, None, PROF, causal=False)  # same rounded inputs, fp32 math
    assert (out.float() - ref.float()).abs().max().item() < ATOL[dtype]


def test_large_magnitude_at_cap_does_not_overflow_fp16():
    """|q|, |k| ~ 60 in fp16 with N far above the cap's N (beta = e^0.5): scores ~ 1e4, no inf / NaN."""
    prof = QueryScaleProfile(ref_keys=40, top_k=32)
    kv = 600
    assert prof.beta(kv) == pytest.approx(math.exp(0.5))
    q, k, v = _qkv(1, 2, 1, 3, kv, 64, dtype=torch.float16, mag=60.0)
    out = fused_attention(q, k, v, None, prof, causal=False)
    assert torch.isfinite(out.float()).all()
    ref = attention_ref(q, k, v, None, prof, causal=False)
    assert (out.float() - ref.float()).abs().max().item() < ATOL[torch.float16]


def test_disabled_profile_is_plain_attention():
    q, k, v = _qkv(1, 2, 2, 4, 300, 32)
    plain = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), dim=-1) @ v
    out = fused_attention(q, k, v, None, QueryScaleProfile(ref_keys=64, enabled=False))
    assert (out - plain).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("kwargs, match", [
    ({"d": 24}, "power of two"), ({"d": 512}, "launch table"), ({"kvh": 3}, "multiple"),
    ({"lens": [2]}, "kv_lens"), ({"dtype": torch.float64}, "dtypes")])
def test_unsupported_shapes_raise(kwargs, match):
    d, kvh, dtype = kwargs.get("d", 32), kwargs.get("kvh", 2), kwargs.get("dtype", torch.float32)
    q, k, v = _qkv(1, 4, kvh, 4, 40, d, dtype=dtype)
    lens = torch.tensor(kwargs["lens"]) if "lens" in kwargs else None
    with pytest.raises(UnsupportedShape, match=match):
        fused_attention(q, k, v, lens, PROF, causal=True)


def test_reference_beta_follows_the_rule():
    """The reference's per-row scaling equals multiplying q by beta(N) from plugins/rule.py."""
    q, k, v = _qkv(1, 1, 1, 2, 500, 16, mag=2.0)
    out = attention_ref(q, k, v, None, PROF)
    b = PROF.beta(500)
    manual = torch.softmax((q * b) @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
    assert (out - manual).abs().max().item() < 1e-5


def test_torch_library_op_cpu_reference_and_interpreted_kernel(monkeypatch):
    from plugins import torch_op

    q, k, v = _qkv(2, 4, 2, 5, 80, 32)
    lens = torch.tensor([80, 71])
    ref = attention_ref(q, k, v, lens, PROF, causal=True, window=40)
    out = torch_op.attention(q, k, v, lens, PROF, causal=True, window=40)
    assert (out - ref).abs().max().item() < 1e-6
    monkeypatch.setenv("SHARPDRAFT_TRITON_CPU", "1")
    out = torch_op.attention(q, k, v, lens, PROF, causal=True, window=40)
    assert (out - ref).abs().max().item() < ATOL[torch.float32]


def test_torch_library_op_opcheck_and_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from plugins import torch_op  # noqa: F401 - registers the op

    q, k, v = _qkv(1, 4, 2, 3, 40, 16)
    args = (q, k, v, torch.tensor([40]), None, 64, 32, 5.0, math.exp(0.5), True, False, 0, 0.0)
    torch.library.opcheck(torch.ops.sharpdraft.query_scaled_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out = torch.ops.sharpdraft.query_scaled_attention(fq, fk, fv, mode.from_tensor(torch.tensor([40])), None, 64, 32,
                                                          5.0, 1.6, True, False, 0, 0.0)
        assert tuple(out.shape) == (1, 4, 3, 16) and out.dtype == torch.float32


def test_gpu_benchmark_script_smoke_on_cpu(tmp_path):
    """The GPU benchmark runs end to end (tiny shapes, CPU interpreter) and its three paths agree."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "bench_attention_gpu.py"), "--device", "cpu",
                        "--smoke", "--dtype", "fp32", "--json-out", str(out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(row["max_abs_diff_vs_sdpa_mul"] < 1e-5 for row in rows)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 30), (False, 30), (False, 3)])
def test_key_mask_holes_count_only_visible_keys(causal, window):
    """A ragged batch right-padded piecewise (past | context | block): holes in the key mask are hidden, positions
    are ranks among the present keys, so a row with holes equals the same row with the holes cut out (windows
    included: a window counts positions, not indices)."""
    prof = QueryScaleProfile(ref_keys=12, top_k=2)
    q, k, v = _qkv(2, 4, 2, 6, 120, 32, mag=2.0)
    mask = torch.ones(2, 120, dtype=torch.bool)
    mask[1, 50:83] = False  # a 33-key hole inside row 1
    mask[1, 100:102] = False  # and one of 2 keys where a window of 30 starts
    lens = torch.tensor([120, 110])
    out = fused_attention(q, k, v, lens, prof, causal, window, key_mask=mask)
    ref = attention_ref(q, k, v, lens, prof, causal, window, key_mask=mask)
    assert (out - ref).abs().max().item() < ATOL[torch.float32]
    keep = mask[1, :110]
    solo = attention_ref(q[1:], k[1:, :, :110][:, :, keep], v[1:, :, :110][:, :, keep], None, prof, causal, window)
    assert (out[1:] - solo).abs().max().item() < ATOL[torch.float32]
    assert (ref[1:] - solo).abs().max().item() < 1e-6
    n_row1 = visible_keys(torch.tensor([110 - 35]), 6, causal, window)[0]
    assert window == 3 or prof.beta(int(n_row1.min())) > 1.0  # every row is scaled, so a wrong N would show


@pytest.mark.parametrize("q_len, window", [(8, 40), (8, 5), (16, 100)])
def test_block_window_matches_dflash_sliding_mask(q_len, window):
    """The non-causal window (DFlash sliding layers) against the drafter's own mask: a block query at position p
    sees the keys at positions > p - W and the whole block (runtime.models.dflash.DFlashDrafter.window_mask), with
    beta(N) from that mask's row counts; a ragged row (cache holes) included."""
    from plugins.rule import beta_torch, count_visible
    from runtime.models.dflash import DFlashDrafter

    prof = QueryScaleProfile(ref_keys=4, top_k=2)
    c_past, c_new, heads, kvh, d = 90, 5, 4, 2, 32
    kv = c_past + c_new + q_len
    q, k, v = _qkv(2, heads, kvh, q_len, kv, d, mag=2.0, seed=3)
    key_mask = torch.ones(2, kv, dtype=torch.bool)
    key_mask[1, 61:c_past] = False  # row 1 has 61 cached keys (then holes), row 0 has 90
    valid_past = torch.tensor([c_past, 61])
    pos_new = valid_past[:, None] + torch.arange(c_new + q_len)[None]  # new context rows, then the block
    key_pos = torch.cat([torch.arange(c_past)[None].expand(2, -1), pos_new], dim=1)
    mask = DFlashDrafter.window_mask(key_pos, pos_new[:, c_new:], window, key_mask[:, None, None, :])  # [b,1,B,kv]
    beta = beta_torch(count_visible(mask), prof)  # [b, 1, B, 1]
    rep = heads // kvh
    scores = (q * beta * d ** -0.5) @ k.repeat_interleave(rep, 1).transpose(-1, -2)
    oracle = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v.repeat_interleave(rep, 1)
    ref = attention_ref(q, k, v, None, prof, causal=False, window=window, key_mask=key_mask)
    out = fused_attention(q, k, v, None, prof, False, window, key_mask=key_mask)
    assert (ref - oracle).abs().max().item() < 1e-5
    assert (out - oracle).abs().max().item() < ATOL[torch.float32]


def test_row_that_sees_no_key_outputs_zeros():
    q, k, v = _qkv(2, 2, 2, 3, 40, 16)
    mask = torch.ones(2, 40, dtype=torch.int32)
    mask[0] = 0
    out = fused_attention(q, k, v, None, PROF, key_mask=mask)
    ref = attention_ref(q, k, v, None, PROF, key_mask=mask)
    assert torch.isfinite(ref).all() and out[0].abs().max().item() == 0.0 and ref[0].abs().max().item() == 0.0
    assert (out - ref).abs().max().item() < ATOL[torch.float32]
