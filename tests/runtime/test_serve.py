"""POST /v1/completions on the tiny engines (FastAPI TestClient): OpenAI shape, exact usage, 400s that say why."""
import pytest
from fastapi.testclient import TestClient

from runtime.engine import SpecEngine
from runtime.serve import create_app


@pytest.fixture(scope="module")
def client_engine(tiny_engines):
    engine = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    return TestClient(create_app(engine, "tiny")), engine


def test_completion_matches_target_only(client_engine):
    client, engine = client_engine
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 12})
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


def test_unknown_model_is_404(client_engine):
    client, _ = client_engine
    r = client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]


def test_token_id_prompt_and_models(client_engine):
    client, _ = client_engine
    r = client.post("/v1/completions", json={"prompt": [0], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("payload, needle", [
    ({"prompt": "", "max_tokens": 3}, "zero tokens"),
    ({"prompt": [], "max_tokens": 3}, "empty"),
    ({"prompt": [[]], "max_tokens": 3}, "empty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "stream": True}, "stream"),
    ({"prompt": [1, 10**6], "max_tokens": 2}, "token ids"),
    ({"prompt": [1] * 4095, "max_tokens": 5}, "exceeds"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "hi", "top_p": 2}, "top_p"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "n": 2}, "n > 1"),
])
def test_bad_requests_then_good_one(client_engine, payload, needle):
    client, _ = client_engine
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_sampled_request_with_seed_is_reproducible(client_engine):
    client, _ = client_engine
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    a, b = client.post("/v1/completions", json=body).json(), client.post("/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 10


def test_stop_string_cuts_text_and_usage(client_engine):
    client, engine = client_engine
    ids = engine.tokenizer.encode("def add(a, b):")
    ref = engine.generate_target_only(ids, 12).token_ids
    text = engine.tokenizer.decode(ref[:6], skip_special_tokens=True)
    stop = text[-2:].strip() or text[-3:]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "stop": [stop]}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    n = r["usage"]["completion_tokens"]
    assert n <= 6 and stop in engine.tokenizer.decode(ref[:n]) and stop not in engine.tokenizer.decode(ref[:n - 1])
