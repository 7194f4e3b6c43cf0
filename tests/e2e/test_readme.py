"""README's commands, run as written (on the tiny pair where the real pair would take minutes).

Each backticked command of README's "One command per capability" table and the server example is run:
- ``sharpdraft-export``, ``runtime.generate``, ``runtime.triton_repo``, ``sharpdraft-calibrate`` and the server with
  its curl request run for real, on the tiny test pair written to disk (``--checkpoint`` / ``--target`` point at it;
  folders named in the command are moved under a temp dir);
- the scripts that need the real pair for minutes (``eval_mal``, ``bench_peers``, ``bench_serve``, ``bench_table1``,
  ``distill``, ``train_dflash``) are run with ``--help`` appended, which makes click check every option the README
  names;
- the TensorRT-LLM example needs a GPU and TensorRT-LLM: only its argument parser is checked.
"""
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from runtime.serve import wait_healthy
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
TINY = ["--target-precision", "fp32", "--ref-keys", "64"]  # the tiny pair's validation stays small at ref 64
HELP_ONLY = ("scripts/eval_mal.py", "scripts/bench_peers.py", "scripts/distill.py", "scripts/train_dflash.py",
             "scripts/bench_serve.py", "scripts/bench_table1.py")


def table_commands() -> list[str]:
    """The first backticked span of column 2 of the capability table."""
    section = README.split("## One command per capability", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) >= 3:
            m = re.search(r"`([^`]+)`", cells[1])
            if m:
                out.append(m.group(1).replace("\\|", "|"))
    return out


def test_the_table_lists_every_capability():
    cmds = table_commands()
    assert len(cmds) >= 10, cmds
    for tool in ("sharpdraft-export", "runtime.generate", "runtime.serve", "runtime.triton_repo",
                 "sharpdraft-calibrate", "--checkpoint", "--fused-attention"):
        assert any(tool in c for c in cmds), tool


def _argv(cmd: str, tmp: Path, tiny: dict[str, Path]) -> list[str]:
    """The command as a subprocess argv: console scripts by module, paths under ``tmp``, the tiny pair."""
    argv = shlex.split(cmd)
    head = {"sharpdraft-export": [sys.executable, "-m", "export.cli"],
            "sharpdraft-export-vllm": [sys.executable, "-m", "export.vllm_export"],
            "sharpdraft-calibrate": [sys.executable, "-m", "export.calibrate"], "python": [sys.executable]}
    argv = head[argv[0]] + argv[1:]
    out = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev in ("--engine", "--out", "--work") and not a.startswith("-"):
            a = str(tmp / a)
        elif prev == "--checkpoint":
            a = str(tiny["drafter"])
        elif prev == "--target":
            a = str(tiny["target"])
        out.append(a)
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_target_dir, tiny_dflash_dir):
    """The README's export (the first table row) on the tiny pair: ``engines/`` under a temp dir."""
    tmp = tmp_path_factory.mktemp("readme")
    tiny = {"drafter": tiny_dflash_dir, "target": tiny_target_dir}
    cmd = table_commands()[0]
    assert cmd.startswith("sharpdraft-export") and "--out engines/" in cmd
    argv = _argv(cmd, tmp, tiny) + ["--checkpoint", str(tiny_dflash_dir), "--target", str(tiny_target_dir), *TINY]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines() + r.stderr.strip().splitlines()
    assert len(lines) <= 12, "the export's console should show sharpdraft's own lines only:\n" + "\n".join(lines)
    assert (tmp / "engines" / "export.log").is_file()  # the exporters' own output went there
    return tmp, tiny


def _run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT, **kw)


@pytest.mark.parametrize("index", range(1, len(table_commands())))
def test_table_command(workdir, index):
    tmp, tiny = workdir
    cmd = table_commands()[index]
    argv = _argv(cmd, tmp, tiny)
    if cmd.startswith("sharpdraft-export-vllm"):  # the real shipped drafter: seconds (vLLM itself: tests/vllm)
        r = _run(argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "wrote" in r.stdout and (tmp / "vllm-dflash" / "config.json").is_file()
    elif cmd.startswith("sharpdraft-export"):
        if "--checkpoint" not in cmd:
            argv += ["--checkpoint", str(tiny["drafter"])]
        if "--target" not in cmd:
            argv += ["--target", str(tiny["target"])]
        argv = [a if a != str(tmp / "engines/") else str(tmp / f"engines-{index}") for a in argv]
        r = _run(argv + TINY)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "wrote" in r.stdout and "validation:" in r.stdout
    elif "runtime.generate" in cmd:
        r = _run(argv + ["--max-new-tokens", "4", "--temperature", "0"])
        assert r.returncode == 0, r.stderr[-3000:]
        assert "lossless (speculative ids == target-only greedy ids): True" in r.stdout
    elif "runtime.triton_repo" in cmd:
        r = _run(argv)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (tmp / "triton_repo").is_dir()
    elif cmd.startswith("sharpdraft-calibrate"):
        text = tmp / "calib.txt"
        text.write_text((ROOT / "README.md").read_text() * 3)
        r = _run(argv + ["--grid", "64,128", "--max-docs", "1", "--text", str(text)])
        assert r.returncode == 0, r.stderr[-3000:]
        assert (tmp / "runs" / "calibration" / "dflash" / "calibration.json").is_file()
    elif "runtime.serve" in cmd:
        r = _run(argv + ["--help"])  # its options exist; test_server_example runs the server with a request
        assert r.returncode == 0, (cmd, r.stderr[-2000:])
    elif any(s in cmd for s in HELP_ONLY):
        r = _run(argv + ["--help"])
        assert r.returncode == 0, (cmd, r.stderr[-2000:])  # click refuses any option the script lacks
    elif "examples/trtllm" in cmd:
        r = _run([sys.executable, str(ROOT / "examples/trtllm/serve_with_query_scale.py"), "--help"])
        assert r.returncode == 0 and "--family" in r.stdout and "--config" in r.stdout
    else:
        pytest.fail(f"README command not covered by this test: {cmd}")


def test_server_example(workdir):
    """The README's server block: start the server as written, send its curl request's body, stop it."""
    tmp, _ = workdir
    block = README.split("A request to the server:", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    serve_line = next(line for line in block.splitlines() if "runtime.serve" in line)
    body = json.loads(re.search(r"-d '(\{.*\})'", block, re.S).group(1))
    argv = shlex.split(serve_line.rstrip("&").replace(".venv/bin/python", "python"))
    argv = [sys.executable] + argv[1:]
    argv[argv.index("--engine") + 1] = str(tmp / "engines")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv[argv.index("--port") + 1] = str(port)
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", 120), proc.stderr.read() if proc.poll() is not None else ""
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.terminate()
        proc.wait(30)
