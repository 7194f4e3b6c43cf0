"""runtime/benchmarking.py: the rotated run order and the geo-mean of ratios every benchmark reports."""
import pytest

from runtime.benchmarking import geomean_ratio, rotated, rotations


def test_rotated_order():
    assert rotated("abc", 0) == list("abc") and rotated("abc", 1) == list("bca") and rotated("abc", 4) == list("bca")
    assert rotated([], 3) == []
    # over len(items) consecutive shifts every item runs first once
    assert sorted(rotated("abcd", i)[0] for i in range(4)) == list("abcd")
    assert rotations(list("abc"), 3) == [list("abc"), list("bca"), list("cab")]


def test_geomean_ratio():
    assert geomean_ratio([(2.0, 1.0), (1.0, 2.0)]) == pytest.approx(1.0)
    assert geomean_ratio(((x * 1.5, x) for x in (1.0, 3.0, 7.0))) == pytest.approx(1.5)
