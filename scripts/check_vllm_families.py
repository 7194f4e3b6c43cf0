"""One-off checks of the vLLM export beyond tests/vllm (minutes of engine loads each; docs/vllm.md records the
figures): EAGLE-3 and PARD MAL in vLLM vs sharpdraft's loop on fp32 ONNX Runtime exports of the same drafters, the
speculators-layout EAGLE-3, the all-sliding DFlash drafter, and what vLLM's CPU runner says to the default (mixed
sliding / full) DFlash drafter and to a config without a profile.

    python scripts/check_vllm_families.py --eagle3-fp32 engines-eagle3-fp32/ --pard-fp32 engines-pard-fp32/ \\
        --out runs/check_vllm
(the fp32 folders: ``sharpdraft-export --drafter eagle3 --dtype fp32 --out engines-eagle3-fp32/``, same for pard)
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from export.vllm_export import run as export_vllm
from plugins.rule import Family
# scripts/ is this script's own folder (sys.path[0] when run as `python scripts/check_vllm_families.py`)
from bench_vllm import REPO, VLLM_PYTHON, resolve_default_target, run_sharpdraft, run_vllm, speculative_config

NEW_TOKENS = 48


def _prompts() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from training.corpus import chat_prompts, heldout_prompts

    tok = AutoTokenizer.from_pretrained(resolve_default_target())
    chats = chat_prompts("heldout", tok, n=2)
    return {"chat0": chats[0], "chat1": chats[1], "hamlet@1600": heldout_prompts(tok, 1600, 0)["hamlet_gut"]}


def _pooled(rows: list[dict], k: int) -> dict:
    drafts = sum(r["num_drafts"] for r in rows)
    acc = [sum(r["accepted_per_pos"][j] for r in rows if j < len(r["accepted_per_pos"])) for j in range(k)]
    return {"mal": round(1 + sum(acc) / drafts, 4), "acceptance": [round(a / drafts, 4) for a in acc],
            "drafts": drafts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eagle3-fp32", type=Path, required=True)
    p.add_argument("--pard-fp32", type=Path, required=True)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "check_vllm")
    a = p.parse_args()
    prompts = _prompts()
    groups = {n: [ids] for n, ids in prompts.items()}
    d = a.out / "drafters"
    folders = {"eagle3-on": export_vllm(Family.EAGLE3, d / "eagle3-on"),
               "pard-on": export_vllm(Family.PARD, d / "pard-on"),
               "eagle3-stock": export_vllm(Family.EAGLE3, d / "eagle3-stock", architecture="stock"),
               "dflash-swa768": export_vllm(Family.DFLASH, d / "dflash-swa768",
                                            REPO / "drafters" / "dflash-smollm2-135m-swa768"),
               "dflash-default": export_vllm(Family.DFLASH, d / "dflash-default",
                                             REPO / "drafters" / "dflash-smollm2-135m-swa768-1full")}
    spec = d / "eagle3-speculators"  # the speculators library lives in .venv-vllm
    subprocess.run([str(VLLM_PYTHON), "-m", "export.vllm_export", "--drafter", "eagle3", "--layout", "speculators",
                    "--target", str(resolve_default_target()), "--out", str(spec)], cwd=REPO, check=True,
                   capture_output=True)
    folders["eagle3-speculators"] = spec
    noprof = export_vllm(Family.DFLASH, d / "dflash-noprofile")
    cfg = json.loads((noprof / "config.json").read_text())
    del cfg["sharpdraft_query_scale"]
    (noprof / "config.json").write_text(json.dumps(cfg))
    folders["dflash-noprofile"] = noprof
    runs = [{"name": "target", "speculative_config": None, "prompts": groups, "max_tokens": NEW_TOKENS}]
    for name, folder in folders.items():
        runs.append({"name": name, "speculative_config": speculative_config(name.split("-")[0], folder),
                     "prompts": groups, "max_tokens": NEW_TOKENS})
    res = run_vllm(resolve_default_target(), runs, a.out, max_model_len=2048)
    base = res["target"]["groups"]
    report = {}
    for name, r in res.items():
        if "error" in r:
            log = (a.out / "vllm.log").read_text().splitlines()
            cause = [line for line in log if "Error:" in line and ("sharpdraft" in line or "DFlash" in line)]
            report[name] = {"error": r["error"], "cause": cause[-1] if cause else None}
            continue
        g = r["groups"]
        report[name] = {"lossless": all(g[n]["outputs"] == base[n]["outputs"] for n in g),
                        **({"vllm": _pooled(list(g.values()), 7)} if name != "target" else {})}
    for fam, folder in (("eagle3", a.eagle3_fp32), ("pard", a.pard_fp32)):
        ours = {n: run_sharpdraft(folder, [ids], NEW_TOKENS, draft_tokens=3) for n, ids in prompts.items()}
        same = [n for n in prompts if ours[n]["outputs"] == base[n]["outputs"]]
        report[f"{fam}-on"]["same_output_prompts"] = same
        report[f"{fam}-on"]["vllm_same"] = _pooled([res[f"{fam}-on"]["groups"][n] for n in same], 3)
        report[f"{fam}-on"]["sharpdraft_fp32_same"] = _pooled([ours[n] for n in same], 3)
    (a.out / "check_vllm.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
