"""Export at real scale: wall time and peak memory of every export phase, validation errors, a lossless loop.

Three cases, each in its own process (so one case's memory never inflates the next one's peak):

* ``pair``: a Qwen3 target with the real Qwen3-0.6B shape (28 layers, hidden 1024, 16 / 8 heads of 128, vocab
  151,936, tied table; 0.6 B parameters, 2.4 GB in fp32: past the 2 GB protobuf limit, so external data) and a
  DFlash drafter of its width in the Qwen3-8B-DFlash-b16 layout (5 layers, block 16, five taps), random weights,
  through the whole ``sharpdraft-export`` (``run_export``) at each ``--precisions`` entry, then the speculative
  loop on random prompts, asserted equal to target-only greedy decoding of the same graph (not for bf16, which
  the runtime refuses: export/bf16.py validates it by an fp32 emulation).
* ``pair8b``: the 1 B drafter below in the loop, with a target of Qwen3-8B's layer shape (hidden 4,096, 32 / 8
  heads, intermediate 12,288, untied 151,936-row tables) cut to 8 of its 36 layers (2.8 B parameters, 5.6 GB in
  half precision; all 36 would be 16 GB, which this 24 GB machine cannot export beside the drafter). The drafter's
  taps become layers 1-5 of 8 (``build_target_layer_ids``); its weights and shapes are the true ones.
* ``drafter``: the DFlash drafter with the true Qwen3-8B-DFlash-b16 shape (SpecForge's Qwen3-8B DFlash config,
  ``tests/fixtures/configs/specforge-qwen3-8b-dflash.json``: hidden 4096, 5 layers, intermediate 12,288; 1.05 B
  parameters, 4.2 GB in fp32), exported, query-scale rewritten and validated against torch with the family's
  own steps, then converted to fp16 / bf16 and compared with the fp32 graph. Here the drafter reads random shared
  tables of its target's shape (embedding 151,936 x 4,096) and a 32k-row LM head (a draft vocabulary of the
  EAGLE-3 / speculators size); ``pair8b`` runs it in the loop.

Weights are random (no hub access): the figures are about size, not acceptance. The tokenizer is SmolLM2's (the
target's vocabulary rows past it are padding, which the export accepts). Phases are delimited by the export's own
progress lines; peak RSS is sampled every 50 ms. JSON out, and a table on stdout::

    python scripts/bench_scale.py --work runs/scale --json-out docs/performance/bench_scale-DATE.json
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]

# Qwen/Qwen3-0.6B config.json (the published values that set the shape; random weights here)
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "rope_theta": 1000000, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960,
              "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28,
              "torch_dtype": "bfloat16", "initializer_range": 0.02}
# Qwen/Qwen3-8B config.json's layer shape, 8 of its 36 layers (the ``pair8b`` case)
QWEN3_8B_CUT = {**QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 8,
                "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                "max_window_layers": 36}
DFLASH_8B = ROOT / "tests" / "fixtures" / "configs" / "specforge-qwen3-8b-dflash.json"
HEAD_ROWS = 32000


class PeakRss:
    """Samples this process's resident set (``VmRSS``) every ``period`` seconds; :meth:`phase` closes a phase."""

    def __init__(self, period: float = 0.05):
        self.period, self.peak, self.phases = period, 0, []
        self.name, self.t0 = "start", time.perf_counter()
        self._stop, self._lock = threading.Event(), threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # a sample taken before phase() must not leak into the next phase
                self.peak = max(self.peak, self.rss())
            time.sleep(self.period)

    def phase(self, next_name: str) -> None:
        with self._lock:
            self.peak = max(self.peak, self.rss())
            now = time.perf_counter()
            self.phases.append({"phase": self.name, "seconds": round(now - self.t0, 1),
                                "peak_rss_gb": round(self.peak / 2 ** 30, 2)})
            self.name, self.t0, self.peak = next_name, now, self.rss()

    def close(self) -> list[dict]:
        self.phase("")
        self._stop.set()
        return self.phases


class _PhaseLog(logging.Handler):
    """Each progress line of ``sharpdraft.export`` starts a phase of :class:`PeakRss`."""

    def __init__(self, meter: PeakRss):
        super().__init__(logging.INFO)
        self.meter = meter

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.endswith("..."):
            self.meter.phase(msg.rstrip(". "))


def _gb(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2 ** 30, 2)


def make_target(work: Path, shape: dict = QWEN3_0_6B, name: str = "qwen3-0.6b-random",
                dtype: str = "float32") -> Path:
    """A random Qwen3 target folder of ``shape`` (safetensors + SmolLM2's tokenizer), written once.

    ``dtype``: the torch dtype the weights are built and stored in (``bfloat16``, as Qwen3 checkpoints are, keeps
    a 2.8 B model from ever holding an fp32 copy).
    """
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from runtime.models.target import resolve_target

    out = work / name
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    cfg = Qwen3Config(**{k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype")})
    cfg.architectures = shape["architectures"]
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(resolve_target(None)).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def dflash_config(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, target_layers: int) -> dict:
    """The Qwen3-8B-DFlash-b16 layout (SpecForge's config) at another width."""
    from runtime.models.dflash import build_target_layer_ids

    d = json.loads(DFLASH_8B.read_text())
    d.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
             intermediate_size=inter, num_target_layers=target_layers)
    d["dflash_config"] = {**d["dflash_config"], "target_layer_ids": build_target_layer_ids(target_layers, 5)}
    return d


def make_drafter(path: Path, cfg: dict) -> Path:
    """Random DFlash weights (normal, std 0.02, norms 1) of ``cfg`` in the public layout, written once."""
    import torch

    from runtime.models.dflash import DFlashConfig, DFlashDrafter, save_dflash

    if (path / "model.safetensors").is_file():
        return path
    torch.manual_seed(1)
    model = DFlashDrafter(DFlashConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    tmp = path.with_name(path.name + ".tmp")
    save_dflash(model, tmp)
    os.replace(tmp, path)
    return path


def cut_drafter(work: Path) -> Path:
    """The 1 B drafter's weights with its taps moved into the 8-layer target (``pair8b``): a config and a link."""
    src = make_drafter(work / "dflash-qwen3-8b-b16-random", json.loads(DFLASH_8B.read_text()))
    out = work / "dflash-qwen3-8b-b16-random-taps8"
    if not (out / "model.safetensors").exists():
        out.mkdir(parents=True, exist_ok=True)
        cfg = json.loads((src / "config.json").read_text())
        cfg["num_target_layers"] = QWEN3_8B_CUT["num_hidden_layers"]
        cfg["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": dflash_config(
            4096, 32, 8, 128, 12288, QWEN3_8B_CUT["num_hidden_layers"])["dflash_config"]["target_layer_ids"]}
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
        (out / "model.safetensors").symlink_to((src / "model.safetensors").resolve())
    return out


def run_pair(work: Path, precision: str, prompts: int, new_tokens: int, case: str = "pair") -> dict:
    """``run_export`` of the pair of ``case`` at ``precision`` (both graphs), then the loop; in this process.

    ``pair``: the 0.6 B target and a drafter of its width; ``pair8b``: the 8-layer Qwen3-8B-shape target and the
    1 B drafter (:func:`cut_drafter`).
    """
    import torch

    from export.pipeline import ExportConfig, run_export
    from runtime.engine import SpecEngine

    if case == "pair8b":
        target = make_target(work, QWEN3_8B_CUT, "qwen3-8b-8layers-random", "bfloat16")
        drafter = cut_drafter(work)
    else:
        target = make_target(work)
        drafter = make_drafter(work / "dflash-qwen3-0.6b-random", dflash_config(1024, 16, 8, 128, 3072, 28))
    out = work / (f"engines-{precision}" if case == "pair" else f"engines-{case}-{precision}")
    meter = PeakRss()
    handler = _PhaseLog(meter)
    log = logging.getLogger("sharpdraft.export")
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    meter.phase("loading the pair")
    args = {"dtype": precision} if precision in ("fp32", "fp16") else {"target_precision": precision}
    t0 = time.perf_counter()
    manifest = run_export(ExportConfig(family="dflash", out=out, checkpoint=drafter, target=str(target), **args))
    export_s = time.perf_counter() - t0
    lossless, mal = [], []
    if precision != "bf16":  # bf16 folders are for CUDA / TensorRT: the runtime refuses them (export/bf16.py)
        meter.phase("speculative loop (lossless check)")
        engine = SpecEngine.from_dir(out, check_invariants=True)
        g = torch.Generator().manual_seed(0)
        for n in [64, 1024, 2048][:prompts]:
            ids = torch.randint(0, 49152, (n,), generator=g).tolist()
            spec = engine.generate(ids, new_tokens)
            lossless.append(spec.token_ids == engine.generate_target_only(ids, new_tokens).token_ids)
            mal.append(spec.stats.mean_accepted_length)
    phases = meter.close()
    log.removeHandler(handler)
    import resource  # the model builder runs in a child process, outside this process's RSS

    child_gb = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20, 2)
    v = manifest["validation"]
    return {"case": case, "precision": precision, "export_s": round(export_s, 1), "phases": phases,
            "peak_rss_gb": max(p["peak_rss_gb"] for p in phases), "builder_peak_rss_gb": child_gb,
            "folder_gb": {"target": _gb(out / "target"), "drafter": _gb(out / "drafter")},
            "validation": {"target": v["target"], "drafter_points": v["drafter"]["points"],
                           **{k: v[k] for k in v if k.startswith("drafter_") and k != "drafter"}},
            "lossless": lossless, "mal_random_weights": mal}


def run_drafter(work: Path, precision: str) -> dict:
    """The 1 B drafter alone: export, rewrite, validate (fp32); ``fp16`` adds the conversion and its check."""
    import shutil
    import tempfile

    import numpy as np
    import torch

    from export.bf16 import check_types, to_bf16_drafter, widen_bf16
    from export.drafter_quant import half_drafter_graph, proposal_agreement
    from export.families import get_family
    from export.rewrite import rewrite_file
    from plugins.rule import QueryScaleProfile
    from runtime.models.dflash import load_dflash

    ck = make_drafter(work / "dflash-qwen3-8b-b16-random", json.loads(DFLASH_8B.read_text()))
    meter = PeakRss()
    meter.phase("loading the drafter")
    drafter = load_dflash(ck)
    cfg = drafter.config
    fam = get_family("dflash")
    profile = QueryScaleProfile.for_family("dflash")
    out = work / f"drafter-8b-{precision}"
    shutil.rmtree(out, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=work))
    try:
        meter.phase("exporting the drafter graph (torch.onnx)")
        io, _ = fam.export_graphs(drafter, cfg.block_size - 1, scratch / "frozen.onnx", out, "static")
        meter.phase("query-scale rewrite")
        counts = rewrite_file(scratch / "frozen.onnx", out / "fp32" / "model.onnx", profile,
                              row_switch_input="query_scale_enabled", **fam.rewrite_options(drafter))
        io["inputs"] = [*io["inputs"], "query_scale_enabled"]
        for f in scratch.glob("frozen.onnx*"):  # 4 GB that the rest does not read
            f.unlink()
        meter.phase("shared tables (random, the target's shape)")
        g = torch.Generator().manual_seed(0)
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
        head = torch.randn(HEAD_ROWS, cfg.hidden_size, generator=g) * 0.02
        meter.phase("validating against torch")
        check = fam.validate(drafter, cfg.block_size - 1, out / "fp32" / "model.onnx", io, profile, embed, head, None)
        result = {"case": "drafter", "precision": precision, "parameters_b": round(
            sum(p.numel() for p in drafter.parameters()) / 1e9, 3), "rewrite": counts,
            "validation_points": check["points"], "fp32_graph_gb": _gb(out / "fp32")}
        if precision in ("fp16", "bf16"):
            meter.phase(f"converting to {precision}")
            half_drafter_graph(out / "fp32" / "model.onnx", out / "fp16" / "model.onnx")
            checked = out / "fp16" / "model.onnx"
            if precision == "bf16":  # export/bf16.py: retyped from fp16, weights from fp32, checked by emulation
                to_bf16_drafter(checked, out / "fp32" / "model.onnx", out / "bf16" / "model.onnx")
                shutil.rmtree(out / "fp16")
                check_types(out / "bf16" / "model.onnx")
                checked = scratch / "bf16-emulation" / "model.onnx"
                widen_bf16(out / "bf16" / "model.onnx", checked)
            meter.phase(f"{precision} vs fp32 graph")
            rng = np.random.default_rng(0)
            rows, ctx, past = 4, 64, 2048
            feed = {"input_ids": np.full((rows, cfg.block_size), cfg.mask_token_id, np.int64),
                    "target_hidden": rng.standard_normal((rows, ctx, 5 * cfg.hidden_size)).astype(np.float32),
                    "position_ids": np.tile(np.arange(past, past + ctx + cfg.block_size), (rows, 1)),
                    "attention_mask": np.ones((rows, past + ctx + cfg.block_size), np.int64),
                    "embed_weight": embed.numpy(), "lm_head_weight": head.numpy(),
                    "draft_slots": np.arange(1, cfg.block_size, dtype=np.int64),
                    "query_scale_enabled": np.ones(rows, np.float32)}
            feed["input_ids"][:, 0] = rng.integers(0, 49152, rows)
            for i in range(cfg.num_hidden_layers):
                for kind in ("key", "value"):
                    feed[f"past_{kind}.{i}"] = rng.standard_normal(
                        (rows, cfg.num_key_value_heads, past, cfg.head_dim)).astype(np.float32)
            result[f"{precision}_vs_fp32"] = proposal_agreement(out / "fp32" / "model.onnx", checked, feed)
            result[f"{precision}_graph_gb"] = _gb(out / precision)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["phases"] = meter.close()
    result["peak_rss_gb"] = max(p["peak_rss_gb"] for p in result["phases"])
    return result


@click.group(invoke_without_command=True)
@click.option("--work", type=click.Path(path_type=Path), default=ROOT / "runs" / "scale", show_default=True)
@click.option("--precisions", default="fp32,fp16,bf16", show_default=True,
              help="pair case: graph precisions (int4 of random weights fails the export's top-1 agreement floor "
                   "with fp32, as it should: random logits are near-ties)")
@click.option("--pair8b-precisions", default="fp16", show_default=True,
              help="pair8b case (the 1 B drafter in the loop with an 8-layer Qwen3-8B-shape target): fp16 or fp32 "
                   "(fp32 needs about 2x the memory); empty to skip")
@click.option("--drafter-precisions", default="fp16,bf16", show_default=True,
              help="1 B drafter case: fp32 (export, rewrite, validation), fp16 or bf16 (the same, then the "
                   "conversion and its check; bf16 by its fp32 emulation)")
@click.option("--prompts", type=click.IntRange(1, 3), default=2, show_default=True)
@click.option("--new-tokens", type=click.IntRange(1, 256), default=24, show_default=True)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@click.option("--reuse", is_flag=True, help="keep the results of cases already measured under --work")
@click.pass_context
def main(ctx, work, precisions, pair8b_precisions, drafter_precisions, prompts, new_tokens, json_out, reuse):
    """Run every case in its own process and print the table."""
    if ctx.invoked_subcommand is not None:
        return
    work.mkdir(parents=True, exist_ok=True)
    jobs = [("pair", p) for p in precisions.split(",") if p] + [("pair8b", p) for p in pair8b_precisions.split(",")
                                                                if p]
    jobs += [("drafter", p) for p in drafter_precisions.split(",") if p]
    results = []
    for case, precision in jobs:
        res = work / f"result-{case}-{precision}.json"
        if reuse and res.is_file():
            results.append(json.loads(res.read_text()))
            continue
        res.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "one", "--work", str(work), "--case", case, "--precision", precision,
               "--prompts", str(prompts), "--new-tokens", str(new_tokens), "--out", str(res)]
        print(f"== {case} {precision}", flush=True)
        r = subprocess.run(cmd)
        if r.returncode != 0:
            results.append({"case": case, "precision": precision, "error": f"exit {r.returncode}"})
            continue
        results.append(json.loads(res.read_text()))
        print(_row(results[-1]), flush=True)
    report = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "results": results}
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(_row(r) for r in results))


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:8s} {r['precision']:5s} failed ({r['error']})"
    phases = ", ".join(f"{p['phase']} {p['seconds']}s/{p['peak_rss_gb']}GB" for p in r["phases"] if p["phase"]
                       not in ("start", ""))
    loop = f"lossless {all(r['lossless'])}" if r.get("lossless") else "no loop (bf16: runtime refuses)"
    extra = (f"{loop}, folder {r['folder_gb']}" if r["case"].startswith("pair")
             else f"{r['parameters_b']} B params, fp32 graph {r['fp32_graph_gb']} GB")
    return f"{r['case']:8s} {r['precision']:5s} peak {r['peak_rss_gb']} GB; {extra}; {phases}"


@main.command()
@click.option("--work", type=click.Path(path_type=Path), required=True)
@click.option("--case", type=click.Choice(["pair", "pair8b", "drafter"]), required=True)
@click.option("--precision", required=True)
@click.option("--prompts", type=int, default=2)
@click.option("--new-tokens", type=int, default=24)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def one(work, case, precision, prompts, new_tokens, out):
    """One case in this process (used by the main command)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    result = (run_drafter(work, precision) if case == "drafter"
              else run_pair(work, precision, prompts, new_tokens, case))
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
