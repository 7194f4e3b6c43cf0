"""runtime/ragged.py: the documented worked examples, and the layout against a row-by-row construction."""
import numpy as np
import pytest

from runtime.ragged import attention_mask, dflash_block, positions, rows_after_past


def test_worked_examples_of_the_module_docstring():
    r = rows_after_past([3, 1], [[7, 8], [9]], 3)
    assert r.input_ids.tolist() == [[7, 8], [9, 9]]
    assert r.position_ids.tolist() == [[3, 4], [1, 2]]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 1, 0]]
    pos, mask = dflash_block([2, 0], [1, 2], 2, 2)
    assert pos.tolist() == [[2, 3, 3, 4], [0, 1, 2, 3]]
    assert mask.tolist() == [[1, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1]]


@pytest.mark.parametrize("seed", range(5))
def test_rows_after_past_equals_a_row_by_row_construction(seed):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 6))
    past = rng.integers(0, 9, b).tolist()
    rows = [rng.integers(0, 100, int(rng.integers(1, 5))).tolist() for _ in range(b)]
    width = max(map(len, rows)) + int(rng.integers(0, 3))
    visible = [min(width, len(r) + int(rng.integers(0, 2))) for r in rows]
    l_max, max_pos = max(past) + int(rng.integers(0, 2)), 10
    got = rows_after_past(past, rows, l_max, width=width, pad_id=-1, visible=visible, max_positions=max_pos)
    for r in range(b):
        ids = rows[r] + [-1] * (width - len(rows[r]))
        assert got.input_ids[r].tolist() == ids
        assert got.position_ids[r].tolist() == [min(past[r] + j, max_pos - 1) for j in range(width)]
        mask = [int(j < past[r]) for j in range(l_max)] + [int(j < visible[r]) for j in range(width)]
        assert got.attention_mask[r].tolist() == mask
    assert got.attention_mask.dtype == got.input_ids.dtype == got.position_ids.dtype == np.int64


def test_refusals():
    with pytest.raises(ValueError, match="at least one token"):
        rows_after_past([0], [[]], 0)
    with pytest.raises(ValueError, match="does not fit 1 slots"):
        rows_after_past([0], [[1, 2]], 0, width=1)
    with pytest.raises(ValueError, match="do not fit"):
        attention_mask([4], [1], 3, 2)
    assert positions([5], 3, max_positions=6).tolist() == [[5, 5, 5]]
