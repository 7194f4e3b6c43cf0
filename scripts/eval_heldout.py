"""The drafter issue's held-out protocol in one command: 38 rows at 1k context and 10 rows at 3.5k, greedy.

Runs ``scripts/eval_mal.py`` (every row lossless-checked against target-only greedy) four times on one engines/
folder and summarises them as the drafter cards and docs/drafter-quality.md report them:

- 1k, "default 10": the 6 held-out documents ending at token 3,500 and 4 held-out chat prompts;
- 1k, 12 more documents: the same documents ending at tokens 12,000 and 24,000 (where a document is shorter, its
  last 1k tokens), and 8 held-out chat prompts (asked once: chat prompts do not depend on the end token);
- 3.5k (``--context 4096``, documents ending at token 3,500) with ``--compare-query-scale``: the same 10 rows with
  the query scale on and off (frozen).

All with every draft token verified (``--draft-tokens 7``), 128 new tokens. ``--no-long`` skips the 3.5k call
(the slowest: three generations per row).

  python scripts/eval_heldout.py --engine engines/ --out runs/heldout/default
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import click

from training.corpus import mean_by_kind, prompt_kind

EVAL_MAL = Path(__file__).with_name("eval_mal.py")  # run as a command: a script never imports another

CALLS = {  # name: eval_mal arguments (besides --engine, --draft-tokens and --json-out)
    "ctx1024": ["--context", "1024", "--chat", "4"],
    "ctx1024_end12000": ["--context", "1024", "--end-token", "12000", "--chat", "8"],
    "ctx1024_end24000": ["--context", "1024", "--end-token", "24000", "--chat", "0"],
    "ctx4096": ["--context", "4096", "--chat", "4", "--compare-query-scale"],
}


def _mean(rows: list[dict], key: str = "mal") -> float | None:
    return round(statistics.mean(r[key] for r in rows), 4) if rows else None


def heldout_summary(calls: dict[str, dict]) -> dict:
    """Summarise eval_mal JSON outputs (``{call name: summary}``, names as in :data:`CALLS`) into the protocol's
    figures: ``default10`` (MAL by kind and all), ``documents18`` (all / prose / code), ``chats8``, and where the
    3.5k call ran, ``ctx4096`` (documents and all 10, scaled and frozen, and by kind).

    Raises:
        KeyError: a 1k call is missing.
    """
    d10 = calls["ctx1024"]["rows"]
    docs = [r for c in ("ctx1024", "ctx1024_end12000", "ctx1024_end24000") for r in calls[c]["rows"]
            if prompt_kind(r["prompt"]) != "chat"]
    chats = [r for r in calls["ctx1024_end12000"]["rows"] if prompt_kind(r["prompt"]) == "chat"]
    out = {
        "default10": mean_by_kind(d10, "mal") | {"all": _mean(d10)},
        "documents18": {"all": _mean(docs)} | mean_by_kind(docs, "mal") | {"n": len(docs)},
        "chats8": {"all": _mean(chats), "n": len(chats)},
    }
    if "ctx4096" in calls:
        rows = calls["ctx4096"]["rows"]
        d4 = [r for r in rows if prompt_kind(r["prompt"]) != "chat"]
        out["ctx4096"] = {"documents": _mean(d4), "documents_frozen": _mean(d4, "mal_frozen"),
                          "all": _mean(rows), "all_frozen": _mean(rows, "mal_frozen")} | mean_by_kind(rows, "mal")
    return out


def table_row(s: dict) -> str:
    """One markdown table row: 1k default 10 (prose / code / chat) | 18 documents / 8 chats | 3.5k documents scaled
    (frozen) | 3.5k all 10."""
    d = s["default10"]
    row = (f"| {d['all']:.3f} ({d['prose']:.3f} / {d['code']:.3f} / {d['chat']:.3f}) "
           f"| {s['documents18']['all']:.3f} / {s['chats8']['all']:.3f} ")
    if "ctx4096" in s:
        c = s["ctx4096"]
        row += f"| {c['documents']:.3f} ({c['documents_frozen']:.3f}) | {c['all']:.3f} "
    return row + "|"


@click.command()
@click.option("--engine", "engine_dir", required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="folder for the JSON of every call")
@click.option("--long/--no-long", default=True, show_default=True, help="also the 3.5k call")
def main(engine_dir: Path, out: Path, long: bool):
    out.mkdir(parents=True, exist_ok=True)
    calls = {}
    for name, args in CALLS.items():
        if name == "ctx4096" and not long:
            continue
        f = out / f"eval_{name}.json"
        if not f.exists():  # a rerun continues where an interrupted one stopped
            click.echo(f"--- {name}: {' '.join(args)}")
            r = subprocess.run([sys.executable, str(EVAL_MAL), "--engine", str(engine_dir), "--draft-tokens", "7",
                                "--json-out", str(f), *args])
            if r.returncode:  # eval_mal.py said why (a lossless break, a bad folder) on its stderr
                raise SystemExit(r.returncode)
        calls[name] = json.loads(f.read_text())
    summary = heldout_summary(calls)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    click.echo(json.dumps(summary))
    click.echo(table_row(summary))


if __name__ == "__main__":
    main()
