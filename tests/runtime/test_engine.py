"""The greedy speculative loop on the tiny exported pair: lossless, invariants every round, stops, limits."""
import json
import shutil

import numpy as np
import pytest

from runtime.engine import SpecEngine
from runtime.manifest import EngineDirError

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land far away,",
           "import numpy as np\nx = np.arange(10)\n", "What is the capital of France?"]


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return SpecEngine(tiny_engines, device="cpu", check_invariants=True)


def _oracle(engine, prompt_ids, max_new, wrong_at=None):
    """Make the drafter propose the target's own greedy continuation (wrong at slot ``wrong_at`` if given)."""
    ref = engine.generate_target_only(prompt_ids, max_new + engine.drafter.block_size).token_ids
    real_draft = engine.drafter.draft
    vocab = engine.manifest["target"]["vocab_size"]

    def draft(bonus, ctx):
        real_draft(bonus, ctx)  # keep the drafter cache path exercised
        done = engine.target.kv_len - len(prompt_ids) + 1  # tokens emitted so far (kv holds all but the bonus)
        want = (ref[done: done + engine.drafter.block_size - 1] + [0] * 8)[: engine.drafter.block_size - 1]
        if wrong_at is not None:
            want[wrong_at] = (want[wrong_at] + 1) % vocab
        logits = np.zeros((len(want), vocab), np.float32)
        logits[np.arange(len(want)), want] = 1.0
        return logits

    engine.drafter.draft = draft
    return ref


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lossless_against_target_only(engine, prompt):
    ids = engine.tokenizer.encode(prompt)
    spec = engine.generate(ids, 40)
    base = engine.generate_target_only(ids, 40)
    assert spec.token_ids == base.token_ids
    assert len(spec.token_ids) == 40 and spec.finish_reason == "length"
    assert spec.stats.rounds >= 1 and spec.stats.new_tokens == 40


def test_oracle_drafter_accepts_full_blocks(tiny_engines):
    eng = SpecEngine(tiny_engines, device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode(PROMPTS[0])
    ref = _oracle(eng, ids, 30)
    out = eng.generate(ids, 30)
    assert out.token_ids == ref[:30]
    b = eng.drafter.block_size
    assert out.stats.mean_accepted_length == b  # every round accepts all B-1 drafts, then the bonus
    assert out.stats.rounds == -(-(30 - 1) // b)  # 1 token from prefill, then B per round
    assert out.stats.acceptance_per_position[0] == 1.0


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_saboteur_drafter_rejected_at_its_slot(tiny_engines, wrong_at):
    eng = SpecEngine(tiny_engines, device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode(PROMPTS[2])
    ref = _oracle(eng, ids, 25, wrong_at=wrong_at)
    out = eng.generate(ids, 25)
    assert out.token_ids == ref[:25]
    acc = out.stats.acceptance_per_position
    assert all(a == 1.0 for a in acc[:wrong_at]) and acc[wrong_at] == 0.0
    assert out.stats.mean_accepted_length == pytest.approx(1 + wrong_at)


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_exact_and_cache_trimmed(tiny_engines, max_new):
    eng = SpecEngine(tiny_engines, device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode(PROMPTS[1])
    ref = _oracle(eng, ids, max_new)
    out = eng.generate(ids, max_new)
    assert out.token_ids == ref[:max_new] and out.finish_reason == "length"
    assert eng.target.kv_len == len(ids) + max_new - 1


def test_stop_token_inside_accepted_block(tiny_engines):
    eng = SpecEngine(tiny_engines, device="cpu", check_invariants=True)
    block = eng.drafter.block_size
    for prompt in PROMPTS:  # find a prompt whose continuation has a fresh token in the middle of a block
        ids = eng.tokenizer.encode(prompt)
        ref = eng.generate_target_only(ids, 20).token_ids
        at = next((i for i in range(2, 20) if ref[i] not in ref[:i] and i % block), None)
        if at is not None:
            break
    assert at is not None, "no prompt gives a fresh mid-block token on the tiny target"
    ref = _oracle(eng, ids, 20)
    eng.eos_token_ids = {ref[at]}
    out = eng.generate(ids, 20)
    assert out.token_ids == ref[: at + 1] and out.finish_reason == "stop"
    assert eng.target.kv_len == len(ids) + at  # nothing after the stop is kept in the cache


@pytest.mark.parametrize("ids, max_new, match", [([], 4, "empty"), ([1, 2], 0, "max_new_tokens"),
                                                 ([1, 49152], 4, "token ids"), ([1] * 4090, 10, "exceeds")])
def test_bad_requests(engine, ids, max_new, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(ids, max_new)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_engine_dir_checksum_mismatch(tiny_engines, tmp_path):
    eng = _copy(tiny_engines, tmp_path / "e")
    data = eng / "drafter" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EngineDirError, match="checksum mismatch.*drafter/model.onnx.data"):
        SpecEngine(eng)


@pytest.mark.parametrize("edit, match", [("schema", "schema_version"), ("json", "not valid JSON"),
                                         ("section", "missing section"), ("nofile", "missing")])
def test_engine_dir_bad_manifest(tiny_engines, tmp_path, edit, match):
    eng = _copy(tiny_engines, tmp_path / "e")
    mf = eng / "manifest.json"
    m = json.loads(mf.read_text())
    if edit == "schema":
        m["schema_version"] = 99
    elif edit == "section":
        del m["shared_weights"]
    elif edit == "nofile":
        (eng / "target" / "model.onnx.data").unlink()
    mf.write_text("{" if edit == "json" else json.dumps(m))
    with pytest.raises(EngineDirError, match=match):
        SpecEngine(eng)


def test_missing_engine_dir(tmp_path):
    with pytest.raises(EngineDirError, match="no such folder"):
        SpecEngine(tmp_path / "nowhere")
    with pytest.raises(EngineDirError, match="not an engines folder"):
        SpecEngine(tmp_path)


def test_past_drafter_positions_continues_target_only(tiny_engines):
    """When s + B would pass the drafter's max positions, the request finishes target-only, still exact."""
    eng = SpecEngine(tiny_engines, device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode(PROMPTS[4])
    base = eng.generate_target_only(ids, 30)
    eng.drafter.max_positions = len(ids) + 12
    out = eng.generate(ids, 30)
    assert out.token_ids == base.token_ids
    assert 1 <= out.stats.rounds <= 12 and eng.target.kv_len == len(ids) + 29


def test_generate_cli_on_bad_engine_dir(tmp_path):
    from click.testing import CliRunner

    from runtime.generate import main

    r = CliRunner().invoke(main, ["--engine", str(tmp_path), "--max-new-tokens", "8"])
    assert r.exit_code == 1 and "not an engines folder" in r.output and len(r.output.strip().splitlines()) == 1
