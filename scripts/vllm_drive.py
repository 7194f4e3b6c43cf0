"""Run vLLM (offline ``LLM``) on token-id prompts for a list of configurations and write what happened as JSON:
the generated ids, vLLM's spec-decode counters (``llm.get_metrics()``), load and decode time. Runs inside
``.venv-vllm`` (scripts/setup_vllm.sh); tests/vllm and scripts/bench_vllm.py call it as a subprocess, so the main
environment never imports vLLM.

    .venv-vllm/bin/python scripts/vllm_drive.py --spec spec.json --out result.json

spec.json: ``{"target": HF folder, "max_model_len": 2048, "runs": [{"name": "...", "speculative_config": {...} or
null, "prompts": [[ids], ...], "max_tokens": 64, "env": {...}}]}``. Each run gets a fresh engine (vLLM's counters
are cumulative per engine); a run that fails records its error line and the next one still runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback


def _spec_counters(llm) -> dict:
    """vLLM's spec-decode counters: drafts, draft tokens, accepted tokens, accepted per position."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] = int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    d = out["num_drafts"]
    out["mal"] = 1 + out["num_accepted_tokens"] / d if d else None  # mean accepted length, bonus included
    out["acceptance_per_pos"] = [a / d for a in out["accepted_per_pos"]] if d else []
    return out


def run_one(target: str, run: dict, max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.update({k: str(v) for k, v in (run.get("env") or {}).items()})
    t0 = time.perf_counter()
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
              max_num_seqs=run.get("max_num_seqs", 4), enable_prefix_caching=False,
              kv_cache_memory_bytes=run.get("kv_cache_bytes", 1 << 30), disable_log_stats=False,
              speculative_config=run.get("speculative_config"), seed=0)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=run.get("ignore_eos", False))
    groups = run["prompts"] if isinstance(run["prompts"], dict) else {"all": run["prompts"]}
    res = {"name": run["name"], "load_s": load_s, "groups": {}}
    before = _spec_counters(llm)
    for group, prompts in groups.items():  # counters are cumulative per engine: each group gets the difference
        outputs, generate_s, decode_s = [], 0.0, 0.0
        for ids in prompts:  # one request at a time: per-request latency, as the single-stream benches
            t = time.perf_counter()
            o = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            generate_s += time.perf_counter() - t
            outputs.append(list(o.outputs[0].token_ids))
            # decode = first token to last token, the engine core's own timestamps (RequestStateStats, kept
            # because disable_log_stats=False): prefill and the first token excluded, as runtime/benchmarking.py
            decode_s += _decode_seconds(o)
        after = _spec_counters(llm)
        g = _difference(after, before)
        before = after
        g.update(outputs=outputs, generate_s=generate_s, decode_s=decode_s, new_tokens=sum(map(len, outputs)))
        g["tokens_per_s"] = g["new_tokens"] / generate_s if generate_s else None  # end to end, prefill included
        decoded = g["new_tokens"] - len(outputs)  # the first token of each request comes from prefill
        g["decode_tokens_per_s"] = decoded / decode_s if decode_s > 0 else None
        res["groups"][group] = g
    if not isinstance(run["prompts"], dict):
        res.update(res.pop("groups")["all"])
    del llm
    gc.collect()
    return res


def _decode_seconds(output) -> float:
    """Seconds from a request's first generated token to its last (vLLM v1 ``RequestStateStats``); 0.0 when vLLM
    kept no stats for it (one token generated, or stats disabled)."""
    m = getattr(output, "metrics", None)
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    return max(last - first, 0.0) if first and last else 0.0


def _difference(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pa, pb = after["accepted_per_pos"], before["accepted_per_pos"]
    out["accepted_per_pos"] = [a - (pb[i] if i < len(pb) else 0) for i, a in enumerate(pa)]
    d = out["num_drafts"]
    out["mal"] = 1 + out["num_accepted_tokens"] / d if d else None
    out["acceptance_per_pos"] = [a / d for a in out["accepted_per_pos"]] if d else []
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    spec = json.load(open(a.spec))
    results = []
    for run in spec["runs"]:
        try:
            results.append(run_one(spec["target"], run, spec.get("max_model_len", 2048)))
        except Exception as e:  # recorded per run: the test or bench says which configuration failed and why
            results.append({"name": run["name"], "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-4000:]})
        with open(a.out, "w") as f:
            json.dump({"results": results}, f)
    import vllm

    with open(a.out, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "results": results}, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps the child from re-running main()
    main()
