"""scripts/compare_engines.py: the refactor check says "same" for the same export made twice from different
checkouts' worth of metadata, and names a changed graph, a changed data file and a changed manifest field."""
from __future__ import annotations

import json
import shutil

import onnx
from click.testing import CliRunner

from scripts import compare_engines as ce


def test_same_folder_with_other_metadata_and_creation_time_is_the_same(tiny_engines, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_engines, copy)
    model_path = copy / "drafter" / "model.onnx"
    model = onnx.load(str(model_path), load_external_data=False)
    entry = model.graph.node[0].metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.stack_trace", 'File "/another/checkout/export/graph.py", line 1'
    onnx.save(model, str(model_path))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["created"] = "2000-01-01T00:00:00+00:00"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert ce.compare(tiny_engines, copy) == []
    result = CliRunner().invoke(ce.main, [str(tiny_engines), str(copy)])
    assert result.exit_code == 0 and "same graphs and manifest" in result.output


def test_a_changed_graph_file_and_manifest_are_named(tiny_engines, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_engines, copy)
    model_path = copy / "drafter" / "model.onnx"
    model = onnx.load(str(model_path), load_external_data=False)
    model.graph.node[0].name += "_changed"
    onnx.save(model, str(model_path))
    (copy / "tokenizer" / "tokenizer.json").write_text("{}")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["query_scale"]["slope"] = 123.0
    (copy / "manifest.json").write_text(json.dumps(manifest))
    diffs = ce.compare(tiny_engines, copy)
    assert any(d.startswith("drafter/model.onnx: the graphs differ") for d in diffs)
    assert any(d.startswith("tokenizer/tokenizer.json: the files differ") for d in diffs)
    assert any("query_scale.slope" in d for d in diffs)
    result = CliRunner().invoke(ce.main, [str(tiny_engines), str(copy)])
    assert result.exit_code == 1 and f"{len(diffs)} differences" in result.output
