"""Where a speculative round's time goes: per graph call, per runtime step, per ONNX Runtime kernel.

``loop`` runs the default export's pair in the real loop on held-out text at each ``--contexts`` size and, rotated
per prompt, measures the plain 1-token path (``min_q`` 1, as ONNX Runtime GenAI decodes), the lossless block path
(the folder's ``min_q_len``) and speculative decoding at each ``--draft-tokens`` k (drafter alone, prompt lookup
off, k fixed per request; ``--thread-pool`` as runtime.generate's). Per configuration: step ms (median), the part
of it inside ONNX Runtime and the runtime's own part (binding, sampling, acceptance, cache bookkeeping), draft and
verify ms per round, MAL, the speedup over the 1-token path and the break-even MAL (round ms / 1-token step ms: the
MAL at which the round pays).
It also times the target graph alone for blocks of q = 1 .. max(k) + 1 rows at each context (the verify block's
price in 1-token steps), prints the ONNX Runtime kernels that take the time (ORT's profiler, ``--ort-profile``) and
the memory floor of one target step (bytes read: weights + K/V at the context, over the measured read bandwidth).

``kernels`` measures the matmul kernels ONNX Runtime offers for a block of M rows on a stack of 40 SmolLM2-sized
matmuls (576 x 1536 and back): int4 ``MatMulNBits`` (the model builder's, block 32 / 128, int8 or fp32
activations), int8-weight ``MatMulNBits``, ``MatMulInteger`` with per-row int8 activations (each row's numerics
independent of the block) and fp32 ``MatMul``; what a verify block costs over a 1-token step is set there.

    python scripts/profile_round.py loop --engine engines/ --contexts 512,1024,4096 --draft-tokens 1,2,3 \\
        --ort-profile --out runs/profile_round
    python scripts/profile_round.py kernels --out runs/profile_round
"""
from __future__ import annotations

import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np

from runtime.benchmarking import rotated, run_timed
from runtime.ort_threads import click_option as thread_pool_option

DEFAULT_DOCUMENTS = "hamlet_gut,argparse.py"


@click.group()
def cli():
    """Per-round profile of the speculative loop (``loop``) and of ONNX Runtime's matmul kernels (``kernels``)."""


@contextlib.contextmanager
def one_token_steps(target):
    """Target calls with the real rows only (the plain 1-token path), whatever the folder's ``min_q_len``."""
    saved = target.min_q
    target.min_q = 1
    try:
        yield
    finally:
        target.min_q = saved


def block_prices(target, ids: list[int], max_q: int, repeats: int) -> dict[int, float]:
    """Median ms of one target call of q = 1 .. ``max_q`` rows after the prompt ``ids`` (the cache rolled back after
    each call, so every call sees the same past). Raises ValueError as ``OrtTarget.forward``."""
    cache = target.new_cache()
    target.prefill(cache, ids)
    out = {}
    with one_token_steps(target):
        for q in range(1, max_q + 1):
            times = []
            for _ in range(repeats + 2):
                length = cache.length
                t0 = time.perf_counter()
                target.forward([cache], [[ids[-1]] * q])
                times.append(time.perf_counter() - t0)
                cache.truncate(length)
            out[q] = round(1000 * statistics.median(times[2:]), 3)
    return out


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """GB/s of one thread summing a float32 array of ``nbytes`` (numpy's reduction: a read stream)."""
    a = np.ones(nbytes // 4, np.float32)
    a.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def graph_bytes(graph_file: Path) -> int:
    """Bytes of a graph's weights: the .onnx file plus its external data files."""
    return sum(f.stat().st_size for f in graph_file.parent.glob(graph_file.name + "*"))


def op_breakdown(profile_json: Path, top: int = 8) -> dict:
    """{"runs": n, "ms_per_run": total / n, "ops": {op type: ms per run}} from an ONNX Runtime profile."""
    events = json.loads(Path(profile_json).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"]
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"]
    n = max(1, len(runs))
    return {"runs": len(runs), "ms_per_run": round(sum(r["dur"] for r in runs) / n / 1000, 3),
            "ops": {op: round(us / n / 1000, 3) for op, us in per_op.most_common(top)}}


def profiled_breakdown(engine, engine_dir: Path, ids: list[int], new_tokens: int, k: int, scratch: Path) -> dict:
    """ORT's profiler over the decode steps (the prefill runs unprofiled) of one speculative request (k draft tokens)
    and one 1-token-path request: the kernels of the target's verify calls, the drafter's calls and the target's
    1-token steps."""
    import onnxruntime as ort

    from runtime.backends.ort import session_options
    from runtime.sampling import SamplingParams

    def profiling(role: str, tag: str):
        so = session_options(None, role)
        so.enable_profiling = True
        so.profile_file_prefix = str(scratch / tag)
        graph = engine.manifest.graphs[role]
        return ort.InferenceSession(str(engine_dir / graph.file), so, providers=["CPUExecutionProvider"])

    def decode(speculative: bool, sessions: dict) -> dict:
        engine.add_request(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, speculative=speculative,
                                               num_draft_tokens=k if speculative else None))
        engine.step()  # the prefill, on the folder's own sessions
        saved = {role: getattr(engine, role).session for role in sessions}
        try:
            for role, sess in sessions.items():
                getattr(engine, role).session = sess
            while engine.has_unfinished:
                engine.step()
        finally:
            for role, sess in saved.items():
                getattr(engine, role).session = sess
        return {role: op_breakdown(sess.end_profiling()) for role, sess in sessions.items()}

    spec = decode(True, {"target": profiling("target", "verify"), "drafter": profiling("drafter", "draft")})
    with one_token_steps(engine.target):
        plain = decode(False, {"target": profiling("target", "step")})
    return {f"verify (q = {k + 1})": spec["target"], "draft": spec["drafter"], "1-token step": plain["target"]}


def _configs(ks: list[int]) -> list[str]:
    return ["1-token", "block"] + [f"spec k={k}" for k in ks]


def _run_config(engine, name: str, ids: list[int], new_tokens: int) -> dict:
    if name == "1-token":
        with one_token_steps(engine.target):
            return run_timed(engine, ids, new_tokens, False)
    if name == "block":
        return run_timed(engine, ids, new_tokens, False)
    return run_timed(engine, ids, new_tokens, True, int(name.split("=")[1]))


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per configuration over prompts: median step / ORT / runtime ms, and for speculative rows draft / verify ms
    per round, MAL, speedup over the 1-token path (geo-mean over prompts) and break-even MAL."""
    one = runs["1-token"]
    out = {}
    for name, rows in runs.items():
        s = {"step_ms": round(statistics.median(r["step_ms_median"] for r in rows), 3),
             "ort_ms": round(statistics.median(r["ort_ms_per_step"] for r in rows), 3),
             "runtime_ms": round(statistics.median(r["overhead_ms_per_step"] for r in rows), 3),
             "decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in rows), 2)}
        s["x_1token"] = round(statistics.geometric_mean(
            r["decode_tokens_per_s"] / o["decode_tokens_per_s"] for r, o in zip(rows, one)), 3)
        if "mal" in rows[0]:
            s |= {"draft_ms": round(statistics.median(r["draft_ms_per_step"] for r in rows), 3),
                  "verify_ms": round(statistics.median(r["verify_ms_per_step"] for r in rows), 3),
                  "mal": round(statistics.mean(r["mal"] for r in rows), 3),
                  "lossless": all(r["lossless"] for r in rows)}
            s["break_even_mal"] = round(s["step_ms"] / out["1-token"]["step_ms"], 3)
        out[name] = s
    return out


def table(result: dict) -> str:
    """Markdown: one row per context and configuration."""
    lines = ["| context | configuration | step ms | in ORT | runtime | draft ms | verify ms | MAL | break-even MAL "
             "| tokens/s | x 1-token path |", "|---" * 11 + "|"]
    for ctx, summary in result["summary"].items():
        for name, s in summary.items():
            lines.append(f"| {ctx} | {name} | {s['step_ms']:.2f} | {s['ort_ms']:.2f} | {s['runtime_ms']:.2f} | "
                         f"{s.get('draft_ms', '')} | {s.get('verify_ms', '')} | {s.get('mal', '')} | "
                         f"{s.get('break_even_mal', '')} | {s['decode_tokens_per_s']} | {s['x_1token']:.3f} |")
    qs = list(next(iter(result["block_prices"].values())))
    lines += ["", "Target graph alone, one call of q rows (ms, and x the q = 1 call):", "",
              "| context | " + " | ".join(f"q = {q}" for q in qs) + " |", "|---" * (1 + len(qs)) + "|"]
    for ctx, prices in result["block_prices"].items():
        lines.append(f"| {ctx} | " + " | ".join(f"{v:.2f} ({v / prices[1]:.2f}x)" for v in prices.values()) + " |")
    return "\n".join(lines)


@cli.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(exists=True, file_okay=False,
                                                                          path_type=Path), show_default=True)
@click.option("--contexts", default="512,1024,4096", show_default=True)
@click.option("--draft-tokens", "draft_tokens", default="1,2,3", show_default=True,
              help="draft tokens verified per round, one speculative configuration each")
@click.option("--documents", default=DEFAULT_DOCUMENTS, show_default=True, help="held-out documents (prompts)")
@click.option("--end-token", default=4200, show_default=True, type=click.IntRange(min=2))
@click.option("--new-tokens", default=96, show_default=True, type=click.IntRange(min=4))
@click.option("--repeats", default=9, show_default=True, type=click.IntRange(min=1),
              help="timed calls per block size in the graph-alone timing")
@click.option("--ort-profile", is_flag=True, help="also run ORT's profiler at the first context")
@thread_pool_option()
@click.option("--out", default="runs/profile_round", type=click.Path(path_type=Path), show_default=True)
def loop(engine_dir, contexts, draft_tokens, documents, end_token, new_tokens, repeats, ort_profile, thread_pool,
         out):
    """The round, measured in the loop on the folder's pair (greedy, drafter alone)."""
    import platform

    from runtime.engine import SpecEngine
    from runtime.ort_threads import apply
    from training.corpus import document_prompts

    apply(thread_pool)

    ctxs = [int(c) for c in contexts.split(",")]
    ks = [int(k) for k in draft_tokens.split(",")]
    engine = SpecEngine.from_dir(engine_dir).with_options(prompt_lookup=None, draft_confidence=None)
    tok = engine.tokenizer

    class _Tok:
        def encode(self, text):
            return tok.encode(text, add_special_tokens=False)

    prompts = document_prompts(_Tok(), ctxs, end_token, documents.split(","))
    out.mkdir(parents=True, exist_ok=True)
    engine.generate(prompts[next(iter(prompts))][-64:], 8)  # warm-up
    result = {"engine": str(engine_dir), "machine": platform.processor() or platform.machine(),
              "thread_pool": thread_pool,
              "new_tokens": new_tokens, "contexts": ctxs, "draft_tokens": ks, "summary": {}, "block_prices": {},
              "prompts": {}}
    configs = _configs(ks)
    for ctx in ctxs:
        runs = {c: [] for c in configs}
        for i, name in enumerate(n for n in prompts if n.endswith(f"@{ctx}")):
            ids = prompts[name]
            rows = {c: _run_config(engine, c, ids, new_tokens) for c in rotated(configs, i)}
            for c in configs:
                if "mal" in rows[c]:
                    rows[c]["lossless"] = rows[c]["token_ids"] == rows["block"]["token_ids"]
                runs[c].append(rows[c])
            result["prompts"][name] = {c: {k: v for k, v in r.items() if k != "token_ids"} for c, r in rows.items()}
            click.echo(f"{name}: " + ", ".join(f"{c} {rows[c]['decode_tokens_per_s']:.1f}" for c in configs),
                       err=True)
        result["summary"][ctx] = summarise(runs)
        first = prompts[next(n for n in prompts if n.endswith(f"@{ctx}"))]
        result["block_prices"][ctx] = block_prices(engine.target, first, max(ks) + 1, repeats)
    t = engine.manifest.target
    weights = graph_bytes(engine_dir / engine.manifest.graphs["target"].file)
    bw = {"l3_resident_gb_s": round(read_bandwidth(32 << 20), 1), "dram_gb_s": round(read_bandwidth(2 << 30), 1)}
    kv_per_token = 2 * t.num_layers * t.num_key_value_heads * t.head_dim * 4
    result["floor"] = {"target_weight_bytes": weights, "kv_bytes_per_token": kv_per_token, "read_bandwidth": bw,
                       "step_floor_ms_one_thread_dram": {
                           ctx: round(1000 * (weights + ctx * kv_per_token) / (bw["dram_gb_s"] * 1e9), 2)
                           for ctx in ctxs}}
    if ort_profile:
        ids = prompts[next(n for n in prompts if n.endswith(f"@{ctxs[0]}"))]
        result["ort_profile"] = profiled_breakdown(engine, engine_dir, ids, new_tokens, max(ks), out)
    (out / "round_profile.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (out / "round_profile.md").write_text(md + "\n")
    click.echo(md)
    click.echo(f"memory floor: {json.dumps(result['floor'])}")
    for part, b in result.get("ort_profile", {}).items():
        click.echo(f"{part}: {b['ms_per_run']} ms per call; " + ", ".join(f"{op} {ms}" for op, ms in b["ops"].items()))
    click.echo(f"wrote {out / 'round_profile.json'}")
    if not all(s.get("lossless", True) for summary in result["summary"].values() for s in summary.values()):
        click.echo("speculative output differs from the block path's greedy output", err=True)
        sys.exit(3)


# ---- kernels -------------------------------------------------------------------------------------------------

def _stack(kind: str, layers: int = 20, k: int = 576, n: int = 1536, seed: int = 0):
    """An ONNX model of ``layers`` pairs of matmuls ``[M, k] -> [M, n] -> [M, k]`` with random weights, as
    ``kind``: "fp32" (MatMul) or "rowq-int8" (per-row symmetric int8 activations as uint8 with zero point 128,
    int8 per-column weights, MatMulInteger, rescaled to float: each row's result independent of the other rows)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))

    const("axes", np.array([-1], np.int64))
    const("c127", np.array(127.0, np.float32))
    const("c128", np.array(128.0, np.float32))
    const("eps", np.array(1e-8, np.float32))
    const("zp128", np.array(128, np.uint8))

    def matmul(x: str, name: str, rows: int, cols: int) -> str:
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        if kind == "fp32":
            const(name, w)
            nodes.append(helper.make_node("MatMul", [x, name], [name + "_y"]))
            return name + "_y"
        scale = np.abs(w).max(0) / 127
        const(name, np.round(w / scale).astype(np.int8))
        const(name + "_s", scale.astype(np.float32))
        t = name + "_"
        nodes.extend([
            helper.make_node("Abs", [x], [t + "abs"]),
            helper.make_node("ReduceMax", [t + "abs", "axes"], [t + "max"], keepdims=1),
            helper.make_node("Max", [t + "max", "eps"], [t + "max2"]),
            helper.make_node("Div", [t + "max2", "c127"], [t + "xs"]),
            helper.make_node("Div", [x, t + "xs"], [t + "xd"]),
            helper.make_node("Round", [t + "xd"], [t + "xr"]),
            helper.make_node("Add", [t + "xr", "c128"], [t + "xu"]),
            helper.make_node("Cast", [t + "xu"], [t + "xq"], to=TensorProto.UINT8),
            helper.make_node("MatMulInteger", [t + "xq", name, "zp128"], [t + "acc"]),
            helper.make_node("Cast", [t + "acc"], [t + "accf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [t + "accf", t + "xs"], [t + "rows"]),
            helper.make_node("Mul", [t + "rows", name + "_s"], [t + "y"]),
        ])
        return t + "y"

    x = "x"
    for i in range(layers):
        x = matmul(matmul(x, f"w{i}", k, n), f"v{i}", n, k)
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", k])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _nbits(model, bits: int, block: int, accuracy_level: int):
    """``model`` with its MatMuls quantized by ORT's MatMulNBitsQuantizer (symmetric)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                  MatMulNBitsQuantizer)

    q = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), algo_config=(
        DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=accuracy_level, bits=bits)))
    q.process()
    return q.model.model


def time_rows(model, rows: tuple[int, ...], repeats: int, threads: int) -> tuple[dict[int, float], bool]:
    """Median ms of one call per M in ``rows`` and whether row 0's output is bit-identical for every M."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((max(rows), 576)).astype(np.float32)
    out, first = {}, {}
    for m in rows:
        for _ in range(5):
            first[m] = sess.run(None, {"x": x[:m]})[0][0]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, {"x": x[:m]})
            times.append(time.perf_counter() - t0)
        out[m] = round(1000 * statistics.median(times), 3)
    return out, all(np.array_equal(first[m], first[rows[0]]) for m in rows)


@cli.command()
@click.option("--rows", default="1,2,3,4,8", show_default=True, help="block sizes M")
@click.option("--repeats", default=30, show_default=True, type=click.IntRange(min=3))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--out", default="runs/profile_round", type=click.Path(path_type=Path), show_default=True)
def kernels(rows, repeats, threads, out):
    """ONNX Runtime's matmul kernels for a block of M rows (40 SmolLM2-sized matmuls)."""
    ms = tuple(int(m) for m in rows.split(","))
    fp32 = _stack("fp32")
    variants = {"MatMulNBits int4 block 32, int8 activations (the builder's int4 graph)": _nbits(fp32, 4, 32, 4),
                "MatMulNBits int4 block 128, int8 activations": _nbits(fp32, 4, 128, 4),
                "MatMulNBits int4 block 32, fp32 activations": _nbits(fp32, 4, 32, 1),
                "MatMulNBits int8 block 32, int8 activations": _nbits(fp32, 8, 32, 4),
                "MatMulInteger, per-row int8 activations": _stack("rowq-int8"),
                "MatMul fp32": fp32}
    result = {}
    lines = ["| kernel | " + " | ".join(f"M = {m}" for m in ms) + " | row 0 equal for every M |",
             "|---" * (len(ms) + 2) + "|"]
    for name, model in variants.items():
        times, equal = time_rows(model, ms, repeats, threads)
        result[name] = {"ms": times, "row_exact_across_m": equal}
        lines.append(f"| {name} | " + " | ".join(f"{times[m]:.2f} ({times[m] / times[ms[0]]:.2f}x)" for m in ms)
                     + f" | {'yes' if equal else 'no'} |")
        click.echo(lines[-1], err=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(result, indent=1))
    click.echo("\n".join(lines))


if __name__ == "__main__":
    cli()
