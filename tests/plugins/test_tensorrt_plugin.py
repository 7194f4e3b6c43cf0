"""The TensorRT quickly-deployable plugin: argument plumbing, AOT compilation to PTX (no GPU needed), and the
register/aot_impl wiring driven through a stand-in of ``tensorrt.plugin`` (TensorRT itself is not installable here).
"""
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from plugins import tensorrt_plugin as tp
from plugins.attention_ref import attention_ref

ta = pytest.importorskip("plugins.triton_attention")
if ta.triton is None:
    pytest.skip("OpenAI Triton is not installed", allow_module_level=True)

ATTRS = tp.Attributes(ref_keys=48, top_k=32, slope=5.0, cap=1.6487212707001282, enabled=1, causal=0, window=0,
                      scale=0.125)


def _compile_out_of_process(dtype, head_dim, attrs, arch=90):
    """tp.compile_kernel in a fresh interpreter: tests run with TRITON_INTERPRET=1, which swaps triton.language for
    the CPU interpreter and so cannot compile for a GPU in the same process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys, dataclasses; from plugins import tensorrt_plugin as tp; "
            "a = tp.Attributes(**json.loads(sys.argv[3])); "
            "k = tp.compile_kernel(sys.argv[1], int(sys.argv[2]), a, int(sys.argv[4])); "
            "print(json.dumps(dataclasses.asdict(k)))")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code, dtype, str(head_dim), json.dumps(dataclasses.asdict(attrs)),
                        str(arch)], capture_output=True, text=True, cwd=root, env=env, timeout=300)
    if r.returncode:
        last = r.stderr.strip().splitlines()[-1]
        if "PluginConfigError" in last:
            raise tp.PluginConfigError(last)
        raise RuntimeError(r.stderr[-3000:])
    return tp.CompiledKernel(**json.loads(r.stdout.strip().splitlines()[-1]))


def test_int_args_are_the_strides_torch_uses_for_contiguous_tensors():
    q, k = torch.empty(2, 6, 5, 64), torch.empty(2, 3, 77, 64)
    mask = torch.empty(2, 77, dtype=torch.int32)
    args = tp.int_args(list(q.shape), list(k.shape), window=0)
    assert len(args) == len(ta.INT_ARGS)
    expected = [*q.stride(), *k.stride(), *k.stride(), *mask.stride(), *q.stride(), 5, 2, 0]
    assert args == expected
    assert tp.grid(list(q.shape), 16) == (1, 6, 2)


def test_kernel_launched_like_the_plugin_matches_the_reference():
    """Launch the kernel exactly as TensorRT's AOT path would (inputs, the plugin's integer arguments, output;
    contiguous buffers; constants from the attributes) under the interpreter, and compare with the reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 64, generator=g), torch.randn(2, 2, 100, 64, generator=g), \
        torch.randn(2, 2, 100, 64, generator=g)
    lens = torch.tensor([100, 100], dtype=torch.int32)
    mask = torch.ones(2, 100, dtype=torch.int32)
    mask[1, 30:60] = 0
    out = torch.empty_like(q)
    const = ta.kernel_constants(64, ATTRS.profile, False, None, True, ATTRS.scale)
    ints = tp.int_args(list(q.shape), list(k.shape), 0)
    ta._fused_attention_kernel[tp.grid(list(q.shape), const["BLOCK_M"])](q, k, v, lens, mask, *ints, out, **const,
                                                                         num_warps=4)
    ref = attention_ref(q, k, v, lens, ATTRS.profile, False, None, ATTRS.scale, key_mask=mask)
    assert (out - ref).abs().max().item() < 2e-5
    assert ATTRS.profile.beta(70) > 1.0  # row 1 (N = 70 > ref_keys 48) is actually scaled


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_aot_compile_to_ptx_for_sm90_without_a_gpu(dtype):
    kernel = _compile_out_of_process(dtype, 64, ATTRS, arch=90)
    assert kernel.name == "_fused_attention_kernel"
    assert ".target sm_90" in kernel.ptx and f".entry {kernel.name}(" in kernel.ptx
    entry = kernel.ptx[kernel.ptx.index(".entry"):]
    entry = entry[: entry.index(")")]
    params = re.findall(r"\.param \.(u64|u32)", entry)
    n_in, n_int = len(ta.INPUT_ARGS), len(ta.INT_ARGS)
    # inputs (pointers), the integer extra arguments, the output, then Triton's two unused scratch pointers
    assert params[:n_in] == ["u64"] * n_in and params[n_in:n_in + n_int] == ["u32"] * n_int
    assert params[n_in + n_int] == "u64" and len(params) in (n_in + n_int + 1, n_in + n_int + 3)
    assert kernel.num_warps == 4 and kernel.shared_mem > 0 and kernel.block_m == 16


def test_unsupported_configurations_raise():
    with pytest.raises(tp.PluginConfigError, match="power of two"):
        tp.compile_kernel("float16", 24, ATTRS)
    with pytest.raises(tp.PluginConfigError, match="supports"):
        tp.signature("int8")


class _Expr(int):
    """Stand-in for a TensorRT shape expression of a static dimension."""

    is_constant = True

    def constant_value(self):
        return int(self)


def _standin_tensorrt(monkeypatch):
    """``tensorrt`` / ``tensorrt.plugin`` stand-ins with the names the QDP sample uses (register, autotune, aot_impl,
    TensorDesc, AutoTuneCombination, KernelLaunchParams, SymInt32, SymIntExprs, cdiv); they record what is registered."""
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.float16, trt.bfloat16 = "trt.float32", "trt.float16", "trt.bfloat16"
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.registry = {}

    def deco(kind):
        def outer(name):
            def inner(fn):
                trtp.registry[(kind, name)] = fn
                return fn
            return inner
        return outer

    trtp.register, trtp.autotune, trtp.aot_impl = deco("register"), deco("autotune"), deco("aot_impl")
    trtp.TensorDesc = type("TensorDesc", (), {})
    trtp.AutoTuneCombination = lambda *a: ("combination", a)
    trtp.KernelLaunchParams = types.SimpleNamespace
    trtp.SymInt32 = lambda e: int(e)
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.cdiv = lambda a, b: (int(a) + b - 1) // b
    trt.plugin = trtp
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    return trtp


def test_register_wires_shape_function_and_aot_impl(monkeypatch):
    trtp = _standin_tensorrt(monkeypatch)
    monkeypatch.setattr(tp, "compile_kernel", _compile_out_of_process)
    tp.register(arch=90)
    desc = trtp.registry[("register", tp.PLUGIN_ID)]
    aot = trtp.registry[("aot_impl", tp.PLUGIN_ID)]
    assert ("autotune", tp.PLUGIN_ID) in trtp.registry
    # the attributes TensorRT passes are the node attributes export/fuse.py writes (minus the parser's own)
    params = list(inspect.signature(desc).parameters)
    assert params == ["q", "k", "v", "kv_lens", "key_mask", *tp.ATTRIBUTES]
    q = types.SimpleNamespace(like=lambda: "like(q)", dtype="trt.float16",
                              shape_expr=[_Expr(2), _Expr(9), _Expr(8), _Expr(64)])
    k = types.SimpleNamespace(dtype="trt.float16", shape_expr=[_Expr(2), _Expr(3), _Expr(700), _Expr(64)])
    attrs = [getattr(ATTRS, a) for a in tp.ATTRIBUTES]
    assert desc(q, k, k, None, None, *attrs) == "like(q)"
    name, ptx, launch, extra = aot(q, k, k, None, None, *attrs, outputs=(q,), tactic=0)
    assert name == b"_fused_attention_kernel" and b".target sm_90" in ptx
    assert (launch.grid_x, launch.grid_y, launch.grid_z, launch.block_x) == (1, 9, 2, 128)
    assert list(extra) == tp.int_args([2, 9, 8, 64], [2, 3, 700, 64], 0)
    dynamic = types.SimpleNamespace(**{**vars(q), "shape_expr": [*q.shape_expr[:3], types.SimpleNamespace()]})
    with pytest.raises(tp.PluginConfigError, match="head_dim must be static"):
        aot(dynamic, k, k, None, None, *attrs, outputs=(q,), tactic=0)


def test_fused_node_attributes_are_the_plugin_attributes():
    from export.fuse import DOMAIN, OP_TYPE

    assert (DOMAIN, OP_TYPE) == (tp.NAMESPACE, tp.NAME)
    src = inspect.getsource(sys.modules["export.fuse"].fuse_attention)
    for a in tp.ATTRIBUTES:
        assert f'"{a}"' in src
