"""Values that are not finite never pass a check (docs/faults.md, second round, fault 1): NaN / inf weights in a
drafter or target checkpoint are refused at load with one line naming the tensor, and every numeric comparison of an
exported graph with its reference fails on a NaN (``nan > bound`` is false, so a ``diff > bound`` test let one
through: a DFlash checkpoint with one NaN exported with exit 0 and drafted nothing that was accepted)."""
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import export.checks as checks
from export.cli import main as export_cli
from export.errors import ExportError
from export.pipeline import ExportConfig, run_export
from export.validate import ValidationError, max_abs_diff, within
from runtime.models.checkpoint_io import CheckpointError
from runtime.models.dflash import load_dflash
from tests.conftest import write_tiny_dflash, write_tiny_eagle3, write_tiny_pard


def test_max_abs_diff_refuses_nan_and_unmatched_inf():
    want = np.array([[0.0, -np.inf, 2.0]])
    assert max_abs_diff(np.array([[1e-4, -np.inf, 2.0]]), want, "x") == pytest.approx(1e-4)  # -inf where designed
    with pytest.raises(ValidationError, match=r"x: the exported graph holds 1 NaN values \(first at index \(0, 2\)\)"):
        max_abs_diff(np.array([[0.0, -np.inf, np.nan]]), want, "x")
    with pytest.raises(ValidationError, match="the torch reference holds 1 NaN"):
        max_abs_diff(want, np.array([[np.nan, -np.inf, 2.0]]), "x")
    with pytest.raises(ValidationError, match="1 infinite values where the torch reference is finite"):
        max_abs_diff(np.array([[np.inf, -np.inf, 2.0]]), want, "x")
    assert max_abs_diff(np.array([[0.0, 0.0, 2.0]]), want, "x") == np.inf  # finite where -inf is due: fails a bound
    assert not within(float("nan"), 1.0) and within(1.0, 1.0) and not within(np.inf, 1.0)


def _poison(folder, key: str, value: float):
    f = folder / "model.safetensors"
    state = load_file(f)
    t = state[key].clone()
    t.view(-1)[3] = value
    state[key] = t
    save_file(state, f, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("value, counts", [(float("nan"), "1 NaN and 0 inf"), (float("inf"), "0 NaN and 1 inf")])
def test_a_nan_or_inf_weight_is_refused_naming_the_tensor(tmp_path, tiny_target_dir, value, counts):
    ck = _poison(write_tiny_dflash(tmp_path / "ck"), "layers.1.mlp.down_proj.weight", value)
    with pytest.raises(CheckpointError, match=f"'layers.1.mlp.down_proj.weight' holds {counts} values"):
        load_dflash(ck)
    r = CliRunner().invoke(export_cli, ["--drafter", "dflash", "--checkpoint", str(ck), "--target",
                                        str(tiny_target_dir), "--out", str(tmp_path / "e"),
                                        "--target-precision", "fp32"])
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if "error" in ln]
    assert len(lines) == 1 and "layers.1.mlp.down_proj.weight" in lines[0], r.output
    assert not (tmp_path / "e").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_pard_eagle3_and_target_weights_are_checked_too(tmp_path, tiny_target_dir):
    pard = _poison(write_tiny_pard(tmp_path / "pard", tiny_target_dir), "model.layers.1.mlp.up_proj.weight", np.nan)
    with pytest.raises(ExportError, match="model.layers.1.mlp.up_proj.weight"):
        run_export(ExportConfig(family="pard", out=tmp_path / "e", checkpoint=pard, target=str(tiny_target_dir),
                                target_precision="fp32"))
    eagle = _poison(write_tiny_eagle3(tmp_path / "eagle", tiny_target_dir), "fc.weight", -np.inf)
    with pytest.raises(ExportError, match="'fc.weight' holds 0 NaN and 1 inf"):
        run_export(ExportConfig(family="eagle3", out=tmp_path / "e", checkpoint=eagle, target=str(tiny_target_dir),
                                target_precision="fp32"))
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    _poison(target, "model.layers.2.self_attn.v_proj.weight", np.nan)
    with pytest.raises(ExportError, match="target .*'model.layers.2.self_attn.v_proj.weight' holds 1 NaN"):
        run_export(ExportConfig(family="dflash", out=tmp_path / "e", checkpoint=write_tiny_dflash(tmp_path / "d"),
                                target=str(target), target_precision="fp32"))
    assert not (tmp_path / "e").exists()


class _NanSession:
    """An ONNX Runtime session whose outputs get one NaN (element 5 of output ``which``), to stand for a graph that
    computes NaN: every check must fail on it, naming the tensor."""

    def __init__(self, inner, which: int):
        self.inner, self.which = inner, which

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, names, feed, *a, **k):
        out = [np.array(o, copy=True) for o in self.inner.run(names, feed, *a, **k)]
        o = out[min(self.which, len(out) - 1)]
        if o.dtype.kind == "f" and o.size > 5:
            o.reshape(-1)[5] = np.nan
        return out


def _inject(monkeypatch, graph: str, which: int = 0):
    import runtime.backends.ort as ort_backend

    real, real_shared = checks.session, ort_backend.run_shared

    def session(path):
        s = real(path)
        return _NanSession(s, which) if f"/{graph}/" in str(path) else s

    def run_shared(*a, **k):  # the shared-buffer (builder) target graph runs through IOBinding
        out = [None if o is None else np.array(o, copy=True) for o in real_shared(*a, **k)]
        out[which].reshape(-1)[5] = np.nan
        return tuple(out)

    monkeypatch.setattr(checks, "session", session)
    monkeypatch.setattr(ort_backend, "run_shared", run_shared)


@pytest.mark.parametrize("family, graph, which, precision, needle", [
    ("dflash", "target", 0, "fp32", "target graph .* logits: the exported graph holds 1 NaN"),
    ("dflash", "target", 1, "fp32", "target graph .* taps: the exported graph holds 1 NaN"),
    ("dflash", "target", 2, "fp32", "target graph .* new_key.0: the exported graph holds 1 NaN"),
    ("dflash", "drafter", 0, "fp32", r"drafter graph .* logits at N=\d+: the exported graph holds 1 NaN"),
    ("dflash", "drafter", 1, "fp32", "drafter graph .* new_key.0: the exported graph holds 1 NaN"),
    ("pard", "drafter", 0, "fp32", "PARD drafter graph .* logits at N=.*: the exported graph holds 1 NaN"),
    ("eagle3", "drafter", 0, "fp32", "EAGLE-3 drafter graph .* logits at N=.*: the exported graph holds 1 NaN"),
    ("dflash", "target", 0, "int4", r"quantized target graph .* logits \(one pass\): the exported graph holds"),
    ("dflash", "target", 1, "int4", "quantized target graph .* taps: the exported graph holds 1 NaN"),
])
def test_every_graph_check_fails_on_a_nan(monkeypatch, tmp_path, tiny_target_dir, tiny_dflash_dir, tiny_pard_dir,
                                          tiny_eagle3_dir, family, graph, which, precision, needle):
    if precision == "int4":
        pytest.importorskip("onnxruntime_genai")
    ck = {"dflash": tiny_dflash_dir, "pard": tiny_pard_dir, "eagle3": tiny_eagle3_dir}[family]
    _inject(monkeypatch, graph, which)
    kw = {} if family == "dflash" else {"num_draft_tokens": 4}
    with pytest.raises((ValidationError, ExportError), match=needle):
        run_export(ExportConfig(family=family, out=tmp_path / "e", checkpoint=ck, target=str(tiny_target_dir),
                                target_precision=precision, drafter_precision="fp32", ref_keys=64, **kw))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_quantized_drafter_check_fails_on_a_nan(monkeypatch, tmp_path, tiny_target_dir, tiny_dflash_dir):
    """The int8 drafter graph is compared with its fp32 graph on real text (proposal agreement): a NaN there too."""
    pytest.importorskip("onnxruntime_genai")
    import export.drafter_quant as dq
    from pathlib import Path

    real, real_agreement = checks.session, dq.proposal_agreement

    def agreement(float_graph, quant_graph, feeds):  # NaN in the int8 graph's logits only
        monkeypatch.setattr(checks, "session", lambda p: _NanSession(real(p), 0)
                            if Path(p) == Path(quant_graph) else real(p))
        return real_agreement(float_graph, quant_graph, feeds)

    monkeypatch.setattr(dq, "proposal_agreement", agreement)
    with pytest.raises((ValidationError, ExportError), match="quantized drafter graph .* logits: the exported graph"):
        run_export(ExportConfig(family="dflash", out=tmp_path / "e", checkpoint=tiny_dflash_dir,
                                target=str(tiny_target_dir), ref_keys=64))


def test_the_fused_drafter_check_fails_on_a_nan(monkeypatch, tmp_path, tiny_target_dir, tiny_dflash_dir):
    pytest.importorskip("onnxruntime_extensions")
    import plugins.ort_op as ort_op

    real = ort_op.session
    monkeypatch.setattr(ort_op, "session", lambda p, *a, **k: _NanSession(real(p, *a, **k), 0))
    with pytest.raises((ValidationError, ExportError), match="fused drafter graph .* logits at N=.*: the exported"):
        run_export(ExportConfig(family="dflash", out=tmp_path / "e", checkpoint=tiny_dflash_dir,
                                target=str(tiny_target_dir), target_precision="fp32", ref_keys=64,
                                fused_attention=True))
