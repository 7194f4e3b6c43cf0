"""export/families/: one object per drafter family, the only place that tells the families apart."""
import pytest

from export.errors import ExportError
from export.families import FAMILIES, DrafterFamily, get_family
from plugins.rule import FAMILY_REF_KEYS, Family
from runtime.backends.ort import ORT_DRAFTERS, ort_drafter_class


def test_every_family_has_an_object_a_preset_and_a_runtime_class():
    for fam in Family:
        spec = get_family(fam.value)
        assert isinstance(spec, DrafterFamily) and spec.family is fam and get_family(fam) is spec
        assert fam in FAMILY_REF_KEYS and ort_drafter_class(fam.value) is ORT_DRAFTERS[fam]
        assert (spec.default_checkpoint / "config.json").is_file(), spec.default_checkpoint
    assert set(FAMILIES) == set(Family)


def test_unknown_family_lists_the_choices():
    with pytest.raises(ExportError, match="unknown drafter family 'medusa'; choose one of dflash, pard, eagle3"):
        get_family("medusa")


def test_taps_follow_each_checkpoint_format(tiny_dflash_dir, tiny_pard_dir, tiny_eagle3_dir):
    dflash, pard, eagle3 = (get_family(f) for f in ("dflash", "pard", "eagle3"))
    d = dflash.load(tiny_dflash_dir)
    assert dflash.taps(d, 4) == d.config.target_layer_ids  # decoder-layer outputs already
    assert dflash.draft_tokens(d, 99) == d.config.block_size - 1  # the block fixes K; --num-draft-tokens ignored
    assert pard.taps(pard.load(tiny_pard_dir), 4) == []
    e = eagle3.load(tiny_eagle3_dir)
    from export.families.eagle3 import aux_layers

    assert eagle3.taps(e, 4) == [i - 1 for i in aux_layers(e, 4)]  # HF hidden_states index -> layer output
    assert eagle3.draft_tokens(e, 3) == 3 and eagle3.draft_tokens(e, None) >= 1


def test_fused_attention_is_refused_for_a_family_without_it(tmp_path):
    from export.pipeline import ExportConfig

    with pytest.raises(ExportError, match="--fused-attention supports dflash drafters .* not pard"):
        ExportConfig(family="pard", out=tmp_path / "o", fused_attention=True)
