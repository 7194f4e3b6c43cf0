"""Benchmark the fused query-scale attention kernel against PyTorch SDPA, side by side in one run (GPU).

For each shape (decode q_len 1 and DFlash/verify blocks q_len 8/16; kv_len 2k .. 64k) it times:
  sdpa        F.scaled_dot_product_attention without beta (the floor),
  sdpa+mul    q * beta(N) as a separate elementwise pass, then SDPA (what an unfused integration costs),
  fused       plugins/triton_attention.fused_attention (beta computed in the kernel),
and prints fused / sdpa and fused / (sdpa+mul) ratios; the goal is fused <= 1.05 x sdpa. Writes JSON with --json-out.

  python scripts/bench_attention_gpu.py --json-out runs/bench_attention_h200.json          # on a CUDA GPU
  TRITON_INTERPRET=1 python scripts/bench_attention_gpu.py --device cpu --smoke            # CPU smoke run only

Timing: CUDA events around --iters launches after --warmup launches, median of --repeats. The CPU smoke mode
checks that every path runs and agrees (timings there mean nothing: the kernel is interpreted).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from plugins.rule import QueryScaleProfile, beta_torch
from plugins.triton_attention import fused_attention

SHAPES_GPU = [(q_len, kv) for q_len in (1, 8, 16) for kv in (2048, 8192, 16384, 32768, 65536)]
SHAPES_SMOKE = [(1, 96), (8, 130)]


def _time(fn, device: str, warmup: int, iters: int, repeats: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


@click.command()
@click.option("--device", default="cuda", type=click.Choice(["cuda", "cpu"]))
@click.option("--dtype", default="bf16", type=click.Choice(["bf16", "fp16", "fp32"]))
@click.option("--batch", default=4)
@click.option("--heads", default=32)
@click.option("--kv-heads", default=8)
@click.option("--head-dim", default=128)
@click.option("--ref-keys", default=2048)
@click.option("--warmup", default=10)
@click.option("--iters", default=50)
@click.option("--repeats", default=5)
@click.option("--smoke", is_flag=True, help="tiny shapes, 1 iteration (CPU interpreter check)")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(device, dtype, batch, heads, kv_heads, head_dim, ref_keys, warmup, iters, repeats, smoke, json_out):
    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("no CUDA device: run this on the GPU machine (or --device cpu --smoke)")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    shapes = SHAPES_SMOKE if smoke else SHAPES_GPU
    if smoke:
        batch, heads, kv_heads, head_dim, warmup, iters, repeats, ref_keys = 2, 4, 2, 32, 0, 1, 1, 64
    prof = QueryScaleProfile(ref_keys=ref_keys)
    rows = []
    for q_len, kv in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, heads, q_len, head_dim, device=device, generator=g).to(dt)
        k = torch.randn(batch, kv_heads, kv, head_dim, device=device, generator=g).to(dt)
        v = torch.randn(batch, kv_heads, kv, head_dim, device=device, generator=g).to(dt)
        causal = q_len > 1
        beta = beta_torch(torch.arange(kv - q_len + 1, kv + 1, device=device), prof).to(dt)  # per row (causal)
        mask = None
        if causal:  # verify block: row i sees kv - q_len + i + 1 keys
            j = torch.arange(kv, device=device)[None]
            mask = j <= (kv - q_len + torch.arange(q_len, device=device))[:, None]
        rep = heads // kv_heads

        def sdpa(qq=q):
            return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=rep > 1)

        def sdpa_mul():
            return sdpa(q * beta[None, None, :, None])

        def fused():
            return fused_attention(q, k, v, None, prof, causal=causal)

        err = (fused().float() - sdpa_mul().float()).abs().max().item()
        t = {name: _time(fn, device, warmup, iters, repeats) for name, fn in
             (("sdpa", sdpa), ("sdpa+mul", sdpa_mul), ("fused", fused))}
        row = {"q_len": q_len, "kv_len": kv, **{f"{k_}_s": v_ for k_, v_ in t.items()},
               "fused_over_sdpa": t["fused"] / t["sdpa"], "fused_over_sdpa_mul": t["fused"] / t["sdpa+mul"],
               "max_abs_diff_vs_sdpa_mul": err}
        rows.append(row)
        click.echo(f"q_len {q_len:3d} kv {kv:6d}: sdpa {t['sdpa'] * 1e6:9.1f} us  sdpa+mul {t['sdpa+mul'] * 1e6:9.1f}"
                   f" us  fused {t['fused'] * 1e6:9.1f} us  fused/sdpa {row['fused_over_sdpa']:.3f}  "
                   f"fused/(sdpa+mul) {row['fused_over_sdpa_mul']:.3f}  max diff {err:.2e}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                        "dtype": dtype, "batch": batch, "heads": heads, "kv_heads": kv_heads,
                                        "head_dim": head_dim, "ref_keys": ref_keys, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
