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

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class EngineDirError(RuntimeError):
    """An engines/ folder is missing, incomplete, tampered with or from another schema; says what to do."""


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def load_manifest(engine_dir: str | Path, verify_checksums: bool = True) -> dict[str, Any]:
    """Read and check ``engine_dir/manifest.json``.

    Raises:
        EngineDirError: folder or manifest missing, unreadable JSON, other schema version, a graph file missing or
        whose sha256 differs from the manifest. The message says to re-run ``sharpdraft-export``.
    """
    root = Path(engine_dir)
    redo = f"re-create it with `sharpdraft-export --drafter dflash --out {root}`"
    if not root.is_dir():
        raise EngineDirError(f"{root}: no such folder; pass the folder `sharpdraft-export --out` wrote")
    path = root / MANIFEST
    if not path.is_file():
        raise EngineDirError(f"{root}: no {MANIFEST}; not an engines folder ({redo})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{path}: not valid JSON ({e}); {redo}") from e
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if isinstance(manifest, dict) and isinstance(manifest.get("drafter"), dict):
        redo = redo.replace("--drafter dflash", f"--drafter {manifest['drafter'].get('family', 'dflash')}")
    if version != SCHEMA_VERSION:
        raise EngineDirError(f"{path}: schema_version {version!r}, this runtime reads {SCHEMA_VERSION}; {redo}")
    for key in ("drafter", "target", "graphs", "tokenizer", "query_scale", "shared_weights"):
        if key not in manifest:
            raise EngineDirError(f"{path}: missing section {key!r}; {redo}")
    for gname, graph in manifest["graphs"].items():
        for rel, digest in graph["sha256"].items():
            f = root / rel
            if not f.is_file():
                raise EngineDirError(f"{root}: {rel} is missing ({gname} graph); {redo}")
            if verify_checksums and sha256_file(f) != digest:
                raise EngineDirError(f"{root}: checksum mismatch for {rel} ({gname} graph): the file changed after "
                                     f"export; {redo}")
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
