"""Write safetensors files with the modes the process umask allows.

safetensors >= 0.8 writes through a temporary file that is created 0600 and renamed into place
(safetensors/safetensors#782), so a checkpoint saved under umask 022 is readable by its owner only, while the
``config.json`` beside it is 0644: a server, Triton or a colleague running as another user then fails with "no such
file" or a permission error. :func:`save_safetensors` restores what a plain ``open()`` would have given.
"""
from __future__ import annotations

import os
from pathlib import Path


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
