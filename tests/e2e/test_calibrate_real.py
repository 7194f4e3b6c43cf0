"""Calibration on the real pair: the shipped full-attention DFlash drafter's attention dilutes with N and beta
restores it (the default drafter windows layer 0, whose N stops at its window: calibrated in docs/long-context.md).

Small version of ``sharpdraft-calibrate --engine engines/`` (one built-in text, N in {128, 512, 2048}); the full
run and its figures are in docs/long-context.md.
"""
import pytest

from export import calibrate as cal
from export.families import REPO_ROOT
from export.pipeline import load_drafter
from plugins.rule import QueryScaleProfile

pytestmark = pytest.mark.slow


def test_dflash_dilution_and_fit_on_real_pair():
    from runtime.models.target import load_target

    model, tok = load_target(None)
    model.set_attn_implementation("sdpa")
    drafter = load_drafter("dflash", REPO_ROOT / "drafters" / "dflash-smollm2-135m").eval()
    docs = dict(list(cal.default_texts(2100, tok).items())[:1])
    res = cal.calibrate("dflash", drafter, model, docs, n_grid=[128, 512, 2048], train_keys=512, progress=False)
    mass = {p["num_keys"]: [lay["mass"] for lay in p["layers"]] for p in res["frozen"]}
    for layer in range(len(mass[128])):
        # dilution with N; eighth-run weights: layer 0 0.946 -> 0.896 -> 0.697, layer 1 0.878 -> 0.791 -> 0.689
        assert mass[128][layer] > mass[512][layer] + 0.03 and mass[512][layer] > mass[2048][layer] + 0.05
    for p in res["frozen"]:
        assert all(lay["identity_max_abs_residual"] < 1e-6 for lay in p["layers"])
    req = {r["num_keys"]: r["beta"] for r in res["required_beta"]}
    assert req[512] == 1.0 and req[2048] > 1.2
    fitted = QueryScaleProfile.from_dict(res["fitted_profile"])
    assert fitted.beta(2048) > 1.2
    scaled = {p["num_keys"]: [lay["mass"] for lay in p["layers"]] for p in res["scaled"]["fitted"]["points"]}
    assert all(s > f + 0.1 for s, f in zip(scaled[2048], mass[2048]))  # beta gives the mass back
