"""``sharpdraft-export-vllm``: write a shipped (or own) drafter as a checkpoint vLLM 0.32 loads unchanged, with the
query-scale profile in its ``config.json`` (``sharpdraft_query_scale``, the schema of drafters/*/config.json).

What changes against the sharpdraft checkpoint (docs/vllm.md has the measurements):

- DFlash: vLLM embeds block slots with the target's table, so our mask id 49152 (one past SmolLM2's 49,152 rows)
  is out of range there. ``--mask extra-row`` (default) gives the drafter its own 49,153-row ``embed_tokens``
  (the target's rows + our ``mask_embedding``, ``vocab_size`` 49153), so no real token can ever be confused with
  the mask; ``--mask in-vocab`` uses a special id the tokenizer never emits for text (``--mask-id``, default 16,
  ``<empty_output>``) and ships ``mask_embedding.pt``, the file vLLM swaps in for that id. The draft vocabulary
  (``draft_vocab.json``) becomes the drafter's own LM head (the target's rows at those ids) plus ``d2t``, so vLLM
  scores exactly the tokens sharpdraft's runtime scores. ``rope_theta`` is written out (vLLM assumes 1e6 when it
  is absent); sliding-window layers keep ``layer_types`` / ``sliding_window``, with ``dflash_config.causal: false``
  (vLLM would otherwise run them causally; sharpdraft's DFlash layers see the whole block).
- EAGLE-3: the EAGLE-repo layout as shipped (``d2t`` / ``t2d`` already inside), architecture renamed; or, with
  ``--layout speculators``, the speculators layout written by the ``speculators`` library (vLLM's stock class).
- PARD: a plain Llama checkpoint with its own embedding (the target's table with our mask row written at
  ``--mask-id``, ``pard_token``) and an untied LM head (the target's 49,152 rows): vLLM's draft_model runner
  embeds with the drafter's own table and has no separate mask embedding.

``--architecture stock`` keeps vLLM's own class names (no plugin needed); ``sharpdraft`` (default) names the
query-scaled classes the plugin registers (plugins/vllm). The output folder is written atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plugins.rule import Family, QueryScaleProfile
from plugins.vllm import ARCHITECTURES as PLUGIN_ARCHITECTURES

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINTS = {Family.DFLASH: REPO_ROOT / "drafters" / "dflash-smollm2-135m",
                       Family.EAGLE3: REPO_ROOT / "drafters" / "eagle3-smollm2-135m",
                       Family.PARD: REPO_ROOT / "drafters" / "pard-smollm2-135m"}
# architecture names: vLLM's stock class, and the query-scaled subclass plugins/vllm registers (the prefixes are
# what vLLM's EAGLEConfig keeps as they are: "DFlash..." / "...Eagle3")
_PLUGIN = {Family.DFLASH: "DFlashSharpDraftModel", Family.EAGLE3: "SharpDraftLlamaForCausalLMEagle3",
           Family.PARD: "SharpDraftPardLlamaForCausalLM"}
assert set(_PLUGIN.values()) == set(PLUGIN_ARCHITECTURES), "plugins/vllm registers other names"
ARCHITECTURES = {Family.DFLASH: ("DFlashDraftModel", _PLUGIN[Family.DFLASH]),
                 Family.EAGLE3: ("LlamaForCausalLMEagle3", _PLUGIN[Family.EAGLE3]),
                 Family.PARD: ("LlamaForCausalLM", _PLUGIN[Family.PARD])}
PROFILE_KEY = "sharpdraft_query_scale"
MASK_MODES = ("extra-row", "in-vocab")


class VllmExportError(ValueError):
    """The drafter or target cannot be written for vLLM; the message says what to do."""


def _target_tables(target: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(config, embed_tokens [vocab, hidden], lm_head [vocab, hidden]) of an HF Llama-style target folder."""
    cfg = json.loads((target / "config.json").read_text())
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise VllmExportError(f"--target {target}: no *.safetensors weights")
    weights = {}
    for f in files:
        weights.update(load_file(f))
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise VllmExportError(f"--target {target}: no model.embed_tokens.weight")
    head = embed if cfg.get("tie_word_embeddings", True) else weights["lm_head.weight"]
    return cfg, embed, weights.get("lm_head.weight", head)


def _profile(config: dict, ckpt: Path, overrides: dict) -> dict:
    """The drafter's profile (checkpoint's ``sharpdraft_query_scale`` with overrides), validated by plugins/rule.py."""
    base = config.get(PROFILE_KEY)
    if base is None:
        raise VllmExportError(f"{ckpt}/config.json has no {PROFILE_KEY}; pass --ref-keys (and --slope / --cap) to "
                              "give the drafter a profile")
    try:
        return QueryScaleProfile.from_dict(base).replace(**overrides).to_dict()
    except ValueError as e:
        raise VllmExportError(f"query-scale profile: {e}") from None


def _draft_vocab_head(ckpt: Path, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(own LM head [V, hidden], d2t [V]) from ``draft_vocab.json`` (ids sorted ascending), or None."""
    path = ckpt / "draft_vocab.json"
    if not path.is_file():
        return None
    ids = torch.tensor(sorted(json.loads(path.read_text())["draft_ids"]), dtype=torch.long)
    if ids.numel() == 0 or int(ids.max()) >= lm_head.shape[0] or ids.unique().numel() != ids.numel():
        raise VllmExportError(f"{path}: draft ids must be unique and inside the target vocabulary")
    return lm_head[ids].contiguous(), ids - torch.arange(ids.numel())


def export_dflash(ckpt: Path, target: Path, out: Path, *, mask: str, mask_id: int, full_vocab: bool,
                  arch: str, profile: dict) -> None:
    d = json.loads((ckpt / "config.json").read_text())
    w = load_file(ckpt / "model.safetensors")
    tcfg, embed, lm_head = _target_tables(target)
    vocab = int(tcfg["vocab_size"])
    mask_row = w.pop("mask_embedding", None)
    dcfg = dict(d.get("dflash_config") or {})
    if mask_row is None and int(dcfg["mask_token_id"]) >= vocab:
        raise VllmExportError(f"{ckpt}: mask_token_id {dcfg['mask_token_id']} is outside the target vocabulary "
                              "and the checkpoint has no mask_embedding")
    cfg = {k: v for k, v in d.items() if k not in ("sharpdraft_verify_draft_tokens", PROFILE_KEY)}
    theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        raise VllmExportError(f"{ckpt}/config.json has no rope_theta (vLLM would assume 1e6); set it")
    cfg.update(architectures=[arch], rope_theta=float(theta),
               rope_parameters={"rope_theta": float(theta), "rope_type": "default"})
    extra = {}
    if mask_row is not None and mask == "extra-row":
        w["embed_tokens.weight"] = torch.cat([embed, mask_row.to(embed.dtype)[None]]).contiguous()
        cfg["vocab_size"] = vocab + 1
        dcfg["mask_token_id"] = vocab
    elif mask_row is not None:
        if not 0 <= mask_id < vocab:
            raise VllmExportError(f"--mask-id {mask_id} must be inside the target vocabulary [0, {vocab})")
        dcfg["mask_token_id"] = mask_id
        extra["mask_embedding.pt"] = {"mask_token_id": mask_id, "embedding": mask_row.float().clone()}
        cfg["vocab_size"] = vocab
    head = None if full_vocab else _draft_vocab_head(ckpt, lm_head)
    if head is not None:
        w["lm_head.weight"], w["d2t"] = head
        cfg["draft_vocab_size"] = int(head[0].shape[0])
    elif cfg["vocab_size"] != vocab:  # 49,153 embedding rows, the target's 49,152-row LM head (no d2t)
        cfg["draft_vocab_size"] = vocab
    if "sliding_attention" in (d.get("layer_types") or []):
        dcfg["causal"] = False  # vLLM makes sliding layers causal by default; sharpdraft's DFlash layers never are
    cfg["dflash_config"] = dcfg
    cfg[PROFILE_KEY] = profile
    _write(out, cfg, w, extra, ckpt)


def export_eagle3(ckpt: Path, target: Path, out: Path, *, arch: str, profile: dict) -> None:
    d = json.loads((ckpt / "config.json").read_text())
    cfg = {k: v for k, v in d.items() if k != PROFILE_KEY}
    cfg.update(architectures=[arch])
    cfg[PROFILE_KEY] = profile
    _write(out, cfg, load_file(ckpt / "model.safetensors"), {}, ckpt)


def export_eagle3_speculators(ckpt: Path, target: Path, out: Path, *, profile: dict) -> None:
    """The speculators layout (``speculators_model_type: eagle3``), converted by the ``speculators`` library itself
    (0.9.0, installed in .venv-vllm) with our aux layers and norm placement passed on (its converter would drop the
    aux ids, and vLLM's default for SmolLM2 is (2, 15, 27), not our (2, 15, 28)). vLLM forces this layout's
    architecture to its stock ``Eagle3LlamaForCausalLM``: the profile is carried, the plugin cannot apply it."""
    try:
        from speculators.convert.entrypoints import convert_model
    except ImportError:
        raise VllmExportError("--layout speculators needs the `speculators` package (it is in .venv-vllm: run "
                              "`.venv-vllm/bin/python -m export.vllm_export ...`)") from None
    eagle = json.loads((ckpt / "config.json").read_text()).get("eagle_config") or {}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        convert_model(model=str(ckpt), verifier=str(target), algorithm="eagle3", output_path=f"{tmp}/conv",
                      eagle_aux_hidden_state_layer_ids=eagle.get("eagle_aux_hidden_state_layer_ids"),
                      norm_before_residual=bool(eagle.get("norm_before_residual", False)))
        cfg = json.loads(Path(f"{tmp}/conv/config.json").read_text())
        cfg[PROFILE_KEY] = profile
        _write(out, cfg, load_file(f"{tmp}/conv/model.safetensors"), {}, ckpt)


def export_pard(ckpt: Path, target: Path, out: Path, *, mask_id: int, arch: str, profile: dict) -> None:
    d = json.loads((ckpt / "config.json").read_text())
    w = load_file(ckpt / "model.safetensors")
    tcfg, embed, lm_head = _target_tables(target)
    vocab = int(tcfg["vocab_size"])
    mask_row = w.pop("mask_embedding", None)
    cfg = {k: v for k, v in d.items() if k not in ("sharpdraft_embeddings", PROFILE_KEY)}
    if d.get("sharpdraft_embeddings") == "target":
        w["model.embed_tokens.weight"] = embed
        w["lm_head.weight"] = lm_head
    pard_token = int(d["pard_token"])
    if mask_row is not None:
        if not 0 <= mask_id < vocab:
            raise VllmExportError(f"--mask-id {mask_id} must be inside the target vocabulary [0, {vocab})")
        table = w["model.embed_tokens.weight"].clone()
        table[mask_id] = mask_row.to(table.dtype)
        w["model.embed_tokens.weight"], pard_token = table, mask_id
    cfg.update(architectures=[arch], tie_word_embeddings=False, pard_token=pard_token)
    cfg[PROFILE_KEY] = profile
    _write(out, cfg, w, {}, ckpt)


def _write(out: Path, cfg: dict, weights: dict, extra: dict, ckpt: Path) -> None:
    """config.json + model.safetensors (+ extra torch files) into ``out`` via a temporary sibling folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt", "source": f"sharpdraft-export-vllm from {ckpt.name}"})
        for name, obj in extra.items():
            torch.save(obj, tmp / name)
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(family: Family, out: Path, checkpoint: Path | None = None, target: Path | None = None, *,
        architecture: str = "sharpdraft", layout: str = "eagle", mask: str = "extra-row", mask_id: int = 16, full_vocab: bool = False,
        query_scale: bool = True, ref_keys: int | None = None, slope: float | None = None,
        cap: float | None = None) -> Path:
    """Write ``out``; returns it. Raises VllmExportError with the one line to show."""
    family = Family.parse(family)
    if family not in ARCHITECTURES:  # a family sharpdraft knows but has no vLLM class for (module docstring)
        raise VllmExportError(f"{family.value} drafters have no vLLM export: vLLM 0.32 runs "
                              f"{', '.join(f.value for f in ARCHITECTURES)}")
    ckpt = Path(checkpoint) if checkpoint else DEFAULT_CHECKPOINTS[family]
    if not (ckpt / "config.json").is_file():
        raise VllmExportError(f"--checkpoint {ckpt}: no config.json")
    if target is None:
        from runtime.models.target import resolve_target

        target = resolve_target(None)
    target = Path(target)
    if layout == "speculators" and family is not Family.EAGLE3:
        raise VllmExportError("--layout speculators is for EAGLE-3 only (speculators' DFlash converter refuses our "
                              "mask_embedding and has no draft vocabulary; PARD has no speculators format)")
    if mask not in MASK_MODES:
        raise VllmExportError(f"--mask must be one of {', '.join(MASK_MODES)}, got {mask!r}")
    cfg = json.loads((ckpt / "config.json").read_text())
    overrides = {"ref_keys": ref_keys, "slope": slope, "cap": cap}
    if cfg.get(PROFILE_KEY) is None and ref_keys is not None:
        cfg[PROFILE_KEY] = QueryScaleProfile.for_family(family).to_dict()
    profile = _profile(cfg, ckpt, overrides)
    profile["enabled"] = bool(query_scale)
    arch = ARCHITECTURES[family][architecture == "sharpdraft"]
    if family is Family.DFLASH:
        export_dflash(ckpt, target, out, mask=mask, mask_id=mask_id, full_vocab=full_vocab, arch=arch,
                      profile=profile)
    elif family is Family.EAGLE3 and layout == "speculators":
        export_eagle3_speculators(ckpt, target, out, profile=profile)
    elif family is Family.EAGLE3:
        export_eagle3(ckpt, target, out, arch=arch, profile=profile)
    elif family is Family.PARD:
        export_pard(ckpt, target, out, mask_id=mask_id, arch=arch, profile=profile)
    else:  # ARCHITECTURES names a family this dispatch does not: a new family's writer is missing here
        raise VllmExportError(f"{family.value}: no vLLM checkpoint writer in export/vllm_export.py")
    tok = target / "tokenizer.json"
    if tok.is_file():  # vLLM reads a tokenizer from the draft folder for some checks; keep the target's beside it
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (target / f).is_file():
                shutil.copy2(target / f, out / f)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="sharpdraft-export-vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, choices=[f.value for f in Family], help="drafter family")
    p.add_argument("--out", required=True, type=Path, help="folder to write (vLLM's speculative_config model)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="drafter checkpoint (default: the shipped one; DFlash: drafters/dflash-smollm2-135m, the "
                        "full-attention drafter vLLM's CPU runner takes)")
    p.add_argument("--target", type=Path, default=None,
                   help="HF target folder (default: the SmolLM2-135M-Instruct folder sharpdraft caches)")
    p.add_argument("--architecture", choices=("sharpdraft", "stock"), default="sharpdraft",
                   help="sharpdraft: the plugin's query-scaled class (default); stock: vLLM's own class")
    p.add_argument("--layout", choices=("eagle", "speculators"), default="eagle",
                   help="EAGLE-3: the EAGLE-repo layout (default; the plugin's class) or the speculators layout "
                        "(converted by the speculators library; vLLM's stock class, no query scale)")
    p.add_argument("--mask", choices=MASK_MODES, default="extra-row", help="DFlash mask token scheme")
    p.add_argument("--mask-id", type=int, default=16, help="--mask in-vocab: the id (default 16, <empty_output>)")
    p.add_argument("--full-vocab", action="store_true", help="DFlash: no draft-vocabulary LM head")
    p.add_argument("--no-query-scale", action="store_true", help="write the profile with enabled false")
    p.add_argument("--ref-keys", type=int, default=None)
    p.add_argument("--slope", type=float, default=None)
    p.add_argument("--cap", type=float, default=None)
    a = p.parse_args(argv)
    try:
        out = run(Family.parse(a.drafter), a.out, a.checkpoint, a.target, architecture=a.architecture,
                  layout=a.layout, mask=a.mask, mask_id=a.mask_id, full_vocab=a.full_vocab, query_scale=not a.no_query_scale,
                  ref_keys=a.ref_keys, slope=a.slope, cap=a.cap)
    except (VllmExportError, ValueError, OSError) as e:
        print(f"sharpdraft-export-vllm: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out} (vLLM {a.drafter} drafter, architecture {json.loads((out / 'config.json').read_text())['architectures'][0]})")


if __name__ == "__main__":
    main()
