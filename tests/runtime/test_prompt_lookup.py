"""Prompt lookup drafts (runtime/prompt_lookup.py): the index, and the loop with it stays lossless."""
import numpy as np
import pytest

from runtime.engine import SpecEngine
from runtime.prompt_lookup import NgramIndex, PromptLookup
from runtime.sampling import RowSampler, SamplingParams


def test_latest_occurrence_longest_suffix_first():
    idx = NgramIndex(PromptLookup(min_ngram=2, max_ngram=3, num_tokens=3))
    toks = [1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2]
    assert idx.propose(toks) == ([4, 5, 7], 2)  # (1, 2) occurred twice: the later one (followed by 4) wins
    toks += [4]  # now (1, 2, 4) matches at length 3
    assert idx.propose(toks) == ([5, 7, 1], 3)
    toks += [6]  # (2, 4, 6) and (4, 6) never occurred
    assert idx.propose(toks) == ([], 0)


def test_periodic_continuation_and_caps():
    idx = NgramIndex(PromptLookup(min_ngram=2, max_ngram=2, num_tokens=7))
    toks = [5, 8, 5, 8, 5]  # (8, 5) last occurred at 1..2, followed by (8, 5) and then the future itself
    assert idx.propose(toks) == ([8, 5, 8, 5, 8, 5, 8], 2)
    assert idx.propose(toks, max_tokens=2) == ([8, 5], 2)
    assert idx.propose(toks, max_tokens=0) == ([], 0)
    with pytest.raises(ValueError, match="shrank"):
        idx.propose(toks[:3])


def test_incremental_index_equals_a_fresh_one():
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(0, 6, 300)]
    cfg = PromptLookup(min_ngram=1, max_ngram=4, num_tokens=5)
    grown = NgramIndex(cfg)
    for n in range(1, len(toks) + 1, 7):
        assert grown.propose(toks[:n]) == NgramIndex(cfg).propose(toks[:n])


def test_brute_force_agreement():
    """The proposal equals a direct scan for the latest earlier occurrence of the longest matching suffix."""
    rng = np.random.default_rng(1)
    cfg = PromptLookup(min_ngram=2, max_ngram=4, num_tokens=4)
    for _ in range(200):
        toks = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 40)))]
        want = ([], 0)
        for n in range(4, 1, -1):
            starts = [j for j in range(n, len(toks)) if toks[j - n:j] == toks[len(toks) - n:]]
            if len(toks) >= n and starts:
                j = max(starts)
                seq = list(toks)
                for i in range(4):
                    seq.append(seq[j + i])
                want = (seq[len(toks):], n)
                break
        assert NgramIndex(cfg).propose(toks) == want, toks


@pytest.mark.parametrize("spec,want", [("3:5:7", PromptLookup(3, 5, 7)), ("2:4", PromptLookup(2, 4, 4)),
                                       ("1", PromptLookup(1, 3, 7))])
def test_parse(spec, want):
    assert PromptLookup.parse(spec) == want


@pytest.mark.parametrize("spec,match", [("a:b", "integers"), ("1:2:3:4", "integers"), ("0:2:3", "min_ngram"),
                                        ("4:3:2", "max_ngram"), ("2:3:0", "num_tokens")])
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        PromptLookup.parse(spec)


def test_one_hot_q_keeps_the_target_distribution():
    """A copied draft token is certain (q one-hot): rejection sampling then emits exactly the processed target
    distribution (5-sigma bound over 50,000 draws, fixed seed; the bound of tests/runtime/test_sampling.py)."""
    target = np.array([2.0, 1.5, 1.0, 0.5], np.float32)
    params = SamplingParams(temperature=0.9, top_k=3)
    x = target.astype(np.float64) / 0.9
    x[3] = -np.inf
    p = np.exp(x - x[np.isfinite(x)].max())
    p /= p.sum()
    sampler = RowSampler(params, np.random.Generator(np.random.PCG64(7)))
    n = 50_000
    for d in (1, 3):  # a likely copy, and one outside top-k (always rejected, never emitted)
        q = np.zeros((1, 4))
        q[0, d] = 1.0
        counts = np.zeros(4)
        for _ in range(n):
            _, emitted = sampler.verify([d], q, np.stack([target, target]), "rejection")
            counts[emitted[0]] += 1
        freq = counts / n
        assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9), (d, freq, p)
        assert counts[3] == 0


@pytest.fixture(scope="module")
def engine(tiny_engines):
    return SpecEngine.from_dir(tiny_engines, device="cpu", check_invariants=True,
                               prompt_lookup=PromptLookup(min_ngram=1, max_ngram=3, num_tokens=6))


PROMPTS = ["a b c a b c a b c a b", "def f(x):\n    return x\ndef f(x):\n", "The quick brown fox", "1, 2, 1, 2, 1,"]


def test_greedy_with_lookup_is_lossless(engine):
    """The tiny random target loops; copies (longer than the drafter's block of 4) are verified and it stays exact."""
    lookup = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        spec = engine.generate(ids, 48)
        assert spec.token_ids == engine.generate_target_only(ids, 48).token_ids, prompt
        lookup += spec.stats.lookup_rounds
        assert spec.stats.lookup_accepted <= spec.stats.accepted
        assert len(spec.stats.drafted_per_position) <= 6
    assert lookup > 0


def test_lookup_rows_skip_the_drafter_and_mix_in_a_batch(engine):
    # one drafter call per round: the seeded sampled row is not drafted alone here (batch_invariant_seeds off)
    engine = engine.with_options(batch_invariant_seeds=False)
    rows_drafted = []
    inner = engine.drafter.draft

    def counting(caches, bonus, contexts, **kw):
        rows_drafted.append(len(caches))
        return inner(caches, bonus, contexts, **kw)

    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=30, temperature=t, seed=5) for t in (0.0, 0.0, 0.8, 0.0)]
    solo = [engine.generate(p, params=q) for p, q in zip(prompts, params)]
    engine.drafter.draft = counting
    try:
        batch = engine.generate_batch(list(zip(prompts, params)))
    finally:
        del engine.drafter.draft
    assert [r.token_ids for r in batch] == [r.token_ids for r in solo]  # a row's lookup never depends on others
    rounds = max(r.stats.rounds for r in batch)
    assert sum(r.stats.lookup_rounds for r in batch) > 0
    assert sum(rows_drafted) == sum(r.stats.rounds - r.stats.lookup_rounds for r in batch)
    assert len(rows_drafted) <= rounds


def test_no_speculation_request_never_looks_up(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    out = engine.generate(ids, params=SamplingParams(max_new_tokens=20, num_draft_tokens=0))
    assert out.stats.rounds == 0 and out.stats.lookup_rounds == 0
    assert out.token_ids == engine.generate_target_only(ids, 20).token_ids


@pytest.mark.parametrize("module", ["runtime.generate", "runtime.serve"])
def test_cli_rejects_a_bad_spec_before_loading(module, tmp_path):
    """A bad --prompt-lookup ends with one usage error naming the option, before any engine folder is read."""
    import importlib

    from click.testing import CliRunner

    main = importlib.import_module(module).main
    res = CliRunner().invoke(main, ["--engine", str(tmp_path / "missing"), "--prompt-lookup", "4:2:7"])
    assert res.exit_code == 2 and "--prompt-lookup" in res.output and "max_ngram" in res.output


def test_click_option_default_off_and_spec():
    """The shared option: the command's default applies when absent, 'off' disables, a spec parses."""
    import click
    from click.testing import CliRunner

    from runtime.prompt_lookup import DEFAULT_SPEC, click_option

    seen = []

    @click.command()
    @click_option("lookup", default=DEFAULT_SPEC)
    def cmd(prompt_lookup):
        seen.append(prompt_lookup)

    for args in ([], ["--prompt-lookup", "off"], ["--prompt-lookup", "2:4:6"]):
        assert CliRunner().invoke(cmd, args).exit_code == 0
    assert seen == [PromptLookup.parse(DEFAULT_SPEC), None, PromptLookup(2, 4, 6)]
    assert PromptLookup(2, 4, 6).spec == "2:4:6" and PromptLookup.parse("2:4:6") == PromptLookup(2, 4, 6)
