"""The engines/ folder contract between export and runtime (docs/design.md §3).

Layout::

    engines/
      manifest.json          schema_version, drafter family + config, query-scale profile, target facts,
                             tokenizer, per-graph file/sha256/io names, shared weights, export validation
      target/model.onnx(.data)
      drafter/model.onnx(.data)
      tokenizer/             the target's tokenizer (tokenizer.json, tokenizer_config.json, chat template)

The drafter graph reads the target's embedding / LM head as graph inputs (``shared_weights``) instead of storing a
second copy: the runtime memory-maps them out of the target's external-data file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from plugins.rule import Family, QueryScaleProfile
from runtime.modes import KvIo

SCHEMA_VERSION = 2  # 2: typed sections (this module), drafter.family / graph kv_io / target.precision required
MANIFEST = "manifest.json"
TARGET_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")  # bf16: export only (export/bf16.py)


class EngineDirError(RuntimeError):
    """An engines/ folder is missing, incomplete, tampered with or from another schema; says what to do."""


class _Fields:
    """Reads one manifest section with errors that name the field (``drafter.config: expected an object``)."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected an object, got {type(d).__name__}")
        self.d, self.where, self.used = d, where, set()

    def get(self, name: str, kinds: type | tuple[type, ...], required: bool = True, default: Any = None):
        self.used.add(name)
        if name not in self.d or self.d[name] is None:
            if required:
                raise ValueError(f"{self.where}.{name} is missing")
            return default
        v = self.d[name]
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
            raise ValueError(f"{self.where}.{name}: expected {' or '.join(k.__name__ for k in kinds)}, got {v!r}")
        return v

    def ints(self, name: str) -> list[int]:
        v = self.get(name, list)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise ValueError(f"{self.where}.{name}: expected a list of integers, got {v!r}")
        return v

    def strs(self, name: str) -> list[str]:
        v = self.get(name, list)
        if any(not isinstance(x, str) for x in v):
            raise ValueError(f"{self.where}.{name}: expected a list of strings, got {v!r}")
        return v

    def rest(self) -> dict[str, Any]:
        return {k: v for k, v in self.d.items() if k not in self.used}

    def no_rest(self) -> None:
        if self.rest():
            raise ValueError(f"{self.where}: unknown field(s) {sorted(self.rest())} (written by a newer sharpdraft?)")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class GraphEntry:
    """One ONNX graph of the folder: its file, io names, sha256 of every file it owns, and how it takes its KV
    cache (:class:`runtime.modes.KvIo`; None for graphs without a cache interface of ours, e.g. EAGLE-3's fc)."""

    file: str
    inputs: list[str]
    outputs: list[str]
    sha256: dict[str, str]
    kv_io: KvIo | None = None
    precision: str | None = None  # builder graphs: "int4" / "int8"
    taps_output: str | None = None  # builder graphs: the output holding the tapped hidden states
    min_q_len: int | None = None  # builder graphs whose 1-token step rounds differently (docs/quantized-target.md)
    builder: dict[str, Any] | None = None  # builder graphs: package, block size, accuracy level, options
    quantization: dict[str, Any] | None = None  # int8 drafter graphs: export/drafter_quant.py's record
    fused_op: str | None = None  # drafter_fused: the custom op's name
    fused_attentions: int | None = None
    fused_windows: list[int] | None = None  # drafter_fused: each fused node's sliding window (0 = full attention)
    note: str | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "GraphEntry":
        f = _Fields(d, where)
        kv = f.get("kv_io", str, required=False)
        entry = cls(file=f.get("file", str), inputs=f.strs("inputs"), outputs=f.strs("outputs"),
                    sha256=f.get("sha256", dict), kv_io=None if kv is None else KvIo.parse(kv),
                    precision=f.get("precision", str, False), taps_output=f.get("taps_output", str, False),
                    min_q_len=f.get("min_q_len", int, False), builder=f.get("builder", dict, False),
                    quantization=f.get("quantization", dict, False),
                    fused_op=f.get("fused_op", str, False), fused_attentions=f.get("fused_attentions", int, False),
                    fused_windows=f.ints("fused_windows") if "fused_windows" in d else None,
                    note=f.get("note", str, False))
        f.no_rest()
        if entry.file not in entry.sha256:
            raise ValueError(f"{where}.sha256 does not cover its own file {entry.file}")
        return entry

    def to_dict(self) -> dict[str, Any]:
        d = _drop_none(dataclasses.asdict(self))
        if self.kv_io is not None:
            d["kv_io"] = self.kv_io.value
        return d


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """The drafter: family, where it came from, its config, draft lengths, and the family's own facts
    (``details``: DFlash block_size / target_layer_ids / mask_token_id, PARD pard_token, EAGLE-3 aux_layer_ids ...;
    written by export/families/)."""

    family: Family
    checkpoint: str
    num_draft_tokens: int  # drafted per round (K)
    verify_draft_tokens: int  # verified per round by default (<= K)
    config: dict[str, Any]
    num_keys: str  # how N is counted for this family, in words
    draft_vocab: dict[str, Any] | None = None  # {"file", "size"}: reduced LM head (runtime/draft_vocab.py)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any, where: str = "drafter") -> "DrafterEntry":
        f = _Fields(d, where)
        try:
            family = Family.parse(f.get("family", str))
        except ValueError as e:
            raise ValueError(f"{where}.family: {e}") from None
        entry = cls(family=family, checkpoint=f.get("checkpoint", str),
                    num_draft_tokens=f.get("num_draft_tokens", int),
                    verify_draft_tokens=f.get("verify_draft_tokens", int), config=f.get("config", dict),
                    num_keys=f.get("num_keys", str), draft_vocab=f.get("draft_vocab", dict, False), details=f.rest())
        if not 1 <= entry.verify_draft_tokens <= entry.num_draft_tokens:
            raise ValueError(f"{where}.verify_draft_tokens {entry.verify_draft_tokens} is outside 1.."
                             f"{entry.num_draft_tokens}")
        return entry

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "details"}
        d["family"] = self.family.value
        return _drop_none({**d, **self.details})


@dataclasses.dataclass(frozen=True)
class TargetEntry:
    """The target: its source (the default name or a local folder), the shapes the runtime sizes caches by, and
    its graph's precision."""

    source: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    precision: str

    @classmethod
    def from_dict(cls, d: Any, where: str = "target") -> "TargetEntry":
        f = _Fields(d, where)
        entry = cls(source=f.get("source", str), architecture=f.get("architecture", str),
                    **{n: f.get(n, int) for n in ("num_layers", "hidden_size", "num_key_value_heads", "head_dim",
                                                  "vocab_size", "max_position_embeddings")},
                    precision=f.get("precision", str))
        f.no_rest()
        if entry.precision not in TARGET_PRECISIONS:
            raise ValueError(f"{where}.precision {entry.precision!r} is not one of {', '.join(TARGET_PRECISIONS)}")
        return entry

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TokenizerEntry:
    dir: str
    eos_token_ids: list[int]
    vocab_size: int

    @classmethod
    def from_dict(cls, d: Any, where: str = "tokenizer") -> "TokenizerEntry":
        f = _Fields(d, where)
        entry = cls(dir=f.get("dir", str), eos_token_ids=f.ints("eos_token_ids"), vocab_size=f.get("vocab_size", int))
        f.no_rest()
        return entry

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class QueryScaleEntry:
    """The query-scale profile baked into the drafter graph, where it came from, and what the rewrite inserted."""

    profile: QueryScaleProfile
    source: str  # "family-preset", "checkpoint", "cli (over ...)"
    num_keys: str
    rewrite: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any, where: str = "query_scale") -> "QueryScaleEntry":
        f = _Fields(d, where)
        names = [fld.name for fld in dataclasses.fields(QueryScaleProfile)]
        try:
            profile = QueryScaleProfile.from_dict({n: d[n] for n in names if n in d})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        f.used.update(names)
        entry = cls(profile=profile, source=f.get("source", str), num_keys=f.get("num_keys", str),
                    rewrite=f.get("rewrite", dict, False, {}))
        f.no_rest()
        return entry

    def to_dict(self) -> dict[str, Any]:
        return {**self.profile.to_dict(), "source": self.source, "rewrite": self.rewrite, "num_keys": self.num_keys}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """``manifest.json``, typed: :meth:`from_dict` checks every section (the runtime reads nothing it did not
    check; no defaults stand in for missing fields) and :meth:`to_dict` writes it back (export/pipeline.py)."""

    schema_version: int
    created: str
    torch: str
    drafter: DrafterEntry
    query_scale: QueryScaleEntry
    target: TargetEntry
    tokenizer: TokenizerEntry
    shared_weights: dict[str, Any]
    graphs: dict[str, GraphEntry]
    validation: dict[str, Any]

    @classmethod
    def from_dict(cls, d: Any) -> "Manifest":
        """Raises ValueError naming the first field that is missing, mistyped or unknown."""
        f = _Fields(d, "manifest")
        for key in ("drafter", "target", "graphs", "tokenizer", "query_scale", "shared_weights"):
            if key not in d:
                raise ValueError(f"missing section {key!r}")
        m = cls(schema_version=f.get("schema_version", int), created=f.get("created", str),
                torch=f.get("torch", str), drafter=DrafterEntry.from_dict(f.get("drafter", dict)),
                query_scale=QueryScaleEntry.from_dict(f.get("query_scale", dict)),
                target=TargetEntry.from_dict(f.get("target", dict)),
                tokenizer=TokenizerEntry.from_dict(f.get("tokenizer", dict)),
                shared_weights=f.get("shared_weights", dict),
                graphs={name: GraphEntry.from_dict(g, f"graphs.{name}") for name, g in f.get("graphs", dict).items()},
                validation=f.get("validation", dict, False, {}))
        f.no_rest()
        return m

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "created": self.created, "torch": self.torch,
                "drafter": self.drafter.to_dict(), "query_scale": self.query_scale.to_dict(),
                "target": self.target.to_dict(), "tokenizer": self.tokenizer.to_dict(),
                "shared_weights": self.shared_weights, "graphs": {k: g.to_dict() for k, g in self.graphs.items()},
                "validation": self.validation}

    def check_graphs(self) -> None:
        """What the ONNX Runtime backend needs beyond the schema: target and drafter graphs, the target's and a
        DFlash drafter's KV interface. Raises ValueError."""
        for name in ("target", "drafter"):
            if name not in self.graphs:
                raise ValueError(f"graphs.{name} is missing")
        if self.graphs["target"].kv_io is None:
            raise ValueError("graphs.target.kv_io is missing")
        if self.drafter.family == Family.DFLASH and self.graphs["drafter"].kv_io is None:
            raise ValueError("graphs.drafter.kv_io is missing (a DFlash drafter graph has a KV interface)")


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def load_manifest(engine_dir: str | Path, verify_checksums: bool = True, require_graphs: bool = True) -> Manifest:
    """Read and check ``engine_dir/manifest.json`` against the schema (:class:`Manifest`) and its files.

    Returns the typed :class:`Manifest` (every field the schema requires is present and typed; ``.to_dict()`` gives
    the JSON form back). ``require_graphs`` False (the torch backend, which rebuilds the pair from its sources)
    skips the graph requirements and file checks.

    Raises:
        EngineDirError: folder or manifest missing, unreadable JSON, another schema version, a section or field
        missing or mistyped, a graph file missing or whose sha256 differs from the manifest. The message says to
        re-run ``sharpdraft-export``.
    """
    root = Path(engine_dir)
    redo = f"re-create it with `sharpdraft-export --drafter dflash --out {root}`"
    if not root.is_dir():
        raise EngineDirError(f"{root}: no such folder; pass the folder `sharpdraft-export --out` wrote")
    path = root / MANIFEST
    if not path.is_file():
        raise EngineDirError(f"{root}: no {MANIFEST}; not an engines folder ({redo})")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{path}: not valid JSON ({e}); {redo}") from e
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and isinstance(raw.get("drafter"), dict) and raw["drafter"].get("family") in set(Family):
        redo = redo.replace("--drafter dflash", f"--drafter {raw['drafter']['family']}")
    if version != SCHEMA_VERSION:
        raise EngineDirError(f"{path}: schema_version {version!r}, this runtime reads {SCHEMA_VERSION} (the folder "
                             f"was written by another sharpdraft version); {redo}")
    try:
        manifest = Manifest.from_dict(raw)
        if require_graphs:
            manifest.check_graphs()
    except ValueError as e:
        raise EngineDirError(f"{path}: {e}; {redo}") from None
    if require_graphs:
        for gname, graph in manifest.graphs.items():
            for rel, digest in graph.sha256.items():
                f = root / rel
                if not f.is_file():
                    raise EngineDirError(f"{root}: {rel} is missing ({gname} graph); {redo}")
                if verify_checksums and sha256_file(f) != digest:
                    raise EngineDirError(f"{root}: checksum mismatch for {rel} ({gname} graph): the file changed "
                                         f"after export; {redo}")
    tok_dir = root / manifest.tokenizer.dir
    if not (tok_dir / "tokenizer.json").is_file() and not (tok_dir / "tokenizer_config.json").is_file():
        # else transformers falls back to the hub and fails with a misleading message (or loads another tokenizer)
        raise EngineDirError(f"{root}: the tokenizer folder {manifest.tokenizer.dir}/ is missing or holds no "
                             f"tokenizer.json; {redo}")
    return manifest


def read_initializer(onnx_path: Path, name: str) -> np.ndarray:
    """Memory-map one external-data initializer of an ONNX graph without loading the rest.

    Returns a read-only ndarray with the initializer's dims and dtype (float32 / float16 / bfloat16-as-uint16
    are supported). Raises EngineDirError if the initializer is absent or not stored as external data.
    """
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    for init in model.graph.initializer:
        if init.name != name:
            continue
        info = {e.key: e.value for e in init.external_data}
        if init.data_location != onnx.TensorProto.EXTERNAL or "location" not in info:
            raise EngineDirError(f"{onnx_path}: initializer {name!r} is not stored as external data")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        offset = int(info.get("offset", 0))
        return np.memmap(onnx_path.parent / info["location"], dtype=dtype, mode="r", offset=offset,
                         shape=tuple(init.dims))
    raise EngineDirError(f"{onnx_path}: no initializer named {name!r} (manifest and graph disagree; re-export)")
