"""The vLLM plugin's pieces without an engine: registration, N per family, beta == plugins/rule.py, the scale-off
identity, and the refusals. Needs vLLM: runs in .venv-vllm (scripts/test.sh's second pytest run); skipped in .venv."""
import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

from plugins.rule import QueryScaleProfile, beta, visible_keys as rule_visible_keys  # noqa: E402
from plugins.vllm import ARCHITECTURES, register  # noqa: E402
from plugins.vllm.compat import VersionError, check_version  # noqa: E402
from plugins.vllm.scale import ProfileError, QueryScaledRope, profile_of, scale_queries, visible_keys  # noqa: E402


def _rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):  # CustomOps are built inside a config context
        return get_rope(64, max_position=8192, is_neox_style=True,
                        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})


def test_registered_by_the_entry_point():
    from importlib.metadata import entry_points

    assert any(e.value == "plugins.vllm:register" for e in entry_points(group="vllm.general_plugins"))
    register()
    register()  # vLLM may load plugins more than once
    from vllm import ModelRegistry

    assert set(ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())


def test_dflash_block_n_worked_example():
    # B = 3, two requests with 5 and 9 context tokens: queries at positions [5, 6, 7, 9, 10, 11] -> N = s + B
    n = visible_keys(torch.tensor([5, 6, 7, 9, 10, 11]), block=3, window=None)
    assert n.tolist() == [8, 8, 8, 12, 12, 12]
    kv = torch.tensor([8, 12])  # plugins.rule's own count for non-causal blocks, windowed too
    assert n.view(2, 3).tolist() == rule_visible_keys(kv, 3, causal=False).tolist()
    w = visible_keys(torch.tensor([5, 6, 7, 9, 10, 11]), block=3, window=4)
    assert w.view(2, 3).tolist() == rule_visible_keys(kv, 3, causal=False, window=4).tolist()


def test_causal_n():
    pos = torch.tensor([0, 1, 2, 100, 5000])
    assert visible_keys(pos, None, None).tolist() == [1, 2, 3, 101, 5001]
    assert visible_keys(pos, None, 768).tolist() == [1, 2, 3, 101, 768]


def test_beta_is_the_rules_and_lands_after_rope():
    prof = QueryScaleProfile(ref_keys=1279)
    rope = _rope()
    wrapped = QueryScaledRope(rope, prof, num_heads=9, head_dim=64, block=8, window=None, layer="t")
    pos = torch.arange(4000, 4016)  # two blocks of 8
    q, k = torch.randn(16, 9 * 64), torch.randn(16, 3 * 64)
    q_ref, k_ref = rope(pos, q.clone(), k.clone())
    q_out, k_out = wrapped(pos, q.clone(), k.clone())
    n = visible_keys(pos, 8, None)
    b = torch.tensor(beta(n.numpy(), ref_keys=1279), dtype=torch.float32)
    assert n.tolist() == [4008] * 8 + [4016] * 8 and (b > 1.2).all()
    assert torch.equal(k_out, k_ref)
    torch.testing.assert_close(q_out, (q_ref.view(16, 9, 64) * b[:, None, None]).view(16, -1), rtol=1e-6, atol=0)
    assert wrapped.cos_sin_cache is rope.cos_sin_cache and wrapped.head_size == 64  # what DFlash's precompute reads


def test_below_ref_keys_and_scale_off_are_vllms_own():
    rope = _rope()
    pos, q, k = torch.arange(100, 108), torch.randn(8, 576), torch.randn(8, 192)
    wrapped = QueryScaledRope(rope, QueryScaleProfile(ref_keys=1279), num_heads=9, head_dim=64, block=8,
                              window=None, layer="t")
    assert torch.equal(wrapped(pos, q.clone(), k.clone())[0], rope(pos, q.clone(), k.clone())[0])  # beta = 1 exactly

    class Attn(torch.nn.Module):
        num_heads, head_dim = 9, 64

        def __init__(self):
            super().__init__()
            self.rotary_emb = rope

    a = Attn()
    assert scale_queries(a, QueryScaleProfile(ref_keys=1279, enabled=False), block=8, window=None, layer="t") is False
    assert a.rotary_emb is rope  # scale off: nothing installed, the module is vLLM's own


def test_refusals_one_line():
    class Cfg:
        pass

    with pytest.raises(ProfileError, match="has no sharpdraft_query_scale") as e:
        profile_of(Cfg(), "drafter /x")
    assert "\n" not in str(e.value)
    c = Cfg()
    c.sharpdraft_query_scale = {"ref_keys": 1279, "per_layer": [1, 2]}
    with pytest.raises(ProfileError, match="cannot be honoured: unknown query-scale profile fields"):
        profile_of(c, "drafter /x")
    c.sharpdraft_query_scale = {"ref_keys": 16}
    with pytest.raises(ProfileError, match="ref_keys must be an integer > top_k"):
        profile_of(c, "drafter /x")
    with pytest.raises(VersionError, match=r"vLLM 0.40.1 is outside the tested range \(0.32.x\)"):
        check_version("0.40.1")
    assert check_version() == vllm.__version__
