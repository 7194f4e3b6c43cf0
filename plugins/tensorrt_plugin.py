"""TensorRT quickly-deployable plugin (``tensorrt.plugin``) for ``sharpdraft::QueryScaledAttention``.

The ONNX node that ``sharpdraft-export --fused-attention`` emits (export/fuse.py) is parsed by TensorRT's ONNX parser
into this plugin: op type ``QueryScaledAttention``, namespace ``sharpdraft`` (node attribute ``plugin_namespace``;
``aot=1`` selects the ahead-of-time implementation). The implementation is the OpenAI Triton kernel of
plugins/triton_attention.py compiled to PTX at engine build time, so the engine runs in plain C++ TensorRT / trtexec
without Python. API followed: NVIDIA/TensorRT ``samples/python/quickly_deployable_plugins`` (``@trtp.register``
shape function returning ``q.like()``; ``@trtp.aot_impl`` returning ``(kernel name, PTX, KernelLaunchParams,
SymIntExprs)``; the kernel's parameters are the input pointers, the integer extra arguments, then the output).

Plugin I/O (TensorRT linear format, so every tensor is contiguous and its strides follow from its shape):
    q [batch, heads, q_len, head_dim], k / v [batch, kv_heads, kv_len, head_dim] (fp32 | fp16 | bf16, one type),
    kv_lens [batch] int32, key_mask [batch, kv_len] int32 -> out [batch, heads, q_len, head_dim] (q's type).
Attributes: ref_keys, top_k (int), slope, cap (float), enabled, causal, window (int), scale (float); the profile
constants and the scale are compiled into the kernel (one PTX per attribute set); head_dim must be static.

Everything here except :func:`register` is plain Python and runs without TensorRT: the integer arguments and grid
(:func:`int_args`, :func:`grid`) are written over a generic "shape expression" type, so the same code builds
TensorRT ``SymInt32`` expressions at build time and plain ints in tests; :func:`compile_kernel` runs
``triton.compile`` for an explicit CUDA target and needs no GPU. :func:`register` imports ``tensorrt.plugin`` lazily.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from plugins.rule import QueryScaleProfile

NAMESPACE = "sharpdraft"
NAME = "QueryScaledAttention"
PLUGIN_ID = f"{NAMESPACE}::{NAME}"
ATTRIBUTES = ("ref_keys", "top_k", "slope", "cap", "enabled", "causal", "window", "scale")
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


class PluginConfigError(ValueError):
    """The plugin cannot be built for these inputs/attributes; the message says what to change."""


@dataclasses.dataclass(frozen=True, slots=True)
class Attributes:
    """The node's attributes (export/fuse.py writes them; TensorRT passes them to the plugin)."""

    ref_keys: int
    top_k: int
    slope: float
    cap: float
    enabled: int
    causal: int
    window: int
    scale: float

    @property
    def profile(self) -> QueryScaleProfile:
        return QueryScaleProfile(ref_keys=int(self.ref_keys), top_k=int(self.top_k), slope=float(self.slope),
                                 cap=float(self.cap), enabled=bool(self.enabled))


def contiguous_strides(shape: Sequence[Any]) -> list[Any]:
    """Strides (elements) of a contiguous tensor of ``shape``; works on ints and on TensorRT shape expressions."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def int_args(q_shape: Sequence[Any], k_shape: Sequence[Any], window: int) -> list[Any]:
    """The kernel's integer arguments, in :data:`plugins.triton_attention.INT_ARGS` order, for contiguous tensors.

    Args:
        q_shape: ``[batch, heads, q_len, head_dim]`` (ints or shape expressions).
        k_shape: ``[batch, kv_heads, kv_len, head_dim]`` (V and the output have the shapes of K and Q).
        window: sliding window (0 = none).
    Returns:
        ``[q strides x4, k strides x4, v strides x4, mask strides x2, out strides x4, q_len, heads_per_kv, window]``.
    """
    qs, ks = contiguous_strides(q_shape), contiguous_strides(k_shape)
    ms = contiguous_strides([k_shape[0], k_shape[2]])
    return [*qs, *ks, *ks, *ms, *qs, q_shape[2], q_shape[1] // k_shape[1], window]


def grid(q_shape: Sequence[Any], block_m: int, cdiv=None) -> tuple[Any, Any, Any]:
    """Launch grid ``(cdiv(q_len, BLOCK_M), heads, batch)``; ``cdiv`` defaults to integer ceil-division."""
    cdiv = cdiv or (lambda a, b: (a + b - 1) // b)
    return cdiv(q_shape[2], block_m), q_shape[1], q_shape[0]


def signature(dtype: str) -> dict[str, str]:
    """Triton signature of the kernel's runtime arguments for element type ``dtype`` ("float32" | "float16" |
    "bfloat16"). Raises PluginConfigError for other types."""
    from plugins.triton_attention import INPUT_ARGS, INT_ARGS, OUTPUT_ARGS

    if dtype not in TRITON_TYPES:
        raise PluginConfigError(f"dtype {dtype}: the plugin supports {', '.join(TRITON_TYPES)}")
    t = "*" + TRITON_TYPES[dtype]
    sig = {name: t for name in INPUT_ARGS[:3]} | {"kv_lens_ptr": "*i32", "mask_ptr": "*i32"}
    sig |= {name: "i32" for name in INT_ARGS}
    return sig | {name: t for name in OUTPUT_ARGS}


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    block_m: int


def compile_kernel(dtype: str, head_dim: int, attrs: Attributes, arch: int = 90) -> CompiledKernel:
    """Compile the fused kernel ahead of time for ``sm_{arch}`` (no GPU needed) with the key mask on.

    Returns:
        kernel name, PTX text, warps, dynamic shared memory (bytes) and BLOCK_M (for the grid).
    Raises:
        PluginConfigError: dtype / head_dim unsupported, or Triton missing; or the compiled kernel needs global or
            profile scratch memory (the plugin does not allocate any).
    """
    from plugins.triton_attention import UnsupportedShape, kernel_constants, launch_config

    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from plugins.triton_attention import _fused_attention_kernel
    except ImportError as e:
        raise PluginConfigError(f"OpenAI Triton is needed to build the plugin ({e}); pip install triton") from e
    try:
        block_m, _, warps = launch_config(head_dim)
        const = kernel_constants(head_dim, attrs.profile, bool(attrs.causal), int(attrs.window) or None, True,
                                 float(attrs.scale) or None)
    except UnsupportedShape as e:
        raise PluginConfigError(str(e)) from e
    sig = signature(dtype) | {name: "constexpr" for name in const}
    fn = _fused_attention_kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):  # TRITON_INTERPRET=1 wraps it for the interpreter
        fn = triton.runtime.jit.JITFunction(fn.fn)
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    meta = kernel.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, field, 0):
            raise PluginConfigError(f"compiled kernel needs {field}={getattr(meta, field)}; the plugin passes none")
    return CompiledKernel(meta.name, kernel.asm["ptx"], meta.num_warps, meta.shared, block_m)


def _dtype_name(trt_dtype) -> str:
    import tensorrt as trt

    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    if trt_dtype not in names:
        raise PluginConfigError(f"dtype {trt_dtype}: the plugin supports {', '.join(TRITON_TYPES)}")
    return names[trt_dtype]


def _static(expr, what: str) -> int:
    if not getattr(expr, "is_constant", False):
        raise PluginConfigError(f"{what} must be static at engine build time (it selects the compiled kernel)")
    return int(expr.constant_value())


def register(arch: int | None = None) -> None:
    """Register ``sharpdraft::QueryScaledAttention`` with TensorRT (shape function, type combinations, AOT impl).

    Call once before parsing the fused ONNX graph / building the engine. ``arch`` is the SM version to compile for
    (default: the current CUDA device's). Not executed in this project's CI (TensorRT is not installable there).

    Raises:
        ImportError: TensorRT (>= 10.9, with ``tensorrt.plugin``) is not installed.
    """
    import tensorrt as trt  # noqa: F401 - lazily: only users who build TensorRT engines need it
    import tensorrt.plugin as trtp

    if arch is None:
        import torch

        major, minor = torch.cuda.get_device_capability()
        arch = major * 10 + minor

    @trtp.register(PLUGIN_ID)
    def _desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, kv_lens: trtp.TensorDesc,
              key_mask: trtp.TensorDesc, ref_keys: int, top_k: int, slope: float, cap: float, enabled: int,
              causal: int, window: int, scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(PLUGIN_ID)
    def _combinations(q, k, v, kv_lens, key_mask, outputs) -> list:
        # positions: q, k, v, kv_lens, key_mask, out; "|" alternatives are taken together across positions
        return [trtp.AutoTuneCombination("FP32|FP16|BF16, FP32|FP16|BF16, FP32|FP16|BF16, INT32, INT32, "
                                         "FP32|FP16|BF16", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, kv_lens: trtp.TensorDesc,
             key_mask: trtp.TensorDesc, ref_keys: int, top_k: int, slope: float, cap: float, enabled: int,
             causal: int, window: int, scale: float, outputs, tactic: int):
        attrs = Attributes(ref_keys, top_k, slope, cap, enabled, causal, window, scale)
        head_dim = _static(q.shape_expr[3], "head_dim")
        compiled = compile_kernel(_dtype_name(q.dtype), head_dim, attrs, arch)
        qs, ks = list(q.shape_expr), list(k.shape_expr)
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in int_args(qs, ks, int(window))])
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = grid(qs, compiled.block_m, trtp.cdiv)
        params.block_x = compiled.num_warps * 32
        params.shared_mem = compiled.shared_mem
        return compiled.name.encode(), compiled.ptx.encode(), params, extra
