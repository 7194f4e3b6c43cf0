"""The server as the ecosystem's clients use it: the ``openai`` SDK for completions, chat, streaming, logprobs and
n > 1; vLLM-named metrics parsed with prometheus_client and checked against the per-request statistics."""
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.async_engine import AsyncEngine
from runtime.engine import SpecEngine
from tests.runtime.test_serve import uvicorn_server

openai = pytest.importorskip("openai")
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def server(tiny_engines):
    engine = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    with uvicorn_server(AsyncEngine(engine, max_running=4, max_waiting=16)) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_sdk_completions_chat_and_streaming(server):
    _, client = server
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if ch.choices)
    assert streamed == c.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True)
        if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content


def test_completion_logprobs_equal_with_speculation_on_and_off(server):
    _, client = server
    runs = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                      extra_body={"speculative": spec}) for spec in (True, False)]
    a, b = (r.choices[0].logprobs for r in runs)
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert len(a.token_logprobs) == runs[0].usage.completion_tokens == len(a.tokens) == len(a.top_logprobs)
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-4)
    assert not np.allclose(a.token_logprobs, 0.0) and all(v <= 0 for v in a.token_logprobs)
    for tok, lp, top in zip(a.tokens, a.token_logprobs, a.top_logprobs):
        assert tok in top and top[tok] == pytest.approx(lp) and lp == pytest.approx(max(top.values()))
        assert 3 <= len(top) <= 4
    assert a.text_offset[0] == 0 and a.text_offset == sorted(a.text_offset)


def test_chat_logprobs_streamed_and_not(server):
    _, client = server
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Count to five."}], max_tokens=10, temperature=0,
              logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    streamed = [e for ch in client.chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_stop_inside_a_block_trims_text_ids_and_logprobs_alike(server):
    _, client = server
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    lp = full.choices[0].logprobs
    cut = next(i for i in range(3, len(lp.tokens)) if lp.tokens[i].strip())  # a stop string in the middle
    stop = lp.tokens[cut].strip()
    short = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                      stop=[stop])
    s = short.choices[0]
    assert s.finish_reason == "stop" and stop not in s.text
    n = short.usage.completion_tokens  # the token that completed the stop string is counted, as OpenAI / vLLM do
    assert len(s.logprobs.tokens) == len(s.logprobs.token_logprobs) == n
    assert s.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=1e-4)
    assert full.choices[0].text.startswith(s.text)


def test_n_choices_seeded_reproducible_and_greedy_copies(server):
    _, client = server
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7)
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # independent samples
    for i in range(3):  # choice i samples with seed + i
        assert client.completions.create(**{**kw, "seed": 7 + i}).choices[0].text == a.choices[i].text
    assert a.usage.completion_tokens == sum(client.completions.create(**{**kw, "seed": 7 + i}).usage.completion_tokens
                                            for i in range(3))
    g = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert g.choices[0].text == g.choices[1].text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0.9, seed=3, n=2, stream=True))
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}


def test_vllm_named_metrics_match_the_requests(tiny_engines):
    import httpx

    engine = SpecEngine.from_dir(tiny_engines, device="cpu")
    with uvicorn_server(AsyncEngine(engine, max_running=4, max_waiting=4)) as url:
        stats = []
        for prompt in (PROMPT, "def add(a, b):", "The capital of France"):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "temperature": 0,
                                                         "spec_stats": True}, timeout=60).json()
            stats.append(r["sharpdraft"])
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}

    def total(name, **labels):
        return sum(s.value for s in families[name].samples
                   if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items()))

    assert total("vllm:spec_decode_num_drafts", model_name="tiny") == sum(s["rounds"] for s in stats) > 0
    assert total("vllm:spec_decode_num_accepted_tokens") == sum(s["accepted_draft_tokens"] for s in stats)
    assert total("vllm:spec_decode_num_draft_tokens") == sum(s["drafted_tokens"] for s in stats)
    for j in range(3):
        assert total("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(j)) == \
            sum(s["accepted_per_position"][j] for s in stats)
    assert total("vllm:request_success", finished_reason="length") + total("vllm:request_success",
                                                                           finished_reason="stop") == 3
    assert total("vllm:generation_tokens") > 0


def test_echo_logprobs_score_the_prompt_as_generation_scored_it(server):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0): the prompt's token logprobs equal the
    logprobs those tokens had when the server generated them (greedy), within 1e-4."""
    _, client = server
    gen = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    text = gen.choices[0].text
    scored = client.completions.create(model="tiny", prompt=PROMPT + text, max_tokens=0, temperature=0, logprobs=1,
                                       echo=True)
    c = scored.choices[0]
    assert c.text == PROMPT + text and scored.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    n = len(gen.choices[0].logprobs.token_logprobs)
    if "".join(lp.tokens[-n:]) == text:  # the joined text re-tokenised the same way (the usual case)
        np.testing.assert_allclose(lp.token_logprobs[-n:], gen.choices[0].logprobs.token_logprobs, atol=1e-4)
    both = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, echo=True)
    b = both.choices[0].logprobs
    assert len(b.tokens) == both.usage.prompt_tokens + both.usage.completion_tokens
    assert b.token_logprobs[0] is None and both.choices[0].text.startswith(PROMPT)
