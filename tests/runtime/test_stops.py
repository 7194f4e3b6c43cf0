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


def test_streaming_deltas_hold_split_multibyte_characters(tokenizer):
    from runtime.stops import TextDeltas

    text = "naïve café — 日本語のテキスト 🙂 done"
    ids = _ids(tokenizer, text)
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))  # some token splits a character
    deltas = TextDeltas(tokenizer)
    pieces = [deltas.delta(ids[:i]) for i in range(1, len(ids))] + [deltas.delta(ids, final_text=text)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_streaming_deltas_never_send_a_stop_string_prefix(tokenizer):
    from runtime.stops import TextDeltas

    ids = _ids(tokenizer, "alpha beta gamma delta")
    chk = StopChecker(SamplingParams(max_new_tokens=50, stop=("gamma",)), frozenset(), tokenizer)
    deltas, out, sent = TextDeltas(tokenizer, ("gamma",)), [], []
    for tok in ids:
        if chk.extend(out, [tok]):
            sent.append(deltas.delta(out, final_text=chk.text(out)))
            break
        sent.append(deltas.delta(out))
    assert "".join(sent) == "alpha beta " and chk.text(out) == "alpha beta "
