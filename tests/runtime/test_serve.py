"""POST /v1/completions on the tiny engines (FastAPI TestClient): OpenAI shape, exact usage, 400s that say why."""
import pytest
from fastapi.testclient import TestClient

from runtime.engine import SpecEngine
from runtime.serve import create_app


@pytest.fixture(scope="module")
def client_engine(tiny_engines):
    engine = SpecEngine(tiny_engines, device="cpu", check_invariants=True)
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
    shown = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
    assert choice["text"] == engine.tokenizer.decode(shown)
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
    ({"prompt": "hi", "temperature": 0.7}, "temperature 0"),
    ({"prompt": "hi", "stream": True}, "stream"),
    ({"prompt": [1, 10**6], "max_tokens": 2}, "token ids"),
    ({"prompt": [1] * 4095, "max_tokens": 5}, "exceeds"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "hi", "top_p": 2}, "top_p"),
    ({"prompt": "hi", "stop": ["\n"]}, "stop"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "n": 2}, "n > 1"),
])
def test_bad_requests_then_good_one(client_engine, payload, needle):
    client, _ = client_engine
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
