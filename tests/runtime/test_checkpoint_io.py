"""Saved checkpoints and corpus shards get the modes the umask allows (safetensors >= 0.8 alone writes 0600)."""
import os
import stat

import numpy as np
import pytest
import torch

from runtime.models.checkpoint_io import save_safetensors, umask_file_mode
from runtime.models.dflash import load_dflash, save_dflash


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_new_file_follows_umask(tmp_path, umask, mask):
    umask(mask)
    save_safetensors({"w": torch.ones(3)}, tmp_path / "a.safetensors")
    save_safetensors({"ids": np.arange(4, dtype=np.uint16)}, tmp_path / "b.safetensors", metadata={"k": "v"})
    (tmp_path / "c.json").write_text("{}")  # what open() gives, the reference
    assert _mode(tmp_path / "a.safetensors") == _mode(tmp_path / "b.safetensors") == _mode(tmp_path / "c.json")
    assert _mode(tmp_path / "a.safetensors") == 0o666 & ~mask
    assert umask_file_mode() == 0o666 & ~mask  # reading the umask leaves it as it was
    assert os.umask(mask) == mask


def test_overwrite_keeps_the_files_mode(tmp_path, umask):
    p = tmp_path / "a.safetensors"
    save_safetensors({"w": torch.ones(3)}, p)
    os.chmod(p, 0o640)
    save_safetensors({"w": torch.zeros(3)}, p)
    assert _mode(p) == 0o640


def test_saved_drafter_is_readable_by_others(tmp_path, tiny_dflash_dir, umask):
    """The saver training scripts use (train_dflash.py save): model.safetensors used to be 0600 beside 0644 json."""
    save_dflash(load_dflash(tiny_dflash_dir), tmp_path / "out")
    assert _mode(tmp_path / "out" / "model.safetensors") == _mode(tmp_path / "out" / "config.json") == 0o644


def test_mixed_kinds_are_refused(tmp_path):
    with pytest.raises(TypeError, match="one kind"):
        save_safetensors({"a": torch.ones(2), "b": np.ones(2, np.float32)}, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()

