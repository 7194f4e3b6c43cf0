"""Console of the main job: sharpdraft's own progress lines on the terminal, third-party chatter in a log file.

The exporters and optimizers ``sharpdraft-export`` drives (torch.onnx, onnxscript's optimizer, ONNX Runtime, ONNX
Runtime GenAI's model builder) write hundreds of lines per export ("Replaced initializer ...", "Skipping constant
folding ...", C++ warnings) from Python and from native code alike. :func:`chatter_to_file` points the process's
stdout and stderr file descriptors at a log file for the duration of the export and gives the ``sharpdraft`` loggers
a handler on the real terminal, so the console shows only the project's own lines; the log keeps everything
(sharpdraft's lines included) and is shown on failure. On an interactive terminal the phase lines (those ending in
"...") drive one progress bar (:class:`PhaseBar`: phase i of n, the phase's name, elapsed time); elsewhere (pipes,
CI logs) they stay plain lines.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

OWN_LOGGER = "sharpdraft"


class PhaseBar(logging.Handler):
    """A tqdm bar over an export's phases: each record ending in "..." starts the next phase (the bar shows its
    name, phase i of ``total`` and the elapsed time); other records are written above the bar."""

    def __init__(self, stream, total: int):
        from tqdm import tqdm

        super().__init__()
        self.stream = stream
        self.bar = tqdm(total=total, file=stream, leave=True,
                        bar_format="{desc} |{bar}| phase {n_fmt}/{total_fmt} [{elapsed}]")
        self.started = False
        self._done = threading.Event()
        threading.Thread(target=self._tick, daemon=True).start()  # the elapsed time moves during a long phase

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            with self.lock:
                self.bar.refresh()

    def emit(self, record: logging.LogRecord) -> None:
        msg = self.format(record)
        if msg.endswith("..."):
            if self.started:
                self.bar.update(1)
            self.started = True
            self.bar.set_description_str(msg[:-3].rstrip())
        else:
            self.bar.write(msg, file=self.stream)

    def close(self) -> None:
        self._done.set()
        if self.started:
            self.bar.update(max(0, self.bar.total - self.bar.n))
        self.bar.close()
        super().close()


@contextlib.contextmanager
def chatter_to_file(log_path: Path, level: int = logging.INFO, phases: int | None = None) -> Iterator[Path]:
    """Send file descriptors 1 and 2 to ``log_path`` (appending) while the block runs; ``sharpdraft.*`` log records
    at ``level`` and above still reach the terminal (the original stderr). Yields ``log_path``.

    ``phases``: how many phase lines the job will log; on an interactive terminal they drive a :class:`PhaseBar`.

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
    handler = PhaseBar(terminal, phases) if phases and terminal.isatty() else logging.StreamHandler(terminal)
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
        handler.close()
        own.setLevel(old_level)
        terminal.close()


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ('' if it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
