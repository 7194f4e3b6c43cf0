"""vLLM (CPU, ``.venv-vllm``) vs sharpdraft's runtime on the same held-out prompts: MAL with the query scale on and
off, acceptance per position, decode tokens/s, lossless per row; JSON + PNG.

    python scripts/bench_vllm.py --contexts 512,4096 --new-tokens 64 --out runs/bench_vllm

Prompts: the held-out documents of training/corpus.py (hamlet, othello, macbeth, argparse.py, typing.py,
subprocess.py), each the ``--context`` tokens ending at token 3500 (as scripts/eval_mal.py picks them; 4k contexts
take the first 4096 tokens of each document instead, which end past 3500). Configurations, each one vLLM engine for
all contexts: vLLM target-only, vLLM + ngram, vLLM + each drafter exported by ``sharpdraft-export-vllm`` with the
scale on and off (the plugin's classes). sharpdraft's side: ``--engine`` folders (for example the default int4
engines/ and an fp32 export of the same drafter) with the scale on and off, drafter alone (no prompt lookup), every
draft token verified. Weights: vLLM runs fp32 torch; sharpdraft runs whatever each engines folder holds. Speed: decode
tokens/s from the first generated token to the last (vLLM's engine-core timestamps; sharpdraft's ``decode_s``), so
prefill, which differs most between the two, is left out; end-to-end tokens/s is kept in the JSON beside it.

The helpers :func:`run_vllm` and :func:`run_sharpdraft` are what tests/vllm uses.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.ort_threads import THREAD_POOL_ENV, THREAD_POOLS
from runtime.ort_threads import apply as apply_thread_pool

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = REPO / "scripts" / "vllm_drive.py"
# vLLM's speculative_config per family: DFlash drafts a block of B - 1 = 7; EAGLE-3 and PARD chains of 3 (PARD:
# vLLM's draft_model with parallel drafting)
SPEC_METHODS = {"dflash": {"method": "dflash", "num_speculative_tokens": 7},
                "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
                "pard": {"method": "draft_model", "num_speculative_tokens": 3, "parallel_drafting": True}}


class VllmRunError(RuntimeError):
    """The vLLM subprocess failed; the message carries the tail of its log."""


def speculative_config(family: str, folder: str | Path, k: int | None = None) -> dict:
    cfg = dict(SPEC_METHODS[family], model=str(folder))
    if k is not None:
        cfg["num_speculative_tokens"] = k
    return cfg


def run_vllm(target: str | Path, runs: list[dict], workdir: Path, *, max_model_len: int = 2048,
             timeout_s: int = 1800) -> dict[str, dict]:
    """Run ``runs`` (scripts/vllm_drive.py's spec) in ``.venv-vllm``; {name: result}. Log: ``workdir/vllm.log``.

    Raises:
        VllmRunError: the driver process failed (no result file).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec, out, log = workdir / "spec.json", workdir / "result.json", workdir / "vllm.log"
    spec.write_text(json.dumps({"target": str(target), "max_model_len": max_model_len, "runs": runs}))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    env.pop("PYTHONPATH", None)
    with open(log, "w") as f:
        proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), "--spec", str(spec), "--out", str(out)],
                              stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout_s)
    if not out.is_file():
        raise VllmRunError(f"vLLM driver exited {proc.returncode}:\n" + log.read_text()[-4000:])
    return {r["name"]: r for r in json.loads(out.read_text())["results"]}


def run_sharpdraft(engine_dir: Path, prompts: list[list[int]], max_new_tokens: int, *, backend: str = "onnxruntime",
                   draft_tokens: int | None = None, query_scale: bool = True, target_only: bool = False,
                   ignore_eos: bool = False) -> dict:
    """Greedy generations of sharpdraft's loop, drafter alone (no prompt lookup), ``draft_tokens`` verified per
    round: outputs and pooled counters in vLLM's terms (drafts = rounds, accepted per position)."""
    from runtime.engine import SpecEngine
    from runtime.sampling import SamplingParams

    engine = _engine(engine_dir, backend)
    outputs, drafts, accepted, seconds, decode_s = [], 0, [], 0.0, 0.0
    for ids in prompts:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, num_draft_tokens=draft_tokens,
                                query_scale=query_scale, ignore_eos=ignore_eos)
        t = time.perf_counter()
        r = engine.generate_target_only(ids, params=params) if target_only else engine.generate(ids, params=params)
        seconds += time.perf_counter() - t
        decode_s += r.stats.decode_s  # after the first token (prefill excluded), as vLLM's first-to-last token
        outputs.append(list(r.token_ids))
        if not target_only:
            drafts += r.stats.rounds
            acc = r.stats.accepted_per_position
            accepted = [a + (acc[i] if i < len(acc) else 0) for i, a in enumerate(accepted)] + list(acc[len(accepted):])
    new = sum(map(len, outputs))
    return {"outputs": outputs, "num_drafts": drafts, "accepted_per_pos": accepted,
            "mal": 1 + sum(accepted) / drafts if drafts else None,
            "acceptance_per_pos": [a / drafts for a in accepted] if drafts else [],
            "new_tokens": new, "generate_s": seconds, "tokens_per_s": new / seconds if seconds else None,
            "decode_s": decode_s, "decode_tokens_per_s": (new - len(outputs)) / decode_s if decode_s else None}


_ENGINES: dict = {}


def _engine(engine_dir: Path, backend: str):
    key = (str(engine_dir), backend)
    if key not in _ENGINES:
        from runtime.engine import SpecEngine

        _ENGINES[key] = (torch_dflash_engine(engine_dir) if backend == "torch-checkpoint"
                         else SpecEngine.from_dir(engine_dir, backend=backend))
    return _ENGINES[key]


def torch_dflash_engine(checkpoint: Path):
    """sharpdraft's loop on the torch backend (fp32 target and DFlash drafter, the fused query-scale op) built
    straight from a DFlash checkpoint and the default target, with the checkpoint's draft vocabulary and profile:
    what an fp32 ``sharpdraft-export --backend torch`` folder rebuilds, without writing the ONNX graphs."""
    from plugins.rule import QueryScaleProfile
    from runtime.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
    from runtime.engine import SpecEngine
    from runtime.backends.pytorch import TorchDFlashDrafter, TorchTarget

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    target = TorchTarget.load(None, cfg["dflash_config"]["target_layer_ids"], "cpu")
    drafter = TorchDFlashDrafter.load(checkpoint, target, QueryScaleProfile.from_dict(cfg["sharpdraft_query_scale"]),
                                      "cpu")
    if (Path(checkpoint) / DRAFT_VOCAB_FILE).is_file():
        drafter.set_draft_ids(load_draft_vocab(Path(checkpoint) / DRAFT_VOCAB_FILE, target.vocab_size))
    gen = json.loads((resolve_default_target() / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    return SpecEngine(target, drafter, eos_token_ids=eos, proposable_vocab=target.vocab_size)


def resolve_default_target() -> Path:
    from runtime.models.target import resolve_target

    return resolve_target(None)


def heldout_documents(context: int) -> dict[str, list[int]]:
    """{document: ``context`` prompt ids} from training/corpus.py's held-out documents (no chat prompts)."""
    from transformers import AutoTokenizer

    from runtime.models.target import resolve_target
    from training.corpus import END_TOKEN, heldout_prompts

    tok = AutoTokenizer.from_pretrained(resolve_target(None))
    return heldout_prompts(tok, context, 0, max(END_TOKEN, context))


def _plot(rows: list[dict], path: Path) -> None:
    """Two panels per configuration and context: MAL (bonus included) and decode tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    contexts = sorted({r["context"] for r in rows})
    width = 0.8 / max(len(contexts), 1)
    for ax, key, ylabel in ((axes[0], "mal", "MAL (bonus included)"),
                            (axes[1], "decode_tokens_per_s", "decode tokens/s (prefill excluded)")):
        labels = sorted({r["config"] for r in rows if r.get(key)})
        for j, c in enumerate(contexts):
            vals = [next((r[key] for r in rows if r["config"] == lab and r["context"] == c and r.get(key)), 0)
                    for lab in labels]
            ax.bar([i + j * width for i in range(len(labels))], vals, width, label=f"{c} tokens")
        ax.set_xticks([i + width * (len(contexts) - 1) / 2 for i in range(len(labels))], labels, rotation=35,
                      ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--families", default="dflash,eagle3,pard")
    p.add_argument("--engine", action="append", default=[],
                   help="NAME=DIR[:BACKEND] sharpdraft engines folder(s), e.g. int4=engines fp32=engines-fp32:torch")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_vllm")
    p.add_argument("--no-ngram", action="store_true")
    p.add_argument("--documents", default=None,
                   help="comma-separated held-out document names (default: all six), e.g. hamlet_gut,argparse.py")
    p.add_argument("--draft-tokens", type=int, default=7,
                   help="sharpdraft side: draft tokens verified per round (7 = the whole DFlash block, as vLLM's k)")
    p.add_argument("--thread-pool", choices=THREAD_POOLS, default=os.environ.get(THREAD_POOL_ENV, "shared"),
                   help="sharpdraft side's ONNX Runtime pool (runtime/ort_threads.py); vLLM runs in its own process")
    a = p.parse_args()
    from export.vllm_export import run as export_vllm
    from runtime.models.target import resolve_target

    contexts = [int(c) for c in a.contexts.split(",")]
    families = [f for f in a.families.split(",") if f]
    keep = a.documents.split(",") if a.documents else None
    prompts = {str(c): [ids for name, ids in heldout_documents(c).items() if keep is None or name in keep]
               for c in contexts}
    a.out.mkdir(parents=True, exist_ok=True)
    target = resolve_target(None)
    runs = [{"name": "vllm target-only", "speculative_config": None}]
    if not a.no_ngram:
        runs.append({"name": "vllm ngram", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_max": 5, "prompt_lookup_min": 3}})
    with tempfile.TemporaryDirectory() as tmp:
        for fam in families:
            for on in (True, False):
                folder = export_vllm(fam, Path(tmp) / f"{fam}-{'on' if on else 'off'}", query_scale=on)
                runs.append({"name": f"vllm {fam} scale {'on' if on else 'off'}",
                             "speculative_config": speculative_config(fam, folder)})
        for r in runs:
            r.update(prompts=prompts, max_tokens=a.new_tokens, ignore_eos=True, max_num_seqs=1)
        res = run_vllm(target, runs, a.out / "vllm", max_model_len=max(contexts) + a.new_tokens + 16)
    rows = []
    base = res["vllm target-only"]["groups"]
    for name, r in res.items():
        for c in contexts:
            g = (r.get("groups") or {}).get(str(c))
            if g is None:
                rows.append({"config": name, "context": c, "error": r.get("error")})
                continue
            rows.append({"config": name, "context": c, "mal": g["mal"], "acceptance": g["acceptance_per_pos"],
                         "tokens_per_s": g["tokens_per_s"], "decode_tokens_per_s": g.get("decode_tokens_per_s"),
                         "lossless": g["outputs"] == base[str(c)]["outputs"]})
    if a.engine:
        apply_thread_pool(a.thread_pool)
    for spec in a.engine:
        name, _, rest = spec.partition("=")
        folder, _, backend = rest.partition(":")
        for c in contexts:
            tgt = run_sharpdraft(Path(folder), prompts[str(c)], a.new_tokens, backend=backend or "onnxruntime",
                                 target_only=True, ignore_eos=True)
            rows.append({"config": f"sharpdraft {name} target-only", "context": c, "tokens_per_s": tgt["tokens_per_s"],
                         "decode_tokens_per_s": tgt["decode_tokens_per_s"]})
            for on in (True, False):
                r = run_sharpdraft(Path(folder), prompts[str(c)], a.new_tokens, backend=backend or "onnxruntime",
                                   query_scale=on, draft_tokens=a.draft_tokens, ignore_eos=True)
                rows.append({"config": f"sharpdraft {name} scale {'on' if on else 'off'}", "context": c,
                             "mal": r["mal"], "acceptance": r["acceptance_per_pos"],
                             "tokens_per_s": r["tokens_per_s"], "decode_tokens_per_s": r["decode_tokens_per_s"],
                             "lossless": r["outputs"] == tgt["outputs"]})
    (a.out / "bench_vllm.json").write_text(json.dumps({"contexts": contexts, "new_tokens": a.new_tokens,
                                                        "rows": rows}, indent=1))
    _plot(rows, a.out / "bench_vllm.png")
    for r in rows:
        mal = f"MAL {r['mal']:.3f}" if r.get("mal") else "         "
        tps = (f"{r['tokens_per_s']:6.1f} tokens/s end to end, {r['decode_tokens_per_s'] or 0:6.1f} decode"
               if r.get("tokens_per_s") else r.get("error", ""))
        print(f"{r['config']:34s} ctx {r['context']:5d}  {mal}  {tps}  "
              f"{'' if r.get('lossless', True) else 'NOT LOSSLESS'}")


# ---------------------------------------------------------------- one-off family checks (docs/vllm.md)
CHECK_NEW_TOKENS = 48



def _check_prompts() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from training.corpus import chat_prompts, heldout_prompts

    tok = AutoTokenizer.from_pretrained(resolve_default_target())
    chats = chat_prompts("heldout", tok, n=2)
    return {"chat0": chats[0], "chat1": chats[1], "hamlet@1600": heldout_prompts(tok, 1600, 0)["hamlet_gut"]}


def _check_pooled(rows: list[dict], k: int) -> dict:
    drafts = sum(r["num_drafts"] for r in rows)
    acc = [sum(r["accepted_per_pos"][j] for r in rows if j < len(r["accepted_per_pos"])) for j in range(k)]
    return {"mal": round(1 + sum(acc) / drafts, 4), "acceptance": [round(a / drafts, 4) for a in acc],
            "drafts": drafts}


def check_families(argv: list[str]) -> None:
    """``python scripts/bench_vllm.py check-families --eagle3-fp32 DIR --pard-fp32 DIR [--out DIR]``: one-off checks
    beyond tests/vllm (minutes of engine loads; docs/vllm.md records the figures): EAGLE-3 and PARD MAL in vLLM vs
    sharpdraft's loop on fp32 ONNX Runtime exports of the same drafters (``sharpdraft-export --drafter eagle3 --dtype
    fp32 --out DIR``, same for pard), the speculators-layout EAGLE-3, the all-sliding DFlash drafter, and what vLLM's
    CPU runner says to the default (mixed sliding / full) DFlash drafter and to a config without a profile."""
    from export.vllm_export import run as export_vllm
    from plugins.rule import Family
    p = argparse.ArgumentParser(prog="bench_vllm.py check-families")
    p.add_argument("--eagle3-fp32", type=Path, required=True)
    p.add_argument("--pard-fp32", type=Path, required=True)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "check_vllm")
    a = p.parse_args(argv)
    prompts = _check_prompts()
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
    runs = [{"name": "target", "speculative_config": None, "prompts": groups, "max_tokens": CHECK_NEW_TOKENS}]
    for name, folder in folders.items():
        runs.append({"name": name, "speculative_config": speculative_config(name.split("-")[0], folder),
                     "prompts": groups, "max_tokens": CHECK_NEW_TOKENS})
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
                        **({"vllm": _check_pooled(list(g.values()), 7)} if name != "target" else {})}
    for fam, folder in (("eagle3", a.eagle3_fp32), ("pard", a.pard_fp32)):
        ours = {n: run_sharpdraft(folder, [ids], CHECK_NEW_TOKENS, draft_tokens=3) for n, ids in prompts.items()}
        same = [n for n in prompts if ours[n]["outputs"] == base[n]["outputs"]]
        report[f"{fam}-on"]["same_output_prompts"] = same
        report[f"{fam}-on"]["vllm_same"] = _check_pooled([res[f"{fam}-on"]["groups"][n] for n in same], 3)
        report[f"{fam}-on"]["sharpdraft_fp32_same"] = _check_pooled([ours[n] for n in same], 3)
    (a.out / "check_vllm.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["check-families"]:
        check_families(sys.argv[2:])
    else:
        sys.exit(main())
