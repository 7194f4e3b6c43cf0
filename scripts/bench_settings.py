"""Runtime settings chosen by measurement: ONNX Runtime threads / spinning, and the prefill chunk size.

1. Threads: for each (intra-op threads, allow_spinning) setting, fresh target and drafter sessions time, in the
   loop's own order, one drafter call and one verify call (1 + k tokens) on a cache of ``--context`` tokens, and
   a target-only decode step. Settings are interleaved round by round (noise hits them alike); medians reported.
2. Prefill chunk: the prompt's prefill time per chunk size, same engine, interleaved.
3. KV form (``--compare-engine DIR``, a folder whose graphs return past + new K/V, e.g. exported with
   ``--target-kv-io concat --drafter-kv-io concat``): decode-step and verify-call times of both target graphs,
   and DFlash draft-call times (2 new context rows) of both drafter graphs, at each ``--kv-contexts`` length,
   interleaved, split into time inside ONNX Runtime and outside it.
4. int8 drafter (``--int8-drafter``, on a folder exported with ``--drafter-precision fp32``): the drafter graph with
   quantized MatMul weights (``--drafter-quant``) against the fp32 graph: draft-call time and how often both
   propose the same tokens, on the target's real features of the prompt (verification is untouched, so exact).
   The export's own int8 graph (export/drafter_quant.py) also moves the LM head into the graph.

  python scripts/bench_settings.py --engine engines --context 1024 --out runs/bench/settings

Writes ``bench_settings.json`` and ``settings.png`` under ``--out``; the README records what was chosen from it.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import click
import numpy as np

from runtime.benchmarking import figure, save_figure

ROOT = Path(__file__).resolve().parents[1]


def _pair(engine_dir: Path, manifest, threads: int, spin: str):
    from runtime.backends.ort import OrtDFlashDrafter, OrtTarget

    from unittest import mock

    keys = {f"SHARPDRAFT_{role}_{what}": value for role in ("TARGET", "DRAFTER")
            for what, value in (("SPIN", spin), ("THREADS", str(threads)))}  # both sessions alike
    with mock.patch.dict(os.environ, keys):
        return OrtTarget(engine_dir, manifest, "cpu", threads), OrtDFlashDrafter(engine_dir, manifest, "cpu", threads)


def time_threads(engine_dir: Path, manifest, ids: list[int], settings: list[tuple[int, str]], k: int,
                 rounds: int) -> dict:
    """Median ms of a draft call, a verify call of 1 + k tokens and a decode step per (threads, spin) setting."""
    pairs = {s: _pair(engine_dir, manifest, *s) for s in settings}
    state = {}
    for s, (target, drafter) in pairs.items():
        cache = target.new_cache()
        last, feats = target.prefill(cache, ids[:-1])
        dcache = drafter.new_cache()
        drafter.draft([dcache], [ids[-1]], [feats[:-1]])
        state[s] = (cache, dcache, feats)
    times = {s: {"draft": [], "verify": [], "decode": []} for s in settings}
    n = len(ids) - 1
    for _ in range(rounds):
        for s, (target, drafter) in pairs.items():
            cache, dcache, feats = state[s]
            dcache.truncate(n - 1)
            t0 = time.perf_counter()
            drafter.draft([dcache], [ids[-1]], [feats[-1:]])
            t1 = time.perf_counter()
            target.forward([cache], [ids[-1:] * (k + 1)])
            cache.truncate(n)
            t2 = time.perf_counter()
            target.forward([cache], [ids[-1:]])
            cache.truncate(n)
            t3 = time.perf_counter()
            for key, dt in (("draft", t1 - t0), ("verify", t2 - t1), ("decode", t3 - t2)):
                times[s][key].append(dt)
    return {f"threads={t},spin={sp}": {key: round(1000 * statistics.median(v[key][1:]), 3) for key in v}
            for (t, sp), v in times.items()}


DRAFTER_QUANT = ("dynamic-int8", "nbits8", "nbits4")


def quantize_drafter_graph(src: Path, dst: Path, method: str) -> None:
    """Quantize a drafter graph's constant MatMul weights: ``dynamic-int8`` (``quantize_dynamic``, int8 per tensor)
    or ``nbits8`` / ``nbits4`` (export/drafter_quant.py's MatMulNBits pass, layers only: the borrowed LM head stays a
    float runtime input, as before the export adopted int8). ``src`` must be an fp32 drafter graph
    (``sharpdraft-export --drafter-precision fp32``); the beta nodes are untouched (they multiply the query)."""
    if method == "dynamic-int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        return
    from export.drafter_quant import quantize_drafter_graph as nbits

    nbits(src, dst, None, None, None, layer_bits={"nbits8": 8, "nbits4": 4}[method])


def time_int8_drafter(engine_dir: Path, manifest, ids: list[int], positions: int, rounds: int,
                      work: Path, method: str = "dynamic-int8") -> dict:
    """The drafter graph with quantized weights (:func:`quantize_drafter_graph` ``method``) against the exported
    float graph, on real features of ``ids``.

    Both drafters draft at each of the last ``positions`` positions of the prompt (the target's own taps as
    context, as in the loop); reported: median draft-call ms of each, interleaved, and how often the int8 graph
    proposes the same tokens (slot 1, and all slots). The target is untouched (fp32 verification stays exact).
    """
    import shutil

    from runtime.backends.ort import OrtDFlashDrafter, OrtTarget

    q_dir = work / f"{method}-engines"
    shutil.rmtree(q_dir, ignore_errors=True)
    (q_dir / "drafter").mkdir(parents=True)
    for name in ("target", "tokenizer", "manifest.json"):
        (q_dir / name).symlink_to((engine_dir / name).resolve())
    src = engine_dir / manifest.graphs["drafter"].file
    for f in src.parent.iterdir():
        if f.suffix == ".json":
            shutil.copyfile(f, q_dir / "drafter" / f.name)
    quantize_drafter_graph(src, q_dir / manifest.graphs["drafter"].file, method)
    drafters = {"fp32": OrtDFlashDrafter(engine_dir, manifest, "cpu", None),
                "int8": OrtDFlashDrafter(q_dir, manifest, "cpu", None)}
    size = {name: sum(f.stat().st_size for f in (d / "drafter").iterdir() if not f.suffix == ".json")
            for name, d in (("fp32", engine_dir), ("int8", q_dir))}
    target = OrtTarget(engine_dir, manifest, "cpu", None)
    _, feats = target.prefill(target.new_cache(), ids)
    start = len(ids) - positions
    times = {name: [] for name in drafters}
    same_first = same_all = 0
    for _ in range(rounds):
        caches = {name: d.new_cache() for name, d in drafters.items()}
        for name, d in drafters.items():
            d.draft([caches[name]], [ids[start - 1]], [feats[: start - 1]])
        for p in range(start, len(ids)):
            tokens = {}
            for name in (("fp32", "int8") if p % 2 else ("int8", "fp32")):
                t0 = time.perf_counter()
                logits = drafters[name].draft([caches[name]], [ids[p]], [feats[p - 1: p]])
                times[name].append(time.perf_counter() - t0)
                tokens[name] = logits[0].argmax(-1)
            same_first += int(tokens["fp32"][0] == tokens["int8"][0])
            same_all += int((tokens["fp32"] == tokens["int8"]).all())
    n = rounds * positions
    return {"method": method,
            "draft_ms": {name: round(1000 * statistics.median(v), 3) for name, v in times.items()},
            "same_slot1": round(same_first / n, 4), "same_all_slots": round(same_all / n, 4), "positions": n,
            "drafter_bytes": size}


def time_prefill(engine_dir: Path, manifest, ids: list[int], chunks: list[int], threads: int | None,
                 rounds: int) -> dict:
    """Median prefill seconds of ``ids`` per chunk size (0 = the whole prompt in one call)."""
    from runtime.backends.ort import OrtTarget

    target = OrtTarget(engine_dir, manifest, "cpu", threads)
    times = {c: [] for c in chunks}
    for _ in range(rounds):
        for c in chunks:
            target.prefill_chunk = c or len(ids)
            t0 = time.perf_counter()
            target.prefill(target.new_cache(), ids)
            times[c].append(time.perf_counter() - t0)
    return {str(c): round(statistics.median(v), 3) for c, v in times.items()}


def time_kv_forms(folders: dict[str, Path], contexts: list[int], k: int, rounds: int) -> dict:
    """Median ms of a decode step and a verify call (1 + k tokens) per target graph form, and of a DFlash draft
    call (2 new context rows) per drafter graph form, at each context length, with the part spent inside ONNX
    Runtime. Caches hold random K/V (timing does not depend on values)."""
    from runtime.manifest import load_manifest
    from runtime.backends.ort import OrtTarget

    from runtime.kv_cache import StaticKVCache
    from runtime.backends.ort import OrtDFlashDrafter, ort_drafter_class

    manifests = {name: load_manifest(d) for name, d in folders.items()}
    targets = {name: OrtTarget(d, manifests[name], "cpu", None) for name, d in folders.items()}
    drafters = {name: OrtDFlashDrafter(d, manifests[name], "cpu", None) for name, d in folders.items()
                if ort_drafter_class(manifests[name].drafter.family) is OrtDFlashDrafter}
    rng = np.random.default_rng(0)
    out = {}

    def filled(graph, n):
        cache = graph.new_cache()
        kv = [rng.standard_normal((1, graph.kv_heads, n, graph.head_dim)).astype(np.float32)
              for _ in range(2 * graph.num_layers)]
        if isinstance(cache, StaticKVCache):
            cache.append(kv, n)
        else:
            cache.kv = kv
        return cache

    for n in contexts:
        caches = {name: filled(t, n) for name, t in targets.items()}
        dcaches = {name: filled(d, n) for name, d in drafters.items()}
        feats = {name: rng.standard_normal((2, next(i.shape[2] for i in d.session.get_inputs()
                                                    if i.name == "target_hidden"))).astype(np.float32)
                 for name, d in drafters.items()}
        times = {name: {key: [] for key in ("decode", "verify", "decode_ort", "verify_ort")
                        + (("draft", "draft_ort") if name in drafters else ())} for name in targets}
        for _ in range(rounds):
            for name, t in targets.items():
                for key, q in (("decode", 1), ("verify", k + 1)):
                    ort0, t0 = t.ort_s, time.perf_counter()
                    t.forward([caches[name]], [[100] * q])
                    times[name][key].append(time.perf_counter() - t0)
                    times[name][key + "_ort"].append(t.ort_s - ort0)
                    caches[name].truncate(n)
                if name in drafters:
                    d = drafters[name]
                    ort0, t0 = d.ort_s, time.perf_counter()
                    d.draft([dcaches[name]], [100], [feats[name]])
                    times[name]["draft"].append(time.perf_counter() - t0)
                    times[name]["draft_ort"].append(d.ort_s - ort0)
                    dcaches[name].truncate(n)
        out[str(n)] = {name: {key: round(1000 * statistics.median(v[1:]), 3) for key, v in d.items()}
                       for name, d in times.items()}
    return out


def _plot(result: dict, out: Path) -> Path:
    fig, axes = figure(2, (11, 4))
    names = list(result["threads"])
    x = np.arange(len(names))
    for j, key in enumerate(("draft", "verify", "decode")):
        axes[0].bar(x + (j - 1) * 0.27, [result["threads"][n][key] for n in names], 0.27, label=key)
    axes[0].set_xticks(x, names, rotation=15, fontsize=8)
    axes[0].set(ylabel="ms (median)", title=f"ORT settings at {result['context']} tokens (verify 1 + {result['k']})")
    axes[0].legend()
    chunks = list(result["prefill_s"])
    axes[1].bar(range(len(chunks)), [result["prefill_s"][c] for c in chunks])
    axes[1].set_xticks(range(len(chunks)), [c if c != "0" else "whole" for c in chunks])
    axes[1].set(xlabel="prefill chunk (tokens)", ylabel="prefill s (median)",
                title=f"prefill of {result['prefill_tokens']} tokens")
    return save_figure(fig, out / "settings.png")


@click.command()
@click.option("--engine", "engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=ROOT / "engines", show_default=True)
@click.option("--context", default=1024, show_default=True, type=int, help="cache length for the thread timings")
@click.option("--prefill-tokens", default=4096, show_default=True, type=int)
@click.option("--chunks", default="256,512,1024,0", show_default=True, help="prefill chunk sizes (0 = whole)")
@click.option("--k", default=2, show_default=True, type=int, help="draft tokens per verify call")
@click.option("--rounds", default=15, show_default=True, type=click.IntRange(2, 1000))
@click.option("--compare-engine", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="an engines folder with concat-form graphs: time both KV forms side by side")
@click.option("--kv-contexts", default="512,2048,6144", show_default=True)
@click.option("--skip-threads", is_flag=True,
              help="skip the thread and prefill timings (run only --compare-engine and/or --int8-drafter)")
@click.option("--int8-drafter", is_flag=True,
              help="also time the drafter graph with int8 weights (onnxruntime.quantization) against fp32")
@click.option("--drafter-quant", type=click.Choice(DRAFTER_QUANT), default="dynamic-int8", show_default=True,
              help="how --int8-drafter quantizes: quantize_dynamic, or MatMulNBits 8 / 4 bit (block 32, int8 "
                   "activations)")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench/settings"),
              show_default=True)
def main(engine_dir: Path, context: int, prefill_tokens: int, chunks: str, k: int, rounds: int,
         compare_engine: Path | None, kv_contexts: str, skip_threads: bool, int8_drafter: bool, drafter_quant: str,
         out: Path) -> None:
    """Time ONNX Runtime thread / spinning settings and prefill chunk sizes on an engines folder."""
    from runtime.manifest import load_manifest
    from training.corpus import document_prompts as _prompts
    from transformers import AutoTokenizer

    manifest = load_manifest(engine_dir)
    tok = AutoTokenizer.from_pretrained(engine_dir / "tokenizer")
    longest = max(context, prefill_tokens)
    ids = _prompts(tok, [longest], 7700, ["hamlet_gut"])[f"hamlet_gut@{longest}"]
    cores = os.cpu_count() or 1
    settings = [(t, sp) for t in sorted({1, cores}) for sp in ("0", "1")]
    result = {"engine": str(engine_dir), "context": context, "k": k, "cores": cores}
    if not skip_threads:
        result["threads"] = time_threads(engine_dir, manifest, ids[-context:], settings, k, rounds)
        result["prefill_tokens"] = prefill_tokens
        result["prefill_s"] = time_prefill(engine_dir, manifest, ids[-prefill_tokens:],
                                           [int(c) for c in chunks.split(",")], None, max(2, rounds // 5))
    if compare_engine is not None:
        result["kv_forms"] = time_kv_forms({"static": engine_dir, "concat": compare_engine},
                                           [int(c) for c in kv_contexts.split(",")], k, rounds)
    out.mkdir(parents=True, exist_ok=True)
    if int8_drafter:
        result["int8_drafter"] = time_int8_drafter(engine_dir, manifest, ids[-context:], 32, max(1, rounds // 5),
                                                   out, drafter_quant)
    name = ("bench_settings.json" if not skip_threads else "bench_kv_forms.json" if compare_engine is not None
            else "bench_int8_drafter.json")
    (out / name).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k in ("threads", "prefill_s", "kv_forms", "int8_drafter")}, indent=1))
    print("wrote", out / name, *([_plot(result, out)] if not skip_threads else []))


if __name__ == "__main__":
    main()
