"""A REAL tritonserver (the nvidia-pytriton wheel's binary, CPU) serving the tiny engines through the model
repository that runtime/triton_repo.py writes; queried over gRPC streaming with tritonclient.

Needs .venv-triton (scripts/setup_triton.sh; scripts/test.sh runs it). Without it the tests skip and say so.
"""
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.engine import SpecEngine
from runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TRITON_PY = ROOT / ".venv-triton" / "bin" / "python"
STUB = ROOT / ".venv-triton" / "triton-backends" / "python" / "triton_python_backend_stub"

pytestmark = pytest.mark.skipif(not (TRITON_PY.exists() and STUB.exists()),
                                reason=".venv-triton missing: run bash scripts/setup_triton.sh (scripts/test.sh does)")


def _ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def triton(tiny_engines, tmp_path_factory):
    from runtime.triton_repo import write_model_repository

    site = subprocess.run([str(TRITON_PY), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    repo = tmp_path_factory.mktemp("triton_repo")
    write_model_repository(tiny_engines, repo, max_running=4, max_waiting=4, python_path=[str(ROOT), site])
    http, grpc, metrics = _ports(3)
    log = open(repo / "tritonserver.log", "w")
    proc = subprocess.Popen([str(TRITON_PY), str(ROOT / "scripts" / "triton_serve.py"), "--model-repository",
                             str(repo), "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                             str(metrics)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"http://127.0.0.1:{http}/v2/models/sharpdraft/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("tritonserver did not get ready")
        if proc.poll() is not None:
            pytest.fail("tritonserver exited:\n" + (repo / "tritonserver.log").read_text()[-4000:])
        yield f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _client(url, *args, rc=0):
    r = subprocess.run([str(TRITON_PY), str(ROOT / "scripts" / "triton_client.py"), "--url", url, *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == rc, r.stderr[-3000:]  # 2: the server answered with an error
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return SpecEngine.from_dir(tiny_engines, device="cpu")


def test_config_is_decoupled_with_llmapi_names(tiny_engines, tmp_path):
    from runtime.triton_repo import write_model_repository

    model = write_model_repository(tiny_engines, tmp_path / "repo")
    text = (model / "config.pbtxt").read_text()
    assert "decoupled: true" in text and 'backend: "python"' in text and "KIND_CPU" in text
    for name in ("text_input", "streaming", "sampling_param_temperature", "sampling_param_max_tokens",
                 "text_output", "finish_reason", "acceptance_rate", "total_accepted_draft_tokens"):
        assert f'name: "{name}"' in text
    assert (model / "1" / "model.py").is_file()


def test_non_streaming_equals_engine_greedy(triton, engine):
    grpc_url, _ = triton
    prompt = "def fibonacci(n):"
    out = _client(grpc_url, "--prompt", prompt, "--max-tokens", "24")
    ref = engine.generate(engine.tokenizer.encode(prompt), params=SamplingParams(max_new_tokens=24))
    assert out["error"] is None and len(out["responses"]) == 1
    assert out["text"] == ref.text and out["finish_reason"] == ref.finish_reason
    assert out["completion_tokens"] == len(ref.token_ids) and out["total_draft_tokens"] > 0
    assert out["mean_accepted_length"] >= 1.0


def test_streaming_deltas_concatenate_to_the_text(triton):
    grpc_url, _ = triton
    args = ["--prompt", "Once upon a time, in a land far away,", "--max-tokens", "40"]
    whole = _client(grpc_url, *args)
    streamed = _client(grpc_url, *args, "--streaming")
    assert len(streamed["responses"]) > 2 and streamed["text"] == whole["text"]
    assert streamed["finish_reason"] == whole["finish_reason"]


def test_bad_request_is_an_error_and_the_next_one_works(triton):
    grpc_url, _ = triton
    bad = _client(grpc_url, "--prompt", "hi", "--temperature", "-1", rc=2)
    assert bad["error"] is not None and "sampling_param_temperature" in bad["error"]
    assert _client(grpc_url, "--prompt", "hi", "--max-tokens", "4")["completion_tokens"] == 4


def test_cancelled_stream_then_server_still_serves(triton):
    grpc_url, _ = triton
    out = _client(grpc_url, "--prompt", "Tell me everything", "--max-tokens", "3000", "--streaming",
                  "--cancel-after", "2")
    assert out["cancelled"]
    t0 = time.perf_counter()
    again = _client(grpc_url, "--prompt", "hi", "--max-tokens", "4")
    assert again["completion_tokens"] == 4 and time.perf_counter() - t0 < 120
