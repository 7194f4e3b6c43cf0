"""The greedy speculative loop on the tiny exported pair: lossless, invariants every round, stops, limits."""
import copy
import json
import shutil

import numpy as np
import pytest

from runtime.engine import SpecEngine
from runtime.manifest import EngineDirError
from runtime.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land far away,",
           "import numpy as np\nx = np.arange(10)\n", "What is the capital of France?"]


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)


class ReplayDrafter:
    """Wraps the real ORT drafter (its cache path still runs) and replaces its logits with the target's own greedy
    continuation ``ref`` of a prompt of ``prompt_len`` tokens (oracle), wrong at slot ``wrong_at`` (saboteur)."""

    def __init__(self, inner, prompt_len, ref, wrong_at=None):
        self.inner, self.prompt_len, self.ref, self.wrong_at = inner, prompt_len, ref, wrong_at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, caches, bonus_tokens, contexts, **kw):
        logits = self.inner.draft(caches, bonus_tokens, contexts, **kw)
        k = logits.shape[1]
        for r, cache in enumerate(caches):
            done = cache.length - self.prompt_len + 1  # tokens emitted so far: the cache covers all but the bonus
            want = (self.ref[done: done + k] + [0] * k)[:k]
            if self.wrong_at is not None and self.wrong_at < k:  # the last rounds may verify fewer slots
                want[self.wrong_at] = (want[self.wrong_at] + 1) % logits.shape[2]
            logits[r] = 0.0
            logits[r, np.arange(k), want] = 1.0
        return logits


def _replay(engine, prompt_ids, max_new, wrong_at=None):
    ref = engine.generate_target_only(prompt_ids, max_new + engine.drafter.block_size).token_ids
    engine.drafter = ReplayDrafter(engine.drafter, len(prompt_ids), ref, wrong_at)
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
    eng = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode(PROMPTS[0])
    ref = _replay(eng, ids, 30)
    out = eng.generate(ids, 30)
    assert out.token_ids == ref[:30]
    b = eng.drafter.block_size
    # 1 token from prefill, 7 full rounds of B = 4 (MAL exactly B), then 1 token left: a plain target step
    assert out.stats.mean_accepted_length == b and out.stats.rounds == (30 - 1) // b
    assert out.stats.acceptance_per_position == [1.0] * (b - 1)


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_saboteur_drafter_rejected_at_its_slot(tiny_engines, wrong_at):
    eng = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    ids = eng.tokenizer.encode(PROMPTS[2])
    ref = _replay(eng, ids, 25, wrong_at=wrong_at)
    out = eng.generate(ids, 25)
    assert out.token_ids == ref[:25]
    acc = out.stats.acceptance_per_position
    assert all(a == 1.0 for a in acc[:wrong_at]) and acc[wrong_at] == 0.0


def test_stop_token_inside_accepted_block(tiny_engines):
    eng = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    block = eng.drafter.block_size
    for prompt in PROMPTS:  # find a prompt whose continuation has a fresh token in the middle of a block
        ids = eng.tokenizer.encode(prompt)
        ref = eng.generate_target_only(ids, 20).token_ids
        at = next((i for i in range(2, 20) if ref[i] not in ref[:i] and i % block), None)
        if at is not None:
            break
    assert at is not None, "no prompt gives a fresh mid-block token on the tiny target"
    ref = _replay(eng, ids, 20)
    eng = eng.with_options(eos_token_ids=frozenset({ref[at]}))  # the same backends, that token as eos
    out = eng.generate(ids, 20)
    assert out.token_ids == ref[: at + 1] and out.finish_reason == "stop"
    assert not eng.sequences  # finished: its caches were released


def test_case3_greedy_and_sampled_rows_share_a_batch(engine):
    """A at temperature 0 with top_p 0.9, B at 0.8: A equals its solo greedy run; nothing is NaN/inf."""
    a_ids, b_ids = engine.tokenizer.encode(PROMPTS[0]), engine.tokenizer.encode(PROMPTS[3])
    solo = engine.generate(a_ids, 24).token_ids
    seen = []
    forward = engine.target.forward

    def checked(caches, tokens):
        logits, taps = forward(caches, tokens)
        seen.append(bool(np.isfinite(logits).all() and np.isfinite(taps).all()))
        return logits, taps

    engine.target.forward = checked
    try:
        a, b = engine.generate_batch([(a_ids, SamplingParams(max_new_tokens=24, temperature=0.0, top_p=0.9)),
                                      (b_ids, SamplingParams(max_new_tokens=24, temperature=0.8, seed=3))])
    finally:
        del engine.target.forward
    assert a.token_ids == solo and len(b.token_ids) == 24 and all(seen)
    for t in (1e-6, 1e-5):  # below and at the greedy epsilon: both give the greedy tokens, no overflow
        out = engine.generate(a_ids, params=SamplingParams(max_new_tokens=24, temperature=t, seed=0))
        assert out.token_ids == solo


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_case7_batch_of_three_draft_counts(engine, temperature):
    """4, 1 and 0 draft tokens per round in one batch: each row equals its solo run; identical requests agree."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = [SamplingParams(max_new_tokens=20, temperature=temperature, seed=11, num_draft_tokens=k)
              for k in (3, 1, 0)]  # the tiny drafter's block is 4: 3 draft tokens is its maximum
    solo = [engine.generate(p, params=q).token_ids for p, q in zip(prompts, params)]
    batch = engine.generate_batch(list(zip(prompts, params)))
    assert [r.token_ids for r in batch] == solo
    twins = engine.generate_batch([(prompts[0], params[0]), (prompts[0], params[0])])
    assert twins[0].token_ids == twins[1].token_ids == solo[0]
    if temperature == 0:
        assert solo[2] == engine.generate_target_only(prompts[2], 20).token_ids


def test_case8_prompt_near_drafter_limit_continues_target_only(tiny_engines):
    """Drafter max positions 256, prompt of 250 tokens, max_new_tokens 50: completes, equals target-only greedy."""
    eng = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    eng.drafter.max_positions = 256
    ids = (eng.tokenizer.encode(" ".join(PROMPTS)) * 20)[:250]
    base = eng.generate_target_only(ids, 50)
    out = eng.generate(ids, 50)
    assert out.token_ids == base.token_ids and out.stats.rounds <= 3  # blocks fit up to s = 252
    nxt = eng.tokenizer.encode(PROMPTS[1])
    assert eng.generate(nxt, 10).token_ids == eng.generate_target_only(nxt, 10).token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_case9_padded_drafter_vocabulary(tiny_engines, temperature):
    """Drafter vocabulary 49152 + 128 padding rows with a large bias on a padding row: never proposed."""
    from tests.runtime.scripted import PaddedVocabDrafter

    eng = SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True)
    eng.drafter = PaddedVocabDrafter(eng.drafter, pad=128, bias_row=49152 + 77)
    seen = []
    forward = eng.target.forward
    eng.target.forward = lambda caches, tokens: (seen.extend(t for row in tokens for t in row),
                                                 forward(caches, tokens))[1]
    ids = eng.tokenizer.encode(PROMPTS[4])
    out = eng.generate(ids, params=SamplingParams(max_new_tokens=30, temperature=temperature, seed=2))
    assert len(out.token_ids) == 30 and max(seen) < 49152
    if temperature == 0:
        assert out.token_ids == eng.generate_target_only(ids, 30).token_ids


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
        SpecEngine.from_dir(eng)


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
        SpecEngine.from_dir(eng)


def test_missing_engine_dir(tmp_path):
    with pytest.raises(EngineDirError, match="no such folder"):
        SpecEngine.from_dir(tmp_path / "nowhere")
    with pytest.raises(EngineDirError, match="not an engines folder"):
        SpecEngine.from_dir(tmp_path)


def test_generate_cli_on_bad_engine_dir(tmp_path):
    from click.testing import CliRunner

    from runtime.generate import main

    r = CliRunner().invoke(main, ["--engine", str(tmp_path), "--max-new-tokens", "8"])
    assert r.exit_code == 1 and "not an engines folder" in r.output and len(r.output.strip().splitlines()) == 1


def test_ragged_draft_call_equals_solo_calls(engine):
    """One drafter call over rows of different cache and context lengths equals each row drafted alone (the
    in-graph beta reads each row's N from the mask), and every row's cache ends exactly at its own length."""
    assert engine.drafter.batched
    rows = []
    for i, prompt in enumerate(PROMPTS[:3]):
        ids = engine.tokenizer.encode(prompt)
        tc, dc = engine.target.new_cache(), engine.drafter.new_cache()
        _, feats = engine.target.forward([tc], [ids])
        split = 1 + i * 2  # different cached / pending splits per row
        engine.drafter.draft([dc], [ids[split - 1]], [feats[0, :split]])
        rows.append((dc, ids[-1], feats[0, split:]))
    solo = []
    for dc, bonus, ctx in rows:
        solo.append(engine.drafter.draft([copy.deepcopy(dc)], [bonus], [ctx])[0])
    lengths = [dc.length + ctx.shape[0] for dc, _, ctx in rows]
    batched = engine.drafter.draft([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    np.testing.assert_allclose(batched, np.stack(solo), atol=1e-4, rtol=1e-4)
    assert [dc.length for dc, _, _ in rows] == lengths


def test_query_scale_switch_per_row(engine):
    """One drafter call: a row with the scale off equals the frozen drafter; the row beside it keeps beta(N)."""
    assert engine.drafter.query_scale_switch
    ids = (engine.tokenizer.encode(" ".join(PROMPTS)) * 8)[:300]  # N > ref_keys (64): beta is well above 1
    tc = engine.target.new_cache()
    _, feats = engine.target.forward([tc], [ids])

    def draft(flags):
        caches = [engine.drafter.new_cache() for _ in flags]
        return engine.drafter.draft(caches, [ids[-1]] * len(flags), [feats[0]] * len(flags), query_scale=flags)

    on, off = draft([True])[0], draft([False])[0]
    mixed = draft([False, True])
    assert np.abs(on - off).max() > 1e-2  # the scale changes the logits at N = 300 + 4
    np.testing.assert_allclose(mixed[0], off, atol=1e-4)
    np.testing.assert_allclose(mixed[1], on, atol=1e-4)


def test_query_scale_off_request_runs_lossless(engine):
    ids = engine.tokenizer.encode(PROMPTS[2])
    out = engine.generate(ids, params=SamplingParams(max_new_tokens=20, query_scale=False))
    assert out.token_ids == engine.generate_target_only(ids, 20).token_ids


def test_generate_rotates_configurations_and_reports_the_median_run():
    from types import SimpleNamespace

    from runtime.benchmarking import rotated_runs

    order, speeds = [], {"base": iter([10.0, 30.0, 20.0]), "spec": iter([5.0, 7.0, 6.0]), "plain": iter([1.0] * 3)}

    def run(name):
        def go():
            order.append(name)
            return SimpleNamespace(name=name, stats=SimpleNamespace(tokens_per_s=next(speeds[name])))
        return go

    out = rotated_runs({n: run(n) for n in ("base", "spec", "plain")}, 3)
    assert order == ["base", "spec", "plain", "spec", "plain", "base", "plain", "base", "spec"]
    assert out["base"].stats.tokens_per_s == 20.0 and out["spec"].stats.tokens_per_s == 6.0
    assert [r.stats.tokens_per_s for r in out["all"]["base"]] == [10.0, 30.0, 20.0]
    speeds["base"] = iter([4.0, 2.0])
    two = rotated_runs({"base": run("base")}, 2)  # even count: the lower middle run
    assert two["base"].stats.tokens_per_s == 2.0 and len(two["all"]["base"]) == 2
