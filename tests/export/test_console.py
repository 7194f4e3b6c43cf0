"""The export console (export/console.py): third-party output to the log file, sharpdraft's lines to the terminal,
and on an interactive terminal a progress bar over the export's phases."""
import fcntl
import io
import logging
import os
import pty
import struct
import termios

from export.console import PhaseBar, chatter_to_file


def test_phase_bar_counts_phases_and_keeps_other_lines():
    out = io.StringIO()
    bar = PhaseBar(out, total=3)
    log = logging.getLogger("sharpdraft.test_console")
    log.propagate = False
    log.addHandler(bar)
    log.setLevel(logging.INFO)
    try:
        log.info("exporting target (4 layers) ...")
        log.info("exporting drafter ...")
        log.info("query-scale rewrite: {'beta_subgraphs': 1}")  # not a phase: printed above the bar
        assert bar.bar.n == 1 and bar.bar.desc == "exporting drafter"
        log.info("validating (ORT vs torch) ...")
    finally:
        log.removeHandler(bar)
        bar.close()
    text = out.getvalue()
    assert "query-scale rewrite: {'beta_subgraphs': 1}\n" in text and "phase 3/3" in text
    assert bar.bar.n == 3  # completed when the job ends


def _read_all(fd: int) -> bytes:
    """Everything written to a pipe or pty whose writing end is closed (a pty hands it over in chunks; its end
    reads as EIO on Linux)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_chatter_goes_to_the_log_and_the_bar_only_to_a_terminal(tmp_path):
    """A pipe gets sharpdraft's lines verbatim (tests and CI read them); a terminal gets the bar."""
    log = logging.getLogger("sharpdraft.export")
    for interactive in (False, True):
        master, slave = pty.openpty() if interactive else os.pipe()
        if interactive:  # a terminal 100 columns wide (a fresh pty has none)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        saved = os.dup(2)
        os.dup2(slave, 2)
        try:
            with chatter_to_file(tmp_path / f"x{interactive}.log", phases=2):
                os.write(1, b"third-party chatter\n")
                log.info("exporting drafter ...")
                log.info("validating (ORT vs torch) ...")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(slave)
        shown = _read_all(master).decode()
        os.close(master)
        assert "third-party chatter" in (tmp_path / f"x{interactive}.log").read_text()
        assert "third-party chatter" not in shown
        if interactive:
            assert "phase 2/2" in shown and "validating (ORT vs torch)" in shown
        else:
            assert shown == "exporting drafter ...\nvalidating (ORT vs torch) ...\n"
