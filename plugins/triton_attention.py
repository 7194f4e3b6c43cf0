"""Drafter attention with SharpDraft's query scale fused into an OpenAI Triton kernel (arXiv 2610.05106).

One program computes a [BLOCK_M query rows x head_dim] tile of one (batch, head) with an online softmax over key
tiles of BLOCK_N (flash-attention recurrence, fp32 accumulators). beta is computed **inside** the kernel per query
row from that row's visible-key count N and the profile constants (no extra pass over Q):

    P = present keys (kv_len, less the key_mask holes);  query i at position p_i = P - q_len + i
    N = (causal ? p_i + 1 : P) - (window ? max(p_i + 1 - window, 0) : 0)
    beta = min(cap, 1 + ln(max((N - top_k) / (ref_keys - top_k), 1)) / slope)      (plugins/rule.py)

and folded into the softmax scale of that row (scores = (q . k) * scale * beta), which equals scaling q.
Semantics, shapes and dtypes match :func:`plugins.attention_ref.attention_ref`, the test oracle. Runs on GPUs, and
on CPU under ``TRITON_INTERPRET=1`` (tests). Launch configuration lives in :data:`LAUNCH_TABLE`; a shape it cannot
handle raises :class:`UnsupportedShape` (never silently does nothing).
"""
from __future__ import annotations

import torch

from plugins.rule import QueryScaleProfile

try:  # Triton is optional at import time: the torch reference covers machines without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

# (max head_dim, BLOCK_M, BLOCK_N, num_warps): first row whose head_dim bound fits wins.
LAUNCH_TABLE = ((64, 16, 64, 4), (128, 16, 64, 4), (256, 16, 32, 8))
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class UnsupportedShape(ValueError):
    """The fused kernel has no launch configuration for these inputs (use plugins.attention_ref instead)."""


def launch_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for ``head_dim`` from :data:`LAUNCH_TABLE`.

    Raises:
        UnsupportedShape: head_dim above every row of the table, or not a power of two >= 16.
    """
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise UnsupportedShape(f"head_dim {head_dim} must be a power of two >= 16")
    for max_d, bm, bn, warps in LAUNCH_TABLE:
        if head_dim <= max_d:
            return bm, bn, warps
    raise UnsupportedShape(f"head_dim {head_dim} exceeds the launch table's {LAUNCH_TABLE[-1][0]}")


# Argument order of the kernel: input pointers, int32 scalars, output pointer. This is the order a TensorRT
# ahead-of-time plugin launches with (inputs, its extra integer arguments, outputs; plugins/tensorrt_plugin.py).
INPUT_ARGS = ("q_ptr", "k_ptr", "v_ptr", "kv_lens_ptr", "mask_ptr")
INT_ARGS = ("sqb", "sqh", "sqm", "sqd", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd", "smb", "smn",
            "sob", "soh", "som", "sod", "q_len", "heads_per_kv", "window")
OUTPUT_ARGS = ("o_ptr",)
# Compile-time constants: the profile's constants and the softmax scale are fixed per model, so they are baked in
# (one compile per profile), which also lets an AOT-compiled kernel take only integer extra arguments.
CONSTEXPR_ARGS = ("SCALE", "REF_MINUS_TOPK", "TOP_K", "SLOPE", "CAP", "ENABLED", "CAUSAL", "HAS_WINDOW", "HAS_MASK",
                  "HEAD_DIM", "BLOCK_M", "BLOCK_N")

if triton is not None:

    @triton.jit
    def _fused_attention_kernel(
            q_ptr, k_ptr, v_ptr, kv_lens_ptr, mask_ptr,
            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smn, sob, soh, som, sod,
            q_len, heads_per_kv, window,
            o_ptr,
            SCALE: tl.constexpr, REF_MINUS_TOPK: tl.constexpr, TOP_K: tl.constexpr, SLOPE: tl.constexpr,
            CAP: tl.constexpr, ENABLED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)  # int64 base offsets: batch * stride overflows int32 at 64k keys
        kvh = (h // heads_per_kv).to(tl.int64)
        kv_len = tl.load(kv_lens_ptr + b)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < q_len
        q = tl.load(q_ptr + b * sqb + h.to(tl.int64) * sqh + rows[:, None] * sqm + dims[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        # Positions (plugins/attention_ref.py): a row's present keys (index < kv_len, mask nonzero) are positions
        # 0..P-1 in index order, the queries the last q_len of them. Row i sees positions [lo_pos, hi_pos).
        m_base = mask_ptr + b * smb
        if HAS_MASK:  # P: one pass over the int32 mask row (not over Q or K)
            p_keys = kv_len * 0
            for start in range(0, kv_len, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                keep = tl.load(m_base + cols * smn, mask=cols < kv_len, other=0) != 0
                p_keys += tl.sum(keep.to(tl.int32), axis=0)
        else:
            p_keys = kv_len
        qpos = p_keys - q_len + rows
        if CAUSAL:
            hi_pos = qpos + 1
        else:
            hi_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + p_keys
        if HAS_WINDOW:  # anchored at the query's own position: keys at positions > qpos - window
            lo_pos = tl.maximum(qpos + 1 - window, 0)
        else:
            lo_pos = tl.zeros([BLOCK_M], dtype=tl.int32)
        n = tl.maximum(hi_pos - lo_pos, 0).to(tl.float32)  # N per row, from P alone
        pos_lo = tl.min(tl.where(row_ok, lo_pos, p_keys), axis=0)
        pos_hi = tl.max(tl.where(row_ok, hi_pos, 0), axis=0)
        if HAS_MASK:  # key index range: from the first tile holding position pos_lo (a second pass over the mask
            lo = kv_len * 0  # row, which skips the tiles before a window), to the row's end
            base = kv_len * 0  # present keys before index lo
            seen = kv_len * 0
            if HAS_WINDOW:
                for start in range(0, kv_len, BLOCK_N):
                    cols = start + tl.arange(0, BLOCK_N)
                    keep = tl.load(m_base + cols * smn, mask=cols < kv_len, other=0) != 0
                    seen += tl.sum(keep.to(tl.int32), axis=0)
                    before = seen <= pos_lo  # the whole tile lies before the lowest position any row needs
                    lo = tl.where(before, start + BLOCK_N, lo)
                    base = tl.where(before, seen, base)
            hi = kv_len
        else:  # positions are indices
            lo = pos_lo
            base = pos_lo
            hi = pos_hi
        if ENABLED:  # beta(N) per row, from the rule's constants: no pass over Q
            r = tl.maximum((n - TOP_K) / REF_MINUS_TOPK, 1.0)
            beta = tl.minimum(1.0 + tl.log(r) / SLOPE, CAP)
        else:
            beta = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        row_scale = beta * SCALE  # [BLOCK_M]
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        k_base = k_ptr + b * skb + kvh * skh
        v_base = v_ptr + b * svb + kvh * svh
        run = base  # present keys before the current tile (HAS_MASK)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            k = tl.load(k_base + cols[:, None] * skn + dims[None, :] * skd, mask=col_ok[:, None],
                        other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * row_scale[:, None]  # [BLOCK_M, BLOCK_N], fp32
            if HAS_MASK:  # a key's position is its rank among the present keys: a prefix count of the mask
                keep = (tl.load(m_base + cols * smn, mask=col_ok, other=0) != 0) & col_ok
                kpos = run + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                run += tl.sum(keep.to(tl.int32), axis=0)
            else:
                keep = col_ok
                kpos = cols
            vis = ((kpos[None, :] >= lo_pos[:, None]) & (kpos[None, :] < hi_pos[:, None]) & keep[None, :]
                   & row_ok[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + cols[:, None] * svn + dims[None, :] * svd, mask=col_ok[:, None],
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees no key: zeros
        tl.store(o_ptr + b * sob + h.to(tl.int64) * soh + rows[:, None] * som + dims[None, :] * sod,
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def kernel_constants(head_dim: int, profile: QueryScaleProfile | None, causal: bool, window: int | None,
                     has_mask: bool, scale: float | None) -> dict:
    """The kernel's constexpr arguments (:data:`CONSTEXPR_ARGS`) for one configuration.

    Raises:
        UnsupportedShape: see :func:`launch_config`.
    """
    block_m, block_n, _ = launch_config(head_dim)
    on = profile is not None and profile.enabled
    prof = profile or QueryScaleProfile(ref_keys=2048)
    return dict(SCALE=float(head_dim ** -0.5 if scale is None else scale),
                REF_MINUS_TOPK=float(prof.ref_keys - prof.top_k), TOP_K=float(prof.top_k), SLOPE=float(prof.slope),
                CAP=float(prof.cap), ENABLED=on, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                HAS_MASK=bool(has_mask), HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: torch.Tensor | None = None,
                    profile: QueryScaleProfile | None = None, causal: bool = False, window: int | None = None,
                    scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with beta(N) fused in; same contract as :func:`plugins.attention_ref.attention_ref`.

    Args:
        q: ``[batch, heads, q_len, head_dim]`` fp32/fp16/bf16, any strides.
        k, v: ``[batch, kv_heads, kv_len_max, head_dim]`` (any strides, may differ from each other).
        kv_lens: int ``[batch]`` (on q's device); None = kv_len_max.
        profile: rule constants; None or disabled = beta 1.
        causal, window, scale: as in the reference.
        key_mask: optional bool/int ``[batch, kv_len_max]`` (nonzero = visible), as in the reference; N counts
            only visible keys (one extra pass over this int32 row, none over Q or K).
    Returns:
        ``[batch, heads, q_len, head_dim]`` in q's dtype (contiguous).
    Raises:
        RuntimeError: Triton is not installed.
        UnsupportedShape: dtype, head_dim, GQA ratio or lengths the kernel cannot handle.
    """
    if triton is None:
        raise RuntimeError("OpenAI Triton is not installed; use plugins.attention_ref.attention_ref")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedShape(f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: need one of {SUPPORTED_DTYPES}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise UnsupportedShape(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, h, q_len, d = q.shape
    kvh, kv_max = k.shape[1], k.shape[2]
    if h % kvh:
        raise UnsupportedShape(f"heads {h} must be a multiple of kv_heads {kvh}")
    block_m, block_n, warps = launch_config(d)
    if kv_lens is None:
        kv_lens = torch.full((b,), kv_max, dtype=torch.int32, device=q.device)
    kv_lens = kv_lens.to(device=q.device, dtype=torch.int32)
    lens = kv_lens.cpu()
    if (lens < 1).any() or (lens > kv_max).any() or (causal and (lens < q_len).any()):
        raise UnsupportedShape(f"kv_lens {lens.tolist()} must be in [{q_len if causal else 1}, {kv_max}]")
    if window is not None and window < 1:
        raise UnsupportedShape(f"window must be >= 1, got {window}")
    if key_mask is not None and tuple(key_mask.shape) != (b, kv_max):
        raise UnsupportedShape(f"key_mask {tuple(key_mask.shape)} must be [batch, kv_len_max] = {(b, kv_max)}")
    const = kernel_constants(d, profile, causal, window, key_mask is not None, scale)
    mask = (key_mask.to(device=q.device, dtype=torch.int32) if key_mask is not None
            else kv_lens)  # unread when HAS_MASK is off (any valid pointer)
    out = torch.empty((b, h, q_len, d), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(q_len, block_m), h, b)
    mstrides = mask.stride() if key_mask is not None else (0, 0)
    _fused_attention_kernel[grid](
        q, k, v, kv_lens, mask, *q.stride(), *k.stride(), *v.stride(), *mstrides, *out.stride(),
        q_len, h // kvh, int(window or 0), out, **const, num_warps=warps)
    return out
