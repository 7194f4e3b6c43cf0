"""Online draft adaptation (runtime/online_adapt.py): LoRA or full steps on the target's verified tokens, on the
torch backend; decoding stays lossless, only the drafter changes, and the loss falls on repeated data."""
import pytest
import torch

from runtime.engine import SpecEngine
from runtime.online_adapt import LORA_TARGETS, AdaptConfig

pytest.importorskip("peft")
PROMPT = "def add(a, b):\n    return a + b\n" * 4


def _engine(tiny_engines, **options):
    return SpecEngine.from_dir(tiny_engines, device="cpu", backend="torch", check_invariants=True, **options)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_adaptation_is_lossless_and_moves_only_what_it_trains(tiny_engines, mode):
    e = _engine(tiny_engines)
    base = {n: p.detach().clone() for n, p in e.drafter.model.named_parameters()}
    e = e.with_options(online_adapt=AdaptConfig(mode=mode, rank=4, lr=1e-2))  # the same drafter, now adapting
    ad = e.adapter
    ids = e.tokenizer.encode(PROMPT)
    out = e.generate(ids, 32)
    assert out.token_ids == e.generate_target_only(ids, 32).token_ids and out.stats.rounds > 0
    st = ad.stats()
    assert st["steps"] == out.stats.rounds and st["mean_loss_last_10"] > 0
    changed = {n for n, p in e.drafter.model.named_parameters() if n in base and not torch.equal(p, base[n])}
    if mode == "lora":
        assert not changed  # the shipped weights stay as they are
        cfg = e.drafter.model.config
        linears = [m for n, m in e.drafter.model.named_modules() if n.split(".")[-1] in LORA_TARGETS
                   and hasattr(m, "in_features")]
        assert st["trainable_parameters"] == sum(4 * (m.in_features + m.out_features) for m in linears) > 0
        assert len(linears) == len(LORA_TARGETS) * cfg.num_hidden_layers
        assert st["adapter_bytes"] == 4 * st["trainable_parameters"]
    else:
        assert changed and st["trainable_parameters"] == sum(p.numel() for p in base.values())


def test_the_loss_falls_on_repeated_rounds(tiny_engines):
    e = _engine(tiny_engines, online_adapt=AdaptConfig(mode="lora", rank=8, lr=5e-2, interval=1000))  # collect,
    ad = e.adapter  # step by hand
    e.generate(e.tokenizer.encode(PROMPT), 16)
    examples = list(ad.pending)
    assert examples and all(ex.labels for ex in examples)
    first = ad.learn(examples)
    for _ in range(15):
        last = ad.learn(examples)
    assert last < 0.8 * first


def test_refusals(tiny_engines):
    with pytest.raises(ValueError, match="torch backend"):
        SpecEngine.from_dir(tiny_engines, device="cpu", online_adapt=AdaptConfig())
    with pytest.raises(ValueError, match="mode must be one of lora, full"):
        AdaptConfig(mode="qlora")
    with pytest.raises(ValueError, match="positive"):
        AdaptConfig(rank=0)
