"""Faults found by trying the server as a user would (docs/faults.md, second round): logprobs of tokens that top-k /
top-p cut, text that is not valid Unicode, seeds at the edges of the 64-bit range, null message content, and seeded
sampling that must not depend on the rows beside a request. Each test failed before its fix."""
import json
import math

import numpy as np
import pytest

from runtime.async_engine import AsyncEngine
from runtime.engine import SpecEngine
from runtime.sampling import LOGPROB_FLOOR, SEED_MAX, SEED_MIN, SamplingParams, choice_seed, token_logprob
from runtime.serve import create_app
from tests.runtime.test_serve import uvicorn_server

PROMPT = "Here is a list of fruits:"


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity (Python's json accepts them; JSON and the OpenAI SDKs' peers do not)."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def client(tiny_engines):
    from fastapi.testclient import TestClient

    engine = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    with TestClient(create_app(AsyncEngine(engine, max_running=4, max_waiting=8), "tiny")) as c:
        yield c


# ---------------------------------------------------------------- logprobs: finite on the wire
def test_token_logprob_leaves_cut_tokens_out_and_floors_the_token_itself():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0], np.float32)
    p = SamplingParams(temperature=1.0, top_k=2, logprobs=4)
    lp = token_logprob(logits, 0, p)
    assert [i for i, _ in lp.top] == [0, 1] and all(math.isfinite(v) for _, v in lp.top)
    cut = token_logprob(logits, 3, p)  # a prompt token outside the top-k (echo + logprobs scores such tokens)
    assert cut.logprob == LOGPROB_FLOOR and [i for i, _ in cut.top] == [0, 1]
    greedy = token_logprob(logits, 3, SamplingParams(temperature=0.0, logprobs=4))  # raw: every value finite
    assert len(greedy.top) == 4 and math.isfinite(greedy.logprob) and greedy.logprob > LOGPROB_FLOOR


@pytest.mark.parametrize("sampling", [{"top_k": 2}, {"top_p": 0.05}])
def test_completions_logprobs_with_top_k_or_top_p_are_json_streamed_or_not(client, sampling):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "logprobs": 5, "seed": 3, **sampling}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = _strict_json(r.text)["choices"][0]["logprobs"]
    assert all(math.isfinite(v) and v <= 0 for v in lp["token_logprobs"])
    for top in lp["top_logprobs"]:
        assert 1 <= len(top) <= 5 and all(math.isfinite(v) for v in top.values())
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [_strict_json(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and
                  line != "data: [DONE]"]
    streamed = [v for c in chunks for ch in c["choices"] if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_prompt_logprobs_of_cut_tokens_are_the_floor(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3,
                                             "temperature": 0.5, "top_k": 1})
    assert r.status_code == 200, r.text
    values = _strict_json(r.text)["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert LOGPROB_FLOOR in values and all(v == 0.0 or v == LOGPROB_FLOOR for v in values)


def test_openai_sdk_reads_top_k_and_top_p_logprobs(tiny_engines):
    openai = pytest.importorskip("openai")
    engine = SpecEngine.from_dir(tiny_engines, device="cpu")
    with uvicorn_server(AsyncEngine(engine, max_running=2, max_waiting=4)) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, logprobs=3, seed=11,
                  extra_body={"top_k": 3})
        whole = sdk.completions.create(**kw).choices[0].logprobs
        parts = [v for ch in sdk.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                 for v in ch.choices[0].logprobs.token_logprobs]
        assert parts == pytest.approx(whole.token_logprobs, abs=1e-6)
        chat = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                           temperature=0.8, top_p=0.9, logprobs=True, top_logprobs=5, seed=5,
                                           extra_body={"top_k": 2})
        for e in chat.choices[0].logprobs.content:
            assert 1 <= len(e.top_logprobs) <= 2 and math.isfinite(e.logprob)


# ---------------------------------------------------------------- text that is not Unicode; seeds; null content
@pytest.mark.parametrize("endpoint, body, needle", [
    ("/v1/completions", {"prompt": "fruit \ud800 salad"}, "prompt is not valid Unicode"),
    ("/v1/completions", {"prompt": ["\udfff"]}, "prompt is not valid Unicode"),
    ("/v1/completions", {"prompt": "ok", "stop": ["a", "\ud83d"]}, "stop[1] is not valid Unicode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "content is not valid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "content part text is not valid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "needs content"),
    ("/v1/completions", {"prompt": "ok", "seed": 2 ** 70}, "seed"),
    ("/v1/completions", {"prompt": "ok", "seed": -2 ** 63 - 1}, "seed"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_text_seed_and_content_are_400(client, endpoint, body, needle, stream):
    r = client.post(endpoint, content=json.dumps({**body, "max_tokens": 2, "stream": stream}),
                    headers={"content-type": "application/json"})  # json.dumps keeps the lone surrogate as \ud800
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_undecodable_bytes_are_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "caf\xe9", "max_tokens": 2}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text


def test_surrogate_pairs_and_assistant_null_content_are_accepted(client):
    r = client.post("/v1/completions", content=json.dumps({"prompt": "tea \ud83c\udf75", "max_tokens": 2}),
                    headers={"content-type": "application/json"})  # a well-formed pair: U+1F375
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "again"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_seeds_span_the_signed_64_bit_range_and_wrap_for_n():
    assert choice_seed(SEED_MAX, 1) == SEED_MIN and choice_seed(-1, 1) == 0 and choice_seed(None, 3) is None
    for seed in (SEED_MIN, -1, SEED_MAX):
        SamplingParams(temperature=1.0, seed=seed).make_rng()  # valid seeds build a stream
    a = SamplingParams(temperature=1.0, seed=-1).make_rng().random(4)  # the stream of 2**64 - 1 (modulo 2**64)
    assert np.array_equal(a, np.random.Generator(np.random.PCG64(2 ** 64 - 1)).random(4))
    assert not np.array_equal(a, SamplingParams(temperature=1.0, seed=0).make_rng().random(4))
    with pytest.raises(ValueError, match="signed 64-bit"):
        SamplingParams(temperature=1.0, seed=SEED_MAX + 1)


def test_n_choices_at_the_top_seed_equal_their_n1_requests(client):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "speculative": False}
    many = client.post("/v1/completions", json={**body, "seed": SEED_MAX, "n": 2}).json()["choices"]
    for i, seed in enumerate((SEED_MAX, SEED_MIN)):
        one = client.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]
        assert many[i]["text"] == one["text"]


# ---------------------------------------------------------------- the minor items
def test_queue_full_message_counts_what_was_admitted(engine_for_queue):
    """The 429 text said "(1 running, 0 waiting)" while the queue was full: the engine's counts lag the admissions
    just queued. It now counts admissions."""
    import asyncio

    from runtime.async_engine import QueueFull

    aeng = AsyncEngine(engine_for_queue, max_running=1, max_waiting=1)  # worker not started: nothing runs yet

    async def main():
        p = SamplingParams(max_new_tokens=4)
        aeng.submit([1, 2, 3], p)
        aeng.submit([1, 2, 3], p)
        with pytest.raises(QueueFull, match=r"2 of 2 places taken \(1 running \+ 1 waiting\), this request needs 1"):
            aeng.submit([1, 2, 3], p)
        with pytest.raises(QueueFull, match="this request needs 3"):
            aeng.submit_group([1, 2, 3], [p] * 3)

    asyncio.run(main())


@pytest.fixture(scope="module")
def engine_for_queue(tiny_engines):
    return SpecEngine.from_dir(tiny_engines, device="cpu")


def test_missing_tokenizer_folder_is_one_clear_error(tmp_path, tiny_engines):
    import shutil

    from click.testing import CliRunner

    from runtime.generate import main as generate
    from runtime.manifest import EngineDirError

    broken = tmp_path / "engines"
    shutil.copytree(tiny_engines, broken)
    shutil.rmtree(broken / "tokenizer")
    with pytest.raises(EngineDirError, match="the tokenizer folder tokenizer/ is missing"):
        SpecEngine.from_dir(broken)
    r = CliRunner().invoke(generate, ["--engine", str(broken), "--prompt", "hi"])
    assert r.exit_code != 0 and "tokenizer folder tokenizer/ is missing" in r.output
    assert len(r.output.strip().splitlines()) <= 2 and "huggingface" not in r.output.lower(), r.output
