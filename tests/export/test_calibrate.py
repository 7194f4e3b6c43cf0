"""sharpdraft-calibrate (export/calibrate.py) on tiny synthetic pairs of every family."""
import json
import random

import pytest
import torch
from click.testing import CliRunner

from export import calibrate as cal
from export.families.dflash.calibrate import DFlashRunner
from export.pipeline import load_drafter
from plugins.dilution import mean_mass_at
from plugins.rule import QueryScaleProfile
from runtime.models import attention_probe

GRID = [64, 128, 256, 512, 1024]


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    from runtime.models.target import load_target

    model, tok = load_target(str(tiny_target_dir))
    return model


def _docs(vocab, n=2, length=1100, seed=0):
    rng = random.Random(seed)
    # repetitive text so attention has something to find
    return {f"doc{i}": [rng.randrange(vocab) if rng.random() < 0.3 else 7 + (j % 50) for j in range(length)]
            for i in range(n)}


def _drafter(family, path):
    d = load_drafter(family, path).eval()
    if family == "pard":
        from runtime.models.hf_query_scale import ATTN_IMPLEMENTATION

        d.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return d


@pytest.mark.parametrize("family,fixture", [("dflash", "tiny_dflash_dir"), ("pard", "tiny_pard_dir"),
                                            ("eagle3", "tiny_eagle3_dir")])
def test_calibrate_every_family(family, fixture, request, tiny_target):
    drafter = _drafter(family, request.getfixturevalue(fixture))
    ck = QueryScaleProfile(ref_keys=200, slope=4.0)
    res = cal.calibrate(family, drafter, tiny_target, _docs(tiny_target.config.vocab_size), n_grid=GRID,
                        train_keys=128, checkpoint_profile=ck, progress=False)
    layers = {"dflash": drafter.config.num_hidden_layers if family == "dflash" else 0,
              "pard": getattr(drafter, "num_layers", 0), "eagle3": 1}[family]
    assert [p["num_keys"] for p in res["frozen"]] == GRID
    for p in res["frozen"]:
        assert p["samples"] == 2 * len(cal.row_keys(p["num_keys"]))
        assert len(p["layers"]) == layers
        for lay in p["layers"]:
            assert 0 < lay["mass"] < 1 and lay["contrast_gain"] >= 0
            assert lay["identity_max_abs_residual"] < 1e-6
        assert 1 <= p["proxy_mal"] <= (drafter.config.block_size if family == "dflash" else 2)
    req = {r["num_keys"]: r["beta"] for r in res["required_beta"]}
    assert req[64] == req[128] == 1.0 and all(b >= 1 for b in req.values())
    fitted = QueryScaleProfile.from_dict(res["fitted_profile"])
    assert set(res["scaled"]) == {"paper", "fitted", "fitted-free-cap", "checkpoint"}
    free = QueryScaleProfile.from_dict(res["fitted_free_cap_profile"])
    assert free.cap == pytest.approx(max(max(req.values()), 1.001))
    assert res["fit_free_cap_rmse"] >= 0 and res["fit_rmse"] >= 0
    if max(req.values()) > fitted.cap:  # freeing the cap reaches further at the largest N
        assert free.beta(max(GRID)) > fitted.beta(max(GRID))
    assert res["scaled"]["checkpoint"]["profile"] == ck.to_dict()
    # layer 0 sees exactly beta * its frozen scores: its mass can only rise where beta > 1, and is unchanged at beta 1
    for label, block in res["scaled"].items():
        prof = QueryScaleProfile.from_dict(block["profile"])
        for frozen, scaled in zip(res["frozen"], block["points"]):
            m0, m1 = frozen["layers"][0]["mass"], scaled["layers"][0]["mass"]
            n = frozen["num_keys"]
            if float(prof.beta(min(cal.row_keys(n)))) > 1.0 + 1e-6:
                assert m1 > m0, (label, n)
            elif float(prof.beta(n)) == 1.0:
                assert m1 == pytest.approx(m0, abs=1e-6), (label, n)
    assert fitted.ref_keys > 32 and fitted.slope > 0


def test_probe_scores_match_the_attention(tiny_dflash_dir, tiny_target):
    """The scores handed to the probe are the ones the softmax reads: beta-scaled mass == analytic mass."""
    drafter = _drafter("dflash", tiny_dflash_dir)
    runner = DFlashRunner(drafter, tiny_target)
    doc = runner.prepare(list(range(5, 600)))
    frozen = runner.run(doc, [512], None)[0][0][0]
    beta = 1.37
    # a profile whose beta is the cap for every row of the grid point
    prof = QueryScaleProfile(ref_keys=33, slope=0.01, cap=beta)
    scaled = runner.run(doc, [512], prof)[0][0][0]
    for f, s in zip(frozen, scaled):
        torch.testing.assert_close(s, f * beta, rtol=1e-4, atol=1e-4)
        assert abs(mean_mass_at(f, beta) - mean_mass_at(s, 1.0)) < 1e-4
    assert not attention_probe.active()


def test_cli_writes_plots_and_reexports_with_fitted_profile(tiny_engines, tmp_path):
    text = tmp_path / "doc.txt"
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n"]
    rng = random.Random(0)
    text.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    out, eng = tmp_path / "cal", tmp_path / "eng_fitted"
    r = CliRunner().invoke(cal.main, ["--engine", str(tiny_engines), "--text", str(text), "--grid", "64,128,256,512",
                                      "--train-keys", "128", "--out", str(out), "--fit-cap",
                                      "--write-engine", str(eng)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "calibration.json").read_text())
    for name in ("mass_vs_keys.png", "proxy_vs_keys.png", "beta_vs_keys.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    manifest = json.loads((eng / "manifest.json").read_text())
    fitted = res["fitted_free_cap_profile"]
    assert manifest["query_scale"]["ref_keys"] == fitted["ref_keys"]
    assert manifest["query_scale"]["cap"] == pytest.approx(fitted["cap"])
    assert manifest["query_scale"]["slope"] == pytest.approx(fitted["slope"])
    assert manifest["target"]["precision"] == "fp32"  # the --engine folder's own precision is kept


def test_cli_refuses_bad_grid(tiny_engines, tmp_path):
    r = CliRunner().invoke(cal.main, ["--engine", str(tiny_engines), "--grid", "64,9000", "--out", str(tmp_path)])
    assert r.exit_code != 0 and "positions" in r.output
    r = CliRunner().invoke(cal.main, ["--out", str(tmp_path)])
    assert r.exit_code != 0 and "--engine" in r.output


def test_a_sliding_window_layer_is_scaled_by_its_own_n_and_left_out_of_the_fit(tmp_path, tiny_target):
    """DFlash with layer 0 windowed: beta reaches that layer only through its own N (<= window + block), as in the
    exported graph, so under a profile whose ref_keys exceeds the window its scores are the frozen ones; the fit
    uses the full layer only."""
    from tests.conftest import write_tiny_dflash

    window = 96
    drafter = _drafter("dflash", write_tiny_dflash(tmp_path / "swa", sliding_window=window))
    assert drafter.config.windows == [window, None]
    ck = QueryScaleProfile(ref_keys=200, slope=4.0)  # beta(N) = 1 for N <= 200 > window + block
    res = cal.calibrate("dflash", drafter, tiny_target, _docs(tiny_target.config.vocab_size), n_grid=GRID,
                        train_keys=100, checkpoint_profile=ck, progress=False)
    assert res["fit_layers"] == [1] and res["layer_windows"] == [window, None]
    assert [p["num_keys"] for p in res["frozen"]] == sorted(GRID + [100])
    assert res["mass_reference_num_keys"] == 100  # the training length joins the grid: its mass is the one kept
    for frozen, scaled in zip(res["frozen"], res["scaled"]["checkpoint"]["points"]):
        assert scaled["layers"][0]["mass"] == pytest.approx(frozen["layers"][0]["mass"], abs=1e-6)
        if frozen["num_keys"] >= 512:  # the full layer: beta > 1 raises its mass
            assert scaled["layers"][1]["mass"] > frozen["layers"][1]["mass"]
    # the windowed layer does not dilute past its window: its mass at 512 and 1024 keys is the same within noise
    m = {p["num_keys"]: p["layers"][0]["mass"] for p in res["frozen"]}
    assert abs(m[512] - m[1024]) < 0.05
