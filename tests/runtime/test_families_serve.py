"""The OpenAI server works on PARD and EAGLE-3 engines folders like on DFlash ones (same code path)."""
import pytest
from fastapi.testclient import TestClient

from runtime.async_engine import AsyncEngine
from runtime.engine import SpecEngine
from runtime.serve import create_app


@pytest.mark.parametrize("fixture", ["tiny_pard_engines", "tiny_eagle3_engines"])
def test_completion_and_stream_match_target_only(request, fixture):
    engines = request.getfixturevalue(fixture)
    ref_engine = SpecEngine.from_dir(engines, device="cpu")
    app = create_app(AsyncEngine(SpecEngine.from_dir(engines, device="cpu", check_invariants=True)), "tiny")
    prompt = "def add(a, b):"
    ids = ref_engine.tokenizer.encode(prompt)
    ref = ref_engine.generate_target_only(ids, 16)
    text = ref_engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0, "spec_stats": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
        assert r.json()["sharpdraft"]["rounds"] >= 1
        off = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0, "query_scale": False})
        assert off.status_code == 200 and off.json()["choices"][0]["text"] == text
