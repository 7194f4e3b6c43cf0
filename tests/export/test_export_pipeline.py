"""sharpdraft-export on the tiny pair: manifest contents, in-graph beta at several N, CLI errors, atomicity."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from export.cli import main as export_cli
from export.pipeline import ExportConfig, ExportError, phase_lines, run_export
from plugins.rule import QueryScaleProfile
from runtime.manifest import load_manifest
from runtime.models.dflash import load_dflash
from tests.conftest import write_tiny_dflash


def test_manifest_records_profile_io_and_validation(tiny_engines):
    m = load_manifest(tiny_engines).to_dict()
    qs = m["query_scale"]
    assert (qs["ref_keys"], qs["slope"], qs["top_k"], qs["enabled"]) == (64, 5.0, 32, True)
    assert qs["source"].startswith("cli")
    assert qs["rewrite"]["DecomposedAttentionQueryScale"] == 2 and qs["rewrite"]["beta_subgraphs"] == 1
    assert m["drafter"]["block_size"] == 4 and m["drafter"]["mask_embedding"] is True
    assert m["graphs"]["drafter"]["inputs"][-4:] == ["embed_weight", "lm_head_weight", "draft_slots",
                                                     "query_scale_enabled"]
    off = m["validation"]["drafter"]["switched_off"]  # switch 0: equals the frozen drafter at N = 4 ref
    assert off["beta"] == 1.0 and off["max_abs_diff_logits"] <= off["bound"]
    assert "attention_mask" in m["graphs"]["drafter"]["inputs"] and "attention_mask" in qs["num_keys"]
    ragged = m["validation"]["drafter"]["ragged"]  # one call, rows at N = 4 ref and ref - 1, each vs its solo run
    assert [p["num_keys"] for p in ragged] == [256, 63] and ragged[1]["beta"] == 1.0
    assert all(p["max_abs_diff_logits"] <= p["bound"] for p in ragged)
    assert set(m["shared_weights"]) == {"embed_weight", "lm_head_weight"}
    assert m["validation"]["target"]["max_abs_diff_logits"] < 1e-3


def test_validation_points_follow_the_rule(tiny_engines):
    """The exported drafter's beta at N = 100, ref, 4 ref, 20 ref equals the rule (ORT vs torch at that beta),
    and beta visibly changes the logits above ref_keys (so a constant-folded beta could not pass)."""
    m = load_manifest(tiny_engines).to_dict()
    prof = QueryScaleProfile(ref_keys=64)
    pts = {p["num_keys"]: p for p in m["validation"]["drafter"]["points"]}
    assert sorted(pts) == [64, 100, 256, 1280]
    for n, p in pts.items():
        assert p["beta"] == pytest.approx(prof.beta(n), abs=1e-6)
        assert p["max_abs_diff_logits"] <= p["bound"]
    assert pts[64]["beta"] == 1.0 and pts[64]["beta_effect_on_logits"] == 0.0
    for n in (100, 256, 1280):
        assert pts[n]["beta_effect_on_logits"] > 20 * pts[n]["max_abs_diff_logits"]


def test_graph_beta_intermediate(tiny_engines, tmp_path):
    """Expose the in-graph beta tensor as an output and read it at several N (never a folded constant)."""
    import onnxruntime as ort

    src = tiny_engines / "drafter" / "model.onnx"
    model = onnx.load(str(src))
    mul = next(n for n in model.graph.node if any(p.key == "sharpdraft.role" for p in n.metadata_props))
    beta_name = mul.input[1]
    model.graph.output.append(onnx.helper.make_tensor_value_info(beta_name, onnx.TensorProto.FLOAT, None))
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data")
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    m = load_manifest(tiny_engines).to_dict()
    d = m["drafter"]["config"]
    blk, ctx, prof = d["block_size"], 2, QueryScaleProfile(ref_keys=64)
    def beta_rows(ns: list[int], switch: list[float] | None = None) -> np.ndarray:
        """One call, one row per N: caches right-padded to the longest, padding masked out."""
        b, l_max = len(ns), max(ns) - ctx - blk
        mask = np.zeros((b, l_max + ctx + blk), np.int64)
        for r, n in enumerate(ns):
            mask[r, : n - ctx - blk] = 1
            mask[r, l_max:] = 1
        feed = {"input_ids": np.full((b, blk), d["dflash_config"]["mask_token_id"], np.int64),
                "target_hidden": np.zeros((b, ctx, 128), np.float32), "attention_mask": mask,
                "query_scale_enabled": np.asarray(switch or [1.0] * b, np.float32),
                "position_ids": np.tile(np.arange(l_max, l_max + ctx + blk, dtype=np.int64), (b, 1)),
                "embed_weight": np.zeros((d["vocab_size"], 64), np.float32),
                "lm_head_weight": np.zeros((d["vocab_size"], 64), np.float32),
                "draft_slots": np.arange(1, blk, dtype=np.int64)}
        for i in range(d["num_hidden_layers"]):
            feed[f"past_key.{i}"] = feed[f"past_value.{i}"] = np.zeros((b, 2, l_max, 16), np.float32)
        return np.asarray(sess.run([beta_name], feed)[0]).reshape(b)

    for n in (100, 64, 4 * 64, 20 * 64):
        assert beta_rows([n])[0] == pytest.approx(prof.beta(n), abs=1e-6)
    ns = [64 - 2, 64 - 1, 64, 64 + 1, 64 + 2, 20 * 64]  # rows of one ragged batch straddle ref_keys
    got = beta_rows(ns)
    np.testing.assert_allclose(got, [prof.beta(n) for n in ns], atol=1e-6)
    assert got[:3].tolist() == [1.0, 1.0, 1.0] and all(x > 1.0 for x in got[3:])
    off = beta_rows([20 * 64, 20 * 64], switch=[0.0, 1.0])  # per-request switch: off -> 1, on -> beta(N)
    assert off[0] == 1.0 and off[1] == pytest.approx(prof.beta(20 * 64), abs=1e-6)


def test_profile_precedence(tiny_target_dir, tmp_path):
    from export.pipeline import choose_profile

    ck = load_dflash(write_tiny_dflash(tmp_path / "c", query_scale={"ref_keys": 256, "slope": 4.0}))
    p, src = choose_profile(ExportConfig(family="dflash", out=tmp_path / "o"), ck)
    assert (p.ref_keys, p.slope, src) == (256, 4.0, "checkpoint")
    p, src = choose_profile(ExportConfig(family="dflash", out=tmp_path / "o", slope=3.0), ck)
    assert (p.ref_keys, p.slope) == (256, 3.0) and src.startswith("cli")
    p, _ = choose_profile(ExportConfig(family="dflash", out=tmp_path / "o", query_scale=False), ck)
    assert not p.enabled
    plain = load_dflash(write_tiny_dflash(tmp_path / "d"))
    p, src = choose_profile(ExportConfig(family="dflash", out=tmp_path / "o"), plain)
    assert (p.ref_keys, src) == (2048, "family-preset")


def _run_cli(*args):
    return CliRunner().invoke(export_cli, list(args))


def test_cli_unknown_drafter(tmp_path):
    r = _run_cli("--drafter", "medusa", "--out", str(tmp_path / "e"))
    assert r.exit_code != 0 and "medusa" in r.output


def test_cli_missing_checkpoint(tmp_path, tiny_target_dir):
    r = _run_cli("--drafter", "dflash", "--checkpoint", str(tmp_path / "none"), "--target", str(tiny_target_dir),
                 "--out", str(tmp_path / "e"))
    assert r.exit_code == 1 and "no such checkpoint folder" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "e").exists()


def test_cli_corrupt_checkpoint(tmp_path, tiny_target_dir):
    ck = write_tiny_dflash(tmp_path / "c")
    (ck / "model.safetensors").write_bytes(b"garbage" * 10)
    r = _run_cli("--drafter", "dflash", "--checkpoint", str(ck), "--target", str(tiny_target_dir),
                 "--out", str(tmp_path / "e"))
    assert r.exit_code == 1 and "corrupt" in r.output and not (tmp_path / "e").exists()


def test_cli_unwritable_out(tmp_path, tiny_target_dir, tiny_dflash_dir):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    # root ignores mode bits: /proc/1 is a folder nobody can create entries in
    parent = ro if os.geteuid() != 0 else Path("/proc/1")
    try:
        r = _run_cli("--drafter", "dflash", "--checkpoint", str(tiny_dflash_dir), "--out", str(parent / "e"))
        assert r.exit_code == 1 and "not writable" in r.output and len(r.output.strip().splitlines()) == 1
    finally:
        ro.chmod(0o700)


def test_cli_out_is_a_file(tmp_path, tiny_dflash_dir):
    f = tmp_path / "file"
    f.write_text("x")
    r = _run_cli("--drafter", "dflash", "--checkpoint", str(tiny_dflash_dir), "--out", str(f / "e"))
    assert r.exit_code == 1 and "cannot create" in r.output


def test_cli_out_not_an_engines_folder(tmp_path, tiny_dflash_dir):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "precious.txt").write_text("keep me")
    r = _run_cli("--drafter", "dflash", "--checkpoint", str(tiny_dflash_dir), "--out", str(tmp_path / "e"))
    assert r.exit_code == 1 and "not an engines folder" in r.output
    assert (tmp_path / "e" / "precious.txt").read_text() == "keep me"


def test_mismatched_target_refused(tmp_path, tiny_target_dir):
    ck = write_tiny_dflash(tmp_path / "c")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["num_target_layers"] = 30
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="num_target_layers 30 vs target layers 4"):
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=tmp_path / "e", checkpoint=ck, target=str(tiny_target_dir)))


def test_interrupted_export_leaves_nothing(tmp_path, tiny_target_dir, tiny_dflash_dir, tiny_engines, monkeypatch):
    """An interrupt mid-export leaves neither a new half-written folder nor a damaged existing one."""
    import shutil

    import export.families.dflash.validate as validate

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate_drafter", boom)
    out = tmp_path / "e"
    with pytest.raises(KeyboardInterrupt):
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir)))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    shutil.copytree(tiny_engines, out)  # an existing, valid engines folder survives an interrupted re-export
    with pytest.raises(KeyboardInterrupt):
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir)))
    assert load_manifest(out).to_dict()["query_scale"]["ref_keys"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_no_query_scale_export_is_frozen(tmp_path, tiny_target_dir, tiny_dflash_dir):
    out = tmp_path / "frozen"
    m = run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir, target=str(tiny_target_dir),
                                query_scale=False))
    assert m["query_scale"]["enabled"] is False and m["query_scale"]["rewrite"]["beta_subgraphs"] == 0
    assert all(p["beta"] == 1.0 for p in m["validation"]["drafter"]["points"])
    g = onnx.load(str(out / "drafter" / "model.onnx"), load_external_data=False)
    assert not any(n.name.startswith("sharpdraft/") for n in g.graph.node)


def _with_tokenizer(ck: Path, tokenizer, edit_id: int | None = None) -> Path:
    """Ship a copy of the target tokenizer inside the drafter checkpoint, token ``edit_id`` renamed."""
    tokenizer.save_pretrained(ck)
    if edit_id is not None:  # rename it in the vocabulary and in the added-token list
        tj = json.loads((ck / "tokenizer.json").read_text())
        old = tokenizer.convert_ids_to_tokens(edit_id)
        for entry in tj["added_tokens"]:
            if entry["id"] == edit_id:
                entry["content"] = "<not_the_same>"
        tj["model"]["vocab"].pop(old)
        tj["model"]["vocab"]["<not_the_same>"] = edit_id
        (ck / "tokenizer.json").write_text(json.dumps(tj))
    return ck


def test_case10_token_string_differs_export_refuses_naming_the_id(tmp_path, tiny_target_dir, tokenizer):
    ck = _with_tokenizer(write_tiny_dflash(tmp_path / "c"), tokenizer, edit_id=5)
    with pytest.raises(ExportError, match=r"differ at token id 5: drafter '<not_the_same>', target '<file_sep>'"):
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=tmp_path / "e", checkpoint=ck, target=str(tiny_target_dir)))
    assert not (tmp_path / "e").exists()


def test_padding_rows_only_are_accepted(tmp_path, tokenizer):
    from export.pipeline import check_vocabulary

    ck = _with_tokenizer(write_tiny_dflash(tmp_path / "c"), tokenizer)
    check_vocabulary(ck, 49152 + 128, 49152, tokenizer)  # same tokens, 128 padding rows: fine
    with pytest.raises(ExportError, match="drafter vocab_size 32000 is smaller"):
        check_vocabulary(ck, 32000, 49152, tokenizer)


def test_exported_folder_honours_the_umask(tmp_path, tiny_target_dir, tiny_dflash_dir):
    """Folders used to be 0700 (tempfile.mkdtemp) whatever the umask: another user's server could not read them."""
    import stat

    old = os.umask(0o022)
    try:
        out = tmp_path / "e"
        run_export(ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir,
                                target=str(tiny_target_dir), ref_keys=64))
    finally:
        os.umask(old)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes["."] == 0o755 and modes["target"] == 0o755
    assert all(m == 0o644 for rel, m in modes.items() if (out / rel).is_file()), modes


def test_replacing_a_folder_keeps_extra_files_and_says_so(tmp_path, tiny_engines, tiny_target_dir, tiny_dflash_dir,
                                                         caplog):
    out = tmp_path / "e"
    shutil.copytree(tiny_engines, out)
    (out / "NOTES.md").write_text("my notes")
    (out / "target" / "profile.json").write_text("{}")
    cfg = ExportConfig(target_precision="fp32", family="dflash", out=out, checkpoint=tiny_dflash_dir,
                       target=str(tiny_target_dir), ref_keys=48)
    with caplog.at_level("INFO", logger="sharpdraft.export"):
        run_export(cfg)
    assert load_manifest(out).to_dict()["query_scale"]["ref_keys"] == 48 and not (out / "NOTES.md").exists()
    # the CLI's progress bar has as many phases as the export logs phase lines
    assert sum(r.getMessage().endswith("...") for r in caplog.records) == phase_lines(cfg) == 4
    kept = tmp_path / ".e.previous"
    assert (kept / "NOTES.md").read_text() == "my notes" and (kept / "target" / "profile.json").is_file()
    # only those files: the old export itself (103 MB for the default pair) is not kept beside them
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == [
        "NOTES.md", "target/profile.json"]
    assert "NOTES.md, target/profile.json" in caplog.text and str(kept) in caplog.text


def test_replacing_a_folder_never_leaves_the_path_missing(tmp_path):
    """The swap is one atomic exchange: a reader polling the path never finds it gone (it used to be renamed
    away and then replaced, two steps)."""
    import threading

    from export.pipeline import _replace_dir

    out = tmp_path / "engines"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    missing, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            if not out.is_dir():
                missing.append(1)

    t = threading.Thread(target=watch)
    t.start()
    try:
        reports = []
        for i in range(100):
            new = tmp_path / f".engines.tmp-{i}"
            new.mkdir()
            (new / "manifest.json").write_text(json.dumps({"i": i}))
            reports.append(_replace_dir(new, out))
    finally:
        stop.set()
        t.join()
    if not all(r["exchange"] for r in reports):
        pytest.skip("this file system has no atomic exchange (renameat2); the two-rename fallback was used")
    assert not missing and json.loads((out / "manifest.json").read_text()) == {"i": 99}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines"]
