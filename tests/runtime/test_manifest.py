"""runtime/manifest.py: the typed engines/ contract, checked on read with errors that name the field."""
import copy
import json
import shutil

import pytest

from plugins.rule import Family
from runtime.manifest import SCHEMA_VERSION, EngineDirError, Manifest, load_manifest
from runtime.modes import KvIo


def test_exported_manifest_round_trips_and_is_typed(tiny_engines):
    raw = json.loads((tiny_engines / "manifest.json").read_text())
    m = Manifest.from_dict(raw)
    assert m.to_dict() == raw
    assert m.schema_version == SCHEMA_VERSION
    assert m.drafter.family is Family.DFLASH and m.drafter.details["block_size"] >= 2
    assert m.graphs["target"].kv_io is KvIo.STATIC and m.graphs["drafter"].kv_io is KvIo.STATIC
    assert m.target.precision == "fp32" and m.query_scale.profile.ref_keys == 64
    assert 1 <= m.drafter.verify_draft_tokens <= m.drafter.num_draft_tokens


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["target"].pop("precision"), r"target\.precision is missing"),
    (lambda m: m["target"].update(num_layers="4"), r"target\.num_layers: expected int"),
    (lambda m: m["drafter"].update(family="medusa"), r"drafter\.family: unknown drafter family 'medusa'"),
    (lambda m: m["graphs"]["target"].update(kv_io="paged"), r"kv_io must be one of static, concat, shared, auto, got 'paged'"),
    (lambda m: m["graphs"]["target"].pop("kv_io"), r"graphs\.target\.kv_io is missing"),
    (lambda m: m["drafter"].update(verify_draft_tokens=99), r"verify_draft_tokens 99 is outside"),
    (lambda m: m["tokenizer"].update(colour="blue"), r"tokenizer: unknown field\(s\) \['colour'\]"),
    (lambda m: m["query_scale"].update(slope=-1), r"query_scale: slope must be"),
])
def test_a_bad_field_is_named_and_the_fix_given(tiny_engines, tmp_path, edit, match):
    eng = tmp_path / "e"
    shutil.copytree(tiny_engines, eng)
    m = json.loads((eng / "manifest.json").read_text())
    edit(m)
    (eng / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineDirError, match=match) as e:
        load_manifest(eng, verify_checksums=False)
    assert "sharpdraft-export" in str(e.value)


def test_an_older_schema_is_refused_with_re_export(tiny_engines, tmp_path):
    eng = tmp_path / "e"
    shutil.copytree(tiny_engines, eng)
    m = json.loads((eng / "manifest.json").read_text())
    old = copy.deepcopy(m)
    old["schema_version"] = 1
    (eng / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(EngineDirError, match=r"schema_version 1, this runtime reads 2 .*--drafter dflash"):
        load_manifest(eng)


@pytest.mark.parametrize("folder", ["tiny_engines", "tiny_pard_engines", "tiny_eagle3_engines"])
def test_the_typed_manifest_is_the_file_byte_for_byte(folder, request):
    """load_manifest returns the typed Manifest; the writer (export/pipeline.py) builds the same objects and
    writes ``json.dumps(manifest.to_dict(), indent=1)``: reading and writing back reproduces the file exactly."""
    path = request.getfixturevalue(folder)
    manifest = load_manifest(path)
    assert isinstance(manifest, Manifest)
    assert json.dumps(manifest.to_dict(), indent=1) + "\n" == (path / "manifest.json").read_text()
