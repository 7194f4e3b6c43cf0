"""Serving benchmark: a concurrency sweep against the OpenAI-compatible server, speculative vs target-only.

Starts ``python -m runtime.serve``'s app in-process on a loopback port (or measures ``--url``), then for each
concurrency level (``--concurrency 1,2,4,8,16``) and each configuration runs ``--requests`` streamed completions
through the ``openai`` SDK from that many client threads, rotating held-out prose, code and chat prompts:

- ``speculative``: the engines folder's draft length (``verify_draft_tokens``) at any load;
- ``adaptive``: per-request adaptive draft length (``--adaptive-draft-tokens``);
- ``by-batch``: draft length by the number of running requests (``--draft-tokens-by-batch``, ``--table``);
- ``target-only``: the same server with ``speculative: false`` per request (the baseline).

Configurations are rotated at each level (so none always runs first, on a cold or a warm machine). Per level and
configuration: output tokens/s (all completion tokens / wall time), TTFT and TPOT (mean and p50, from the stream),
MAL and acceptance per position (from the vLLM-named counters of /metrics, before/after deltas), errors.
Writes JSON and a PNG (throughput and TTFT vs concurrency).

    python scripts/bench_serve.py --engine engines/ --concurrency 1,2,4,8 --requests 12 --max-tokens 64 \\
        --out docs/performance/bench_serve-2026-12-02.json
"""
from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
from pathlib import Path

import click

from runtime.benchmarking import figure, rotated, save_figure

CONFIGS = ("speculative", "adaptive", "by-batch", "target-only")
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def prompts_for(tok, context: int, chat: int) -> list[tuple[str, list[int]]]:
    """Held-out prompts as token ids: prose and code documents at ``context`` tokens, and chat prompts."""
    from training.corpus import chat_prompts, document_kind
    from training.corpus import document_prompts as _prompts

    out = [(f"{document_kind(name)}/{name}", ids)
           for name, ids in _prompts(tok, [context], 3500, ["hamlet_gut", "argparse.py", "othello_gut",
                                                            "typing.py"]).items()]
    out += [(f"chat/{i}", ids) for i, ids in enumerate(chat_prompts("heldout", tok, chat))]
    # interleave kinds so every slice of the list mixes prose, code and chat
    kinds = {}
    for name, ids in out:
        kinds.setdefault(name.split("/")[0], []).append((name, ids))
    mixed = []
    while any(kinds.values()):
        for k in list(kinds):
            if kinds[k]:
                mixed.append(kinds[k].pop(0))
    return mixed


def scrape(url: str) -> dict:
    """The vLLM-named speculative counters of /metrics: ``{name: total, ("pos", j): total}``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            if fam.name in SPEC_COUNTERS:
                out[fam.name] = out.get(fam.name, 0.0) + s.value
            elif fam.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                key = ("pos", int(s.labels["position"]))
                out[key] = out.get(key, 0.0) + s.value
    return out


def run_level(url: str, model: str, prompts: list, concurrency: int, requests: int, max_tokens: int,
              speculative: bool, time_limit: float) -> dict:
    """``requests`` streamed completions from ``concurrency`` threads; figures of the batch."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    lock = threading.Lock()
    next_i = [0]
    rows: list[dict] = []
    deadline = time.perf_counter() + time_limit

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= requests or time.perf_counter() > deadline:
                    return
                next_i[0] += 1
            name, ids = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            first = None
            n = 0
            try:
                stream = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"speculative": speculative, "ignore_eos": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and first is None:
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
                end = time.perf_counter()
                row = {"prompt": name, "ttft_s": (first or end) - t0, "tokens": n,
                       "tpot_s": (end - (first or end)) / (n - 1) if n > 1 else None, "error": None}
            except Exception as e:  # noqa: BLE001 - counted, reported
                row = {"prompt": name, "error": repr(e), "tokens": 0, "ttft_s": None, "tpot_s": None}
            with lock:
                rows.append(row)

    before = scrape(url)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = scrape(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("vllm:spec_decode_num_drafts", 0.0)
    ok = [r for r in rows if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    positions = sorted(k[1] for k in delta if isinstance(k, tuple))
    return {"requests": len(rows), "errors": len(rows) - len(ok), "wall_s": round(wall, 3),
            "output_tokens": sum(r["tokens"] for r in ok),
            "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 3) if wall else 0.0,
            "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else None,
            "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
            "tpot_mean_s": round(statistics.fmean(tpot), 5) if tpot else None,
            "tpot_p50_s": round(statistics.median(tpot), 5) if tpot else None,
            "mal": round(1 + delta.get("vllm:spec_decode_num_accepted_tokens", 0.0) / drafts, 4) if drafts else None,
            "mean_draft_tokens": round(delta.get("vllm:spec_decode_num_draft_tokens", 0.0) / drafts, 3)
            if drafts else None,
            "acceptance_per_position": [round(delta[("pos", j)] / drafts, 4) for j in positions] if drafts else [],
            "error_samples": [r["error"] for r in rows if r["error"]][:3]}


def summarise(result: dict) -> dict:
    """Per level: each speculative configuration's throughput over target-only's."""
    out = {}
    for level, cfgs in result["levels"].items():
        base = cfgs.get("target-only", {}).get("output_tokens_per_s")
        out[level] = {c: round(v["output_tokens_per_s"] / base, 3) for c, v in cfgs.items()
                      if c != "target-only" and base}
    return out


def plot(result: dict, path: Path) -> Path:
    levels = [int(x) for x in result["levels"]]
    fig, axes = figure(2, (11, 4))
    for cfg in result["configs"]:
        tps = [result["levels"][str(c)][cfg]["output_tokens_per_s"] for c in levels]
        ttft = [result["levels"][str(c)][cfg]["ttft_mean_s"] for c in levels]
        axes[0].plot(levels, tps, marker="o", label=cfg)
        axes[1].plot(levels, ttft, marker="o", label=cfg)
    axes[0].set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    axes[1].set(xscale="log", xlabel="concurrent clients", ylabel="mean TTFT (s)", title="time to first token")
    for ax in axes:
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.legend()
    fig.suptitle(f"bench_serve: {result['engine']} ({result['machine']})", fontsize=9)
    return save_figure(fig, path)


@click.command()
@click.option("--engine", "engine_dir", default="engines", type=click.Path(path_type=Path))
@click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="client counts, comma-separated")
@click.option("--requests", default=16, show_default=True, help="requests per level and configuration (at least "
              "the concurrency is used)")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--context", default=512, show_default=True, help="tokens of the prose and code prompts")
@click.option("--chat", default=4, show_default=True, help="held-out chat prompts in the rotation")
@click.option("--configs", default=",".join(CONFIGS), show_default=True,
              help=f"subset of {', '.join(CONFIGS)}")
@click.option("--table", default="1-2:7,3-4:3,5-8:1,9-:0", show_default=True,
              help="the by-batch configuration's table (runtime/draft_length.py)")
@click.option("--max-running", default=16, show_default=True)
@click.option("--level-seconds", default=300.0, show_default=True, help="time limit per level and configuration")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/bench_serve.json"), show_default=True)
def main(engine_dir, concurrency, requests, max_tokens, context, chat, configs, table, max_running, level_seconds,
         threads, out):
    """Concurrency sweep of the server: speculative configurations vs target-only (module docstring)."""
    import platform

    from runtime.async_engine import AsyncEngine
    from runtime.draft_length import DraftTokensByBatch
    from runtime.engine import SpecEngine
    from runtime.serve import serve_in_thread

    levels = [int(c) for c in concurrency.split(",")]
    cfgs = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = set(cfgs) - set(CONFIGS)
    if unknown:
        raise click.BadParameter(f"unknown configurations {sorted(unknown)}", param_hint="--configs")
    by_batch = DraftTokensByBatch.parse(table)
    engine = SpecEngine.from_dir(engine_dir, threads=threads)
    prompts = prompts_for(engine.tokenizer, context, chat)
    import os

    result = {"engine": str(engine_dir), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "date": time.strftime("%Y-%m-%d"), "configs": cfgs, "max_tokens": max_tokens, "context": context,
              "table": str(by_batch), "verify_draft_tokens": engine.default_draft_tokens,
              "prompts": [n for n, _ in prompts], "levels": {}}
    with contextlib.ExitStack() as stack:  # one server per configuration, all over the same backends
        urls = {cfg: stack.enter_context(serve_in_thread(AsyncEngine(
            engine.with_options(adaptive_draft_tokens=cfg == "adaptive",
                                draft_tokens_by_batch=by_batch if cfg == "by-batch" else None),
            max_running=max_running, max_waiting=4 * max(levels)), "bench")) for cfg in cfgs}
        run_level(urls[cfgs[0]], "bench", prompts, 1, 2, 8, True, 60)  # warm-up (graph init, first allocations)
        for li, c in enumerate(levels):
            order = rotated(cfgs, li)  # rotated per level
            result["levels"][str(c)] = {}
            for cfg in order:
                row = run_level(urls[cfg], "bench", prompts, c, max(requests, c), max_tokens, cfg != "target-only",
                                level_seconds)
                result["levels"][str(c)][cfg] = row
                click.echo(f"c={c:3d} {cfg:12s} {row['output_tokens_per_s']:8.1f} tok/s  TTFT "
                           f"{row['ttft_mean_s']}  MAL {row['mal']}  errors {row['errors']}")
            result["levels"][str(c)] = {k: result["levels"][str(c)][k] for k in cfgs}
    result["throughput_over_target_only"] = summarise(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    png = plot(result, out.with_suffix(".png"))
    click.echo(json.dumps(result["throughput_over_target_only"]))
    click.echo(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
