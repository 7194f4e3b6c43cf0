"""PARD through export and the runtime, on the tiny target + a tiny PARD drafter made from its first two layers:
the manifest and validation, lossless greedy against target-only, ragged batches equal solo runs, and an oracle
PARD drafter whose drafts are all accepted (so the K-row read, the cache rewind and the bonus bookkeeping are
exercised with real acceptance)."""
import numpy as np
import pytest

from runtime.engine import SpecEngine
from runtime.manifest import load_manifest
from runtime.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land far away,",
           "import numpy as np\nx = np.arange(10)\n"]


@pytest.fixture(scope="module")
def engine(tiny_pard_engines):
    return SpecEngine.from_dir(tiny_pard_engines, device="cpu", check_invariants=True)


def test_manifest_and_export_validation(tiny_pard_engines):
    m = load_manifest(tiny_pard_engines).to_dict()
    d = m["drafter"]
    assert d["family"] == "pard" and d["num_draft_tokens"] == 4 and d["pard_token"] == 49152
    assert d["mask_embedding"] and d["borrow_embeddings"]
    assert set(m["shared_weights"]) == {"embed_weight"}
    assert {"logits_start", "query_scale_enabled", "embed_weight"} <= set(m["graphs"]["drafter"]["inputs"])
    v = m["validation"]["drafter"]
    straddling = [p for p in v["points"] if p["num_keys"][0] <= 64 < p["num_keys"][1]]
    assert straddling, v["points"]  # one block's rows straddle ref_keys: per-row beta was checked
    far = max(v["points"], key=lambda p: p["num_keys"][0])
    assert far["beta_effect_on_logits"] > 10 * far["bound"]  # the comparison would catch a wrong beta
    assert len(v["ragged"]) == 3 and "switched_off" in v
    assert m["query_scale"]["rewrite"]["beta_subgraphs"] >= 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lossless_against_target_only(engine, prompt):
    ids = engine.tokenizer.encode(prompt)
    spec = engine.generate(ids, 30)
    base = engine.generate_target_only(ids, 30)
    assert spec.token_ids == base.token_ids
    assert spec.stats.rounds >= 1


def test_ragged_batch_equals_solo_runs(engine):
    reqs = [(engine.tokenizer.encode(p), SamplingParams(max_new_tokens=n, num_draft_tokens=k))
            for p, n, k in zip(PROMPTS[:3], (25, 12, 30), (4, 2, 3))]
    batch = engine.generate_batch(reqs)
    for (ids, params), got in zip(reqs, batch):
        assert got.token_ids == engine.generate(ids, params=params).token_ids
        assert got.token_ids == engine.generate_target_only(ids, params.max_new_tokens).token_ids


def test_query_scale_off_per_request_is_lossless(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    off = engine.generate(ids, params=SamplingParams(max_new_tokens=20, query_scale=False))
    assert off.token_ids == engine.generate_target_only(ids, 20).token_ids


class OraclePard:
    """Wraps the real ORT PARD drafter (its cache path runs) and returns logits that put all mass on the target's
    own greedy continuation: every draft is accepted, so rounds emit K + 1 tokens."""

    def __init__(self, inner, prompt_ids, ref):
        self.inner, self.prompt_ids, self.ref = inner, prompt_ids, ref

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, caches, bonus_tokens, contexts, **kw):
        logits = self.inner.draft(caches, bonus_tokens, contexts, **kw)
        out = np.full_like(logits, -1e4)
        for r, hist in enumerate(contexts):
            start = len(hist) + 1 - len(self.prompt_ids)  # index in ref of the first draft token
            for j in range(logits.shape[1]):
                if start + j < len(self.ref):
                    out[r, j, self.ref[start + j]] = 0.0
        assert all(c.length == len(h) + 1 for c, h in zip(caches, contexts))  # masks' K/V were dropped
        return out


def test_oracle_pard_drafts_are_all_accepted(engine):
    ids = engine.tokenizer.encode(PROMPTS[1])
    ref = engine.generate_target_only(ids, 60).token_ids
    oracle = SpecEngine(engine.target, OraclePard(engine.drafter, ids, ref), eos_token_ids=(),
                        check_invariants=True, proposable_vocab=engine.proposable_vocab)
    got = oracle.generate(ids, 41)
    assert got.token_ids == ref[:41]
    assert got.stats.mean_accepted_length == pytest.approx(5.0)  # K = 4 drafts + 1 bonus every round
