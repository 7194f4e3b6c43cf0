"""The OpenAI-compatible server on the tiny engines: shapes, exact usage, streaming fidelity, continuous batching,
the queue limit, client disconnects, validation (400s that say why) and /metrics."""
import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from runtime.async_engine import AsyncEngine, QueueFull
from runtime.engine import SpecEngine
from runtime.sampling import SamplingParams
from runtime.serve import create_app, serve_in_thread, wait_healthy

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)


@pytest.fixture(scope="module")
def client(tiny_engines):
    """A server with its own engine (one worker per engine; ``engine`` is for references and the other apps)."""
    own = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    app = create_app(AsyncEngine(own, max_running=4, max_waiting=8), "tiny")
    with TestClient(app) as c:
        yield c


def _sse(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:])
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def test_completion_matches_target_only(client, engine):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 12,
                                             "spec_stats": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = engine.tokenizer.encode("def add(a, b):")
    ref = engine.generate_target_only(ids, 12)
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["finish_reason"] == ref.finish_reason
    assert choice["text"] == engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref.token_ids),
                             "total_tokens": len(ids) + len(ref.token_ids)}
    assert body["sharpdraft"]["rounds"] >= 1


def test_chat_completion_uses_chat_template(client, engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, **GREEDY})
    assert r.status_code == 200, r.text
    ids = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = engine.generate_target_only(ids, 10)
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(ref.token_ids)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("extra", [GREEDY, {"temperature": 0.9, "seed": 5}, {**GREEDY, "stop": [" the", "\n"]}])
def test_streaming_deltas_equal_non_streaming(client, endpoint, extra):
    if endpoint == "chat":
        url, payload = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]}
    else:
        url, payload = "/v1/completions", {"prompt": "Once upon a time, in a land far away,"}
    payload = {**payload, "max_tokens": 40, **extra}
    whole = client.post(url, json=payload).json()
    with client.stream("POST", url, json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r.iter_lines())
    usage = chunks[-1]["usage"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if endpoint == "chat":
        text = "".join(c["delta"].get("content", "") for c in choices)
        expect = whole["choices"][0]["message"]["content"]
        assert choices[0]["delta"]["role"] == "assistant"
    else:
        text = "".join(c["text"] for c in choices)
        expect = whole["choices"][0]["text"]
    assert text == expect
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == [whole["choices"][0]["finish_reason"]]
    assert usage == whole["usage"]


def test_speculation_off_per_request_gives_same_greedy_text(client):
    body = {"prompt": "import numpy as np\n", "max_tokens": 20, "spec_stats": True, **GREEDY}
    a = client.post("/v1/completions", json=body).json()
    b = client.post("/v1/completions", json={**body, "speculative": False}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and b["sharpdraft"]["rounds"] == 0
    assert b["sharpdraft"]["mean_accepted_length"] is None and b["sharpdraft"]["speculative"] is False


def test_unknown_model_is_404(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]


def test_token_id_prompt_and_models(client):
    r = client.post("/v1/completions", json={"prompt": [0], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("payload, needle", [
    ({"prompt": "", "max_tokens": 3}, "zero tokens"),
    ({"prompt": [], "max_tokens": 3}, "empty"),
    ({"prompt": [[]], "max_tokens": 3}, "empty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 2}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "stream": "yes please"}, "stream"),
    ({"prompt": [1, 10**6], "max_tokens": 2}, "token ids"),
    ({"prompt": [1] * 4095, "max_tokens": 5}, "exceeds"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "logprobs": 2, "echo": True, "stream": True}, "echo with logprobs"),
    ({"prompt": "hi", "max_tokens": 0, "echo": True}, "max_tokens 0 scores the prompt"),
    ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs is a chat field"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "hi", "num_draft_tokens": 50}, "num_draft_tokens"),
])
def test_bad_requests_then_good_one(client, payload, needle):
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("payload, needle", [
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens")])
def test_bad_chat_requests(client, payload, needle):
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_position_limit_errors_name_the_field_the_client_sent(client):
    long = [1] * 4090  # the tiny target has 4096 positions
    r = client.post("/v1/completions", json={"prompt": long})  # max_tokens not sent: the server default applies
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_tokens (16: not sent, the server's default)" in msg
    assert "max_new_tokens" not in msg
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 9})
    assert "max_tokens (9)" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 4090}],
                                                  "max_completion_tokens": 7})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "max_completion_tokens (7)" in msg and "lower max_completion_tokens" in msg


def test_top_logprobs_without_logprobs_is_refused(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "top_logprobs": 3})
    assert r.status_code == 400 and "top_logprobs (3) needs logprobs: true" in r.json()["error"]["message"]


def test_seeded_sampling_is_reproducible(client):
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    a, b = client.post("/v1/completions", json=body).json(), client.post("/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["completion_tokens"] == 10


def test_stop_string_cuts_text_and_usage(client, engine):
    ids = engine.tokenizer.encode("def add(a, b):")
    ref = engine.generate_target_only(ids, 12).token_ids
    text = engine.tokenizer.decode(ref[:6], skip_special_tokens=True)
    stop = text[-2:].strip() or text[-3:]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "stop": [stop], **GREEDY}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    n = r["usage"]["completion_tokens"]
    assert n <= 6 and stop in engine.tokenizer.decode(ref[:n]) and stop not in engine.tokenizer.decode(ref[:n - 1])


def test_metrics_exposition(client):
    client.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 8, **GREEDY})
    text = client.get("/metrics").text
    for name in ("sharpdraft_requests_total", "sharpdraft_generation_tokens_total", "sharpdraft_spec_rounds_total",
                 "sharpdraft_spec_mean_accepted_length", "sharpdraft_spec_accepted_at_position_total",
                 "sharpdraft_request_latency_seconds_bucket", "sharpdraft_time_to_first_token_seconds_bucket",
                 "sharpdraft_engine_step_seconds_bucket", "sharpdraft_requests_waiting",
                 "sharpdraft_requests_running", "sharpdraft_request_draft_seconds_bucket"):
        assert name in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    rounds, accepted = values["sharpdraft_spec_rounds_total"], values["sharpdraft_spec_accepted_draft_tokens_total"]
    assert values["sharpdraft_spec_mean_accepted_length"] == pytest.approx(1 + accepted / rounds)
    assert values['sharpdraft_requests_total{endpoint="completions",status="200"}'] >= 1


# ---------------------------------------------------------------- concurrency (httpx on the ASGI app)
def _run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_steps_and_equal_solo(engine):
    prompts = ["def fibonacci(n):", "The quick brown fox", "Once upon a time,", "import os\n", "What is 2 + 2?"]
    solo = [engine.generate(engine.tokenizer.encode(p), 24).token_ids for p in prompts]
    aeng = AsyncEngine(engine, max_running=8, max_waiting=8)
    app = create_app(aeng, "tiny")

    async def main():
        aeng.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                rs = await asyncio.gather(*[c.post("/v1/completions", json={"prompt": p, "max_tokens": 24,
                                                                             **GREEDY}) for p in prompts])
                metrics = (await c.get("/metrics")).text
        finally:
            aeng.shutdown()
        return rs, metrics

    rs, metrics = _run(main())
    texts = [r.json()["choices"][0]["text"] for r in rs]
    assert texts == [engine.tokenizer.decode(s, skip_special_tokens=True) for s in solo]
    rows = [line for line in metrics.splitlines() if line.startswith("sharpdraft_engine_step_rows_bucket")]
    le1 = next(float(x.split(" ")[1]) for x in rows if 'le="1.0"' in x)
    total = next(float(x.split(" ")[1]) for x in rows if 'le="+Inf"' in x)
    assert total > le1  # some steps advanced several requests at once


def test_queue_full_answers_429_with_retry_after(engine):
    aeng = AsyncEngine(engine, max_running=1, max_waiting=0)
    app = create_app(aeng, "tiny")

    async def main():
        aeng.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 200,
                                                                            **GREEDY}))
                while aeng.num_running == 0:
                    await asyncio.sleep(0.01)
                second = await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
                ok = await first
                third = await c.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
        finally:
            aeng.shutdown()
        return second, ok, third

    second, ok, third = _run(main())
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert "capacity" in second.json()["error"]["message"]
    assert ok.status_code == 200 and third.status_code == 200


def test_second_worker_on_one_engine_is_refused(engine):
    a, b = AsyncEngine(engine), AsyncEngine(engine)
    a.start()
    try:
        with pytest.raises(RuntimeError, match="already driven"):
            b.start()
    finally:
        a.shutdown()


def test_abort_frees_slot_and_others_continue(engine):
    """Engine level: aborting one running request frees its slot and caches; the other equals its solo run."""
    a_ids, b_ids = engine.tokenizer.encode("The quick brown fox"), engine.tokenizer.encode("def f(x):")
    solo = engine.generate(b_ids, 30).token_ids
    aeng = AsyncEngine(engine, max_running=4, max_waiting=0)

    async def main():
        aeng.start()
        try:
            a = aeng.submit(a_ids, SamplingParams(max_new_tokens=200))
            b = aeng.submit(b_ids, SamplingParams(max_new_tokens=30))
            await a.next_event()
            a.abort()
            result = None
            async for event in b:
                result = event.result or result
            for _ in range(100):
                if not engine.sequences:
                    break
                await asyncio.sleep(0.01)
            assert not engine.sequences  # the aborted row is gone (b finished too)
            with pytest.raises(QueueFull):  # capacity is back to 4 running; fill it and one more is refused
                for _ in range(5):
                    aeng.submit([1], SamplingParams(max_new_tokens=1))
            return result
        finally:
            aeng.shutdown()

    result = _run(main())
    assert result.token_ids == solo


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uvicorn_server(aeng: AsyncEngine, log_level: str = "warning"):
    """A real uvicorn server on a free loopback port around ``aeng`` (its own thread); yields the base URL."""
    return serve_in_thread(aeng, "tiny", log_level=log_level)


def test_client_disconnect_mid_stream_frees_the_slot(engine):
    """A real uvicorn server: a streaming client hangs up after its first chunk; the request is aborted at once
    (counted in /metrics, engine batch empty) and the next request is served."""
    aeng = AsyncEngine(engine, max_running=2, max_waiting=0)
    with uvicorn_server(aeng) as url:
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, **GREEDY}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # hang up
        for _ in range(200):
            if aeng.num_running == 0:
                break
            time.sleep(0.05)
        assert aeng.num_running == 0
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200
        metrics = httpx.get(url + "/metrics").text
        assert 'sharpdraft_requests_aborted_total{endpoint="completions"} 1.0' in metrics


def test_query_scale_off_per_request(client):
    body = {"prompt": "import numpy as np\n", "max_tokens": 16, "spec_stats": True, **GREEDY}
    a = client.post("/v1/completions", json=body).json()
    b = client.post("/v1/completions", json={**body, "query_scale": False}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # greedy stays lossless either way
    assert a["sharpdraft"]["query_scale"] is True and b["sharpdraft"]["query_scale"] is False
    for bad in ("maybe", "no", 0):
        assert client.post("/v1/completions", json={**body, "query_scale": bad}).status_code == 400


def test_errors_are_openai_shaped_and_counted_per_endpoint(client):
    def count(endpoint, status):
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(f'sharpdraft_requests_total{{endpoint="{endpoint}",status="{status}"}}'):
                return float(line.split()[1])
        return 0.0

    before = count("chat", 400), count("chat", 404), count("completions", 400)
    assert client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2}).status_code == 400
    assert client.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "a"}]}
                       ).status_code == 404
    assert client.post("/v1/completions", json={"prompt": "hi", "n": 30}).status_code == 400
    assert (count("chat", 400), count("chat", 404), count("completions", 400)) == tuple(b + 1 for b in before)
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_client_disconnect_mid_generation_non_streaming_frees_the_slot(engine):
    """A real uvicorn server: a NON-streaming client gives up (read timeout) while its long request runs; the
    request is aborted within a poll interval or two (slot and caches freed, counted), and the next request's
    output equals its solo target-only run."""
    ref = engine.generate_target_only(engine.tokenizer.encode("def add(a, b):"), 12)  # before the worker owns it
    aeng = AsyncEngine(engine, max_running=1, max_waiting=0)
    with uvicorn_server(aeng) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client hangs up after 1 s; generation would take far longer
            httpx.post(url + "/v1/completions", timeout=httpx.Timeout(30, read=1.0),
                       json={"prompt": "Once upon a time", "max_tokens": 3500, "ignore_eos": True, **GREEDY})
        t0 = time.monotonic()
        while aeng.num_running and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert aeng.num_running == 0 and not engine.sequences, "the abandoned request kept its slot"
        assert time.monotonic() - t0 < 2.0
        ok = httpx.post(url + "/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 12, **GREEDY},
                        timeout=30)
        assert ok.status_code == 200  # max_running 1: the slot really came back
        assert ok.json()["choices"][0]["text"] == engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        metrics = httpx.get(url + "/metrics").text
        assert 'sharpdraft_requests_aborted_total{endpoint="completions"} 1.0' in metrics
