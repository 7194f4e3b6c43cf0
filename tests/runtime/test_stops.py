"""Stop strings and stop ids applied token by token (runtime/stops.py) with the real SmolLM2 tokenizer."""
import pytest

from runtime.sampling import SamplingParams
from runtime.stops import StopChecker


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("stop", ["\n\n", "world", "lo wo", "!"])
def test_stop_string_found_inside_a_block(tokenizer, stop):
    ids = _ids(tokenizer, "Hello world!\n\nAnd more text after it.")
    chk = StopChecker(SamplingParams(max_new_tokens=100, stop=(stop,)), frozenset({2}), tokenizer)
    out = []
    assert chk.extend(out, ids) == "stop"  # one call = one accepted block holding the whole text
    text = tokenizer.decode(out, skip_special_tokens=True)
    assert stop in text and stop not in tokenizer.decode(out[:-1], skip_special_tokens=True)
    assert chk.text(out) == text[: text.index(stop)]


def test_stop_string_across_blocks_and_multibyte(tokenizer):
    text = "naïve café — 日本語のテキスト END tail"
    ids = _ids(tokenizer, text)
    chk = StopChecker(SamplingParams(max_new_tokens=100, stop=("テキスト",)), frozenset(), tokenizer)
    out = []
    for i in range(0, len(ids), 3):  # blocks of three tokens
        if chk.extend(out, ids[i: i + 3]):
            break
    assert chk.text(out) == "naïve café — 日本語の"


def test_length_and_stop_token_order(tokenizer):
    chk = StopChecker(SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), frozenset({2}), tokenizer)
    out = []
    assert chk.extend(out, [5, 6]) is None and chk.extend(out, [7, 9, 9]) == "length" and out == [5, 6, 7]
    chk = StopChecker(SamplingParams(max_new_tokens=3), frozenset({2}), tokenizer)
    out = []
    assert chk.extend(out, [5, 6, 2, 8]) == "stop" and out == [5, 6, 2]  # stop and length at the same token
