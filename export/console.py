"""Console of the main job: sharpdraft's own progress lines on the terminal, third-party chatter in a log file.

The exporters and optimizers ``sharpdraft-export`` drives (torch.onnx, onnxscript's optimizer, ONNX Runtime, ONNX
Runtime GenAI's model builder) write hundreds of lines per export ("Replaced initializer ...", "Skipping constant
folding ...", C++ warnings) from Python and from native code alike. :func:`chatter_to_file` points the process's
stdout and stderr file descriptors at a log file for the duration of the export and gives the ``sharpdraft`` loggers
a handler on the real terminal, so the console shows only the project's own lines; the log keeps everything
(sharpdraft's lines included) and is shown on failure.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

OWN_LOGGER = "sharpdraft"


@contextlib.contextmanager
def chatter_to_file(log_path: Path, level: int = logging.INFO) -> Iterator[Path]:
    """Send file descriptors 1 and 2 to ``log_path`` (appending) while the block runs; ``sharpdraft.*`` log records
    at ``level`` and above still reach the terminal (the original stderr). Yields ``log_path``.

    Raises:
        OSError: ``log_path`` cannot be opened for writing.
    """
    log_path = Path(log_path)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    own = logging.getLogger(OWN_LOGGER)
    handler = logging.StreamHandler(terminal)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level = own.level
    own.addHandler(handler)
    if own.getEffectiveLevel() > level:
        own.setLevel(level)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    try:
        yield log_path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(log_fd)
        own.removeHandler(handler)
        own.setLevel(old_level)
        terminal.close()


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ('' if it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
