"""The logn_scaling table for TensorRT-LLM's in-kernel route equals the rule and the q-multiply route."""
import math

import pytest
import torch

from plugins.rule import QueryScaleProfile
from plugins.trtllm_tables import logn_scaling_table, scale_query


def test_table_is_beta_of_position_plus_one():
    prof = QueryScaleProfile.for_family("pard")  # ref_keys 8192
    t = logn_scaling_table(300_000, prof)
    assert t.dtype == torch.float32 and t.shape == (300_000,)
    assert t[:8192].eq(1.0).all() and t[8192].item() > 1.0  # position 8192 sees 8193 keys
    assert t[16_415].item() == pytest.approx(prof.beta(16_416), abs=1e-6)
    assert t[-1].item() == pytest.approx(math.exp(0.5), abs=1e-6)  # capped (cap near N = 209,140 for PARD)
    assert (t[1:] >= t[:-1]).all()


def test_table_route_equals_multiply_route_on_packed_tokens():
    prof = QueryScaleProfile(ref_keys=64)
    pos = torch.tensor([0, 63, 64, 65, 500, 4000])  # tokens of several sequences, packed
    q = torch.randn(len(pos), 4 * 16, dtype=torch.bfloat16)
    table = logn_scaling_table(4096, prof)
    via_table = (q.float() * table[pos][:, None]).to(q.dtype)
    assert torch.equal(via_table, scale_query(q, pos, prof))


def test_bad_length():
    with pytest.raises(ValueError, match="max_seq_len"):
        logn_scaling_table(0, QueryScaleProfile(ref_keys=64))
