"""Reading and writing checkpoint files: the checks every drafter loader shares (:class:`CheckpointError`,
:func:`read_safetensors`, :func:`check_finite`, :func:`check_state`), and safetensors written with the modes the
process umask allows.

safetensors >= 0.8 writes through a temporary file that is created 0600 and renamed into place
(safetensors/safetensors#782), so a checkpoint saved under umask 022 is readable by its owner only, while the
``config.json`` beside it is 0644: a server, Triton or a colleague running as another user then fails with "no such
file" or a permission error. :func:`save_safetensors` restores what a plain ``open()`` would have given.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch


def current_umask() -> int:
    """The process umask (read by setting a harmless value for the instant in between, then restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_file_mode(existing: str | Path | None = None) -> int:
    """The permission bits a new regular file gets from ``open()``: ``0o666 & ~umask``; or, when ``existing`` names
    a file that is being replaced, that file's own bits (an overwrite keeps the mode the user chose)."""
    if existing is not None and os.path.isfile(existing):
        return os.stat(existing).st_mode & 0o7777
    return 0o666 & ~current_umask()


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None,
                     mode_of: str | Path | None = None) -> None:
    """``safetensors.{torch,numpy}.save_file(tensors, path, metadata)``, then the mode of :func:`umask_file_mode`.

    Args:
        tensors: name -> ``torch.Tensor`` (contiguous, any dtype safetensors stores), or name -> ``numpy.ndarray``
            for every entry (then ``safetensors.numpy.save_file`` writes it).
        path: the ``.safetensors`` file to write (its folder must exist).
        metadata: the header's ``__metadata__`` (str -> str).
        mode_of: the file whose mode to keep when ``path`` is a temporary that will be renamed over it (default:
            ``path`` itself, so a plain overwrite keeps the old file's mode and a new file follows the umask).

    Raises:
        TypeError: ``tensors`` mixes numpy arrays with torch tensors (convert one kind first).
        OSError: the folder is missing or not writable (from safetensors).
    """
    import numpy as np

    path = Path(path)
    mode = umask_file_mode(path if mode_of is None else mode_of)
    kinds = {isinstance(v, np.ndarray) for v in tensors.values()}
    if kinds == {True, False}:
        raise TypeError("save_safetensors: tensors mixes numpy arrays and torch tensors; convert them to one kind")
    if kinds == {True}:
        from safetensors.numpy import save_file
    else:
        from safetensors.torch import save_file
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)


class CheckpointError(RuntimeError):
    """A drafter checkpoint is missing, corrupt or does not match its config; the message says what to do."""


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in checkpoint folder ``path``.

    Raises:
        CheckpointError: no safetensors file, or one is corrupt / unreadable (named), or a floating-point tensor
            holds NaN or inf (:func:`check_finite`).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights next to config.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e}); re-download or re-train it") \
                from e
    check_finite(path, state)
    return state


def check_finite(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose floating-point tensors hold NaN or inf: such a drafter exports, validates against a
    torch reference that is NaN too, and then never has a draft token accepted.

    Raises:
        CheckpointError: one line naming the first such tensor (sorted by name) and its NaN / inf counts.
    """
    for name in sorted(state):
        t = state[name]
        if not torch.is_floating_point(t):
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            nan = int(torch.isnan(t).sum())
            raise CheckpointError(f"{path}: tensor {name!r} holds {nan} NaN and {int((~finite).sum()) - nan} inf "
                                  "values; the checkpoint is damaged (re-download it, or retrain from a finite step)")


def check_state(path: Path, expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], *,
                optional: set[str] = frozenset(), strict: bool = True, show=lambda k: k) -> None:
    """Compare checkpoint tensors ``state`` with a module's ``expected`` state dict.

    Args:
        optional: expected keys a checkpoint may omit. ``strict=False`` tolerates missing / unexpected keys.
        show: how a key is printed in messages (e.g. without a wrapper's prefix).
    Raises:
        CheckpointError: keys missing or unexpected (first 8 of each listed), or shapes differing from the config.
    """
    missing = sorted(set(expected) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(f"{path}: checkpoint keys do not match its config: missing "
                              f"{[show(k) for k in missing][:8]}, unexpected {[show(k) for k in unexpected][:8]}")
    bad = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
           if k in state and state[k].shape != v.shape]
    if bad:
        raise CheckpointError(f"{path}: tensor shapes do not match config.json: {bad[:4]}")
