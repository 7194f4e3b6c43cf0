"""Compare two engines/ folders as a refactor check: are their graphs the same computation and their manifests the
same contract?

    python scripts/compare_engines.py runs/eng-before runs/eng-after

Graphs (every ``*.onnx`` under the folder): equal as ONNX protobufs once the exporter's debugging metadata is set
aside (per-node ``metadata_props``: torch.onnx's stack traces name the source file and line, so the same code
exported from two checkouts differs there; ``doc_string``s; ``producer_version``, which the model builder stamps
with the checkout's git commit), with identical external-data files byte for byte.
Manifests: equal apart from ``created`` and the checkpoint path, and the graph entries' sha256 of the ``.onnx``
files themselves (which carry that metadata). Exit status 0 when the folders match, 1 with one line per
difference otherwise.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from runtime.manifest import sha256_file


def _graph_bytes(path: Path) -> bytes:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for coll in (model.graph.input, model.graph.output, model.graph.value_info, model.graph.initializer):
        for x in coll:
            if hasattr(x, "metadata_props"):
                del x.metadata_props[:]
            x.doc_string = ""
    del model.metadata_props[:]
    model.graph.doc_string = model.doc_string = ""
    model.producer_version = ""  # the model builder stamps it with the checkout's git commit
    return model.SerializeToString(deterministic=True)


def _manifest(folder: Path) -> dict:
    m = json.loads((folder / "manifest.json").read_text())
    m.pop("created", None)
    m.get("drafter", {}).pop("checkpoint", None)
    for entry in m.get("graphs", {}).values():  # the .onnx files' own hashes carry the exporter's metadata
        for name in [n for n in entry.get("sha256", {}) if n.endswith(".onnx")]:
            entry["sha256"].pop(name)
    return m


def _diff(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"manifest{where}.{k}: only in {'the second' if k not in a else 'the first'} folder")
            else:
                out += _diff(a[k], b[k], f"{where}.{k}")
        return out
    return [] if a == b else [f"manifest{where}: {json.dumps(a)[:80]} != {json.dumps(b)[:80]}"]


def compare(first: Path, second: Path) -> list[str]:
    """The differences between two engines folders (empty: same graphs and same manifest), one line each.

    Raises:
        FileNotFoundError: a folder has no manifest.json.
    """
    out = _diff(_manifest(first), _manifest(second))
    files_a = {p.relative_to(first) for p in first.rglob("*") if p.is_file() and p.name != "manifest.json"}
    files_b = {p.relative_to(second) for p in second.rglob("*") if p.is_file() and p.name != "manifest.json"}
    out += [f"{p}: only in {first}" for p in sorted(files_a - files_b)]
    out += [f"{p}: only in {second}" for p in sorted(files_b - files_a)]
    for rel in sorted(files_a & files_b):
        if rel.suffix == ".onnx":
            if _graph_bytes(first / rel) != _graph_bytes(second / rel):
                out.append(f"{rel}: the graphs differ (nodes, initializers, inputs or outputs)")
        elif rel.name != "export.log" and sha256_file(first / rel) != sha256_file(second / rel):
            out.append(f"{rel}: the files differ")
    return out


@click.command()
@click.argument("first", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("second", type=click.Path(exists=True, file_okay=False, path_type=Path))
def main(first: Path, second: Path) -> None:
    """Exit 0 when FIRST and SECOND hold the same graphs and manifest; else print each difference, exit 1."""
    diffs = compare(first, second)
    for line in diffs:
        click.echo(line)
    click.echo(f"{first} vs {second}: " + ("same graphs and manifest" if not diffs else f"{len(diffs)} differences"))
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
