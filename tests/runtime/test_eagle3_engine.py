"""EAGLE-3 through export and the runtime, on the tiny target + a tiny random EAGLE-3 head: manifest and per-row
validation, lossless greedy against target-only, ragged batches equal solo runs, sampled rows keep working, and an
oracle chain (every draft accepted) that exercises the context pass, the chain steps and the cache rewind."""
import numpy as np
import pytest

from runtime.engine import SpecEngine
from runtime.manifest import load_manifest
from runtime.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land far away,",
           "import numpy as np\nx = np.arange(10)\n"]


@pytest.fixture(scope="module")
def engine(tiny_eagle3_engines):
    return SpecEngine.from_dir(tiny_eagle3_engines, device="cpu", check_invariants=True)


def test_manifest_and_per_row_validation(tiny_eagle3_engines):
    m = load_manifest(tiny_eagle3_engines).to_dict()
    assert m["drafter"]["family"] == "eagle3" and m["drafter"]["num_draft_tokens"] == 4
    assert {"drafter", "drafter_fc", "target"} <= set(m["graphs"])
    assert set(m["shared_weights"]) == {"embed_weight"}
    v = m["validation"]["drafter"]
    rows = v["rows"]  # one block, rows at N = ref - 2 .. ref + 2
    assert [r["num_keys"] for r in rows] == [62, 63, 64, 65, 66]
    assert [r["beta"] for r in rows[:3]] == [1.0, 1.0, 1.0] and rows[3]["beta"] > 1.0 and rows[4]["beta"] > rows[3]["beta"]
    assert all(r["frozen_diff"] < r["bound"] for r in rows[:3])  # unscaled rows equal the frozen drafter
    assert all(r["frozen_diff"] > r["max_abs_diff_logits"] for r in rows[3:])  # scaled rows do not
    assert len(v["ragged"]) == 2 and "switched_off" in v
    assert m["validation"]["target"]["max_rel_diff_taps"] < 2e-3  # the 3 tapped layers are exported


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lossless_against_target_only(engine, prompt):
    ids = engine.tokenizer.encode(prompt)
    spec = engine.generate(ids, 30)
    assert spec.token_ids == engine.generate_target_only(ids, 30).token_ids
    assert spec.stats.rounds >= 1


def test_ragged_batch_equals_solo_runs_and_sampling_runs(engine):
    reqs = [(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=n, num_draft_tokens=k))
            for p, n, k in zip(PROMPTS[:3], (25, 12, 30), (4, 2, 3))]
    for (ids, params), got in zip(reqs, engine.generate_batch(reqs)):
        assert got.token_ids == engine.generate_target_only(ids, params.max_new_tokens).token_ids
    sampled = engine.generate(reqs[0][0], params=SamplingParams(max_new_tokens=20, temperature=0.8, seed=5))
    again = engine.generate(reqs[0][0], params=SamplingParams(max_new_tokens=20, temperature=0.8, seed=5))
    assert sampled.token_ids == again.token_ids and len(sampled.token_ids) == 20


class OracleChain:
    """The real ORT EAGLE-3 drafter runs (context pass, chain, rewind); its drafts are replaced by the target's own
    greedy continuation, so every draft is accepted."""

    def __init__(self, inner, prompt_ids, ref):
        self.inner, self.prompt_ids, self.ref = inner, prompt_ids, ref

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, caches, bonus_tokens, contexts, **kw):
        logits = self.inner.draft(caches, bonus_tokens, contexts, **kw)
        assert all(c.length == len(hist) for c, (_, hist) in zip(caches, contexts))  # chain K/V rewound
        out = np.full_like(logits, -np.inf)
        for r, (_, hist) in enumerate(contexts):
            start = len(hist) + 1 - len(self.prompt_ids)
            for j in range(logits.shape[1]):
                if start + j < len(self.ref):
                    out[r, j, self.ref[start + j]] = 0.0
        return out


def test_oracle_chain_drafts_are_all_accepted(engine):
    ids = engine.tokenizer.encode(PROMPTS[1])
    ref = engine.generate_target_only(ids, 60).token_ids
    oracle = SpecEngine(engine.target, OracleChain(engine.drafter, ids, ref), eos_token_ids=(),
                        check_invariants=True, proposable_vocab=engine.proposable_vocab)
    got = oracle.generate(ids, 41)
    assert got.token_ids == ref[:41]
    assert got.stats.mean_accepted_length == pytest.approx(5.0)
