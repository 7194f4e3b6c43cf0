"""training/autocast.py: bf16 autocast only where the CPU runs bf16 natively, with an override."""

import pytest
import torch

from training.autocast import bf16_is_native, compute_dtype, cpu_autocast, use_bf16


@pytest.mark.parametrize("env,bf16", [("bf16", True), ("off", False), ("OFF", False)])
def test_override(monkeypatch, env, bf16):
    monkeypatch.setenv("SHARPDRAFT_TRAIN_AUTOCAST", env)
    assert use_bf16() is bf16
    assert compute_dtype() == (torch.bfloat16 if bf16 else torch.float32)
    w = torch.randn(8, 8)
    with cpu_autocast():
        y = torch.randn(2, 8) @ w.T
    assert y.dtype == (torch.bfloat16 if bf16 else torch.float32)


def test_auto_follows_the_cpu(monkeypatch):
    monkeypatch.delenv("SHARPDRAFT_TRAIN_AUTOCAST", raising=False)
    assert use_bf16() is bf16_is_native()


def test_bad_value(monkeypatch):
    monkeypatch.setenv("SHARPDRAFT_TRAIN_AUTOCAST", "fp16")
    with pytest.raises(ValueError, match="'bf16', 'off'"):
        use_bf16()
