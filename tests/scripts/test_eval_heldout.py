"""scripts/eval_heldout.py: the held-out protocol's summary, and a rerun that reuses finished calls."""
from __future__ import annotations

import json

from click.testing import CliRunner

from scripts.eval_heldout import CALLS, heldout_summary, main, table_row

DOCS = ["hamlet", "othello", "macbeth", "argparse.py", "typing.py", "subprocess.py"]


def _call(mal_doc: float, mal_chat: float, chats: int, frozen: float | None = None) -> dict:
    rows = [{"prompt": d, "mal": mal_doc + (0.5 if d.endswith(".py") else 0.0)} for d in DOCS]
    rows += [{"prompt": f"chat{i}", "mal": mal_chat} for i in range(chats)]
    if frozen is not None:
        for r in rows:
            r["mal_frozen"] = r["mal"] - frozen
    return {"rows": rows}


def _calls() -> dict:
    return {"ctx1024": _call(2.0, 1.0, 4), "ctx1024_end12000": _call(3.0, 1.5, 8),
            "ctx1024_end24000": _call(4.0, 9.9, 0), "ctx4096": _call(2.0, 1.0, 4, frozen=0.25)}


def test_summary_counts_each_row_once():
    s = heldout_summary(_calls())
    assert s["default10"] == {"prose": 2.0, "code": 2.5, "chat": 1.0, "all": 1.75}
    assert s["documents18"] == {"all": 3.25, "prose": 3.0, "code": 3.5, "n": 18}
    assert s["chats8"] == {"all": 1.5, "n": 8}
    c = s["ctx4096"]
    assert (c["documents"], c["documents_frozen"], c["all"], c["all_frozen"]) == (2.25, 2.0, 1.75, 1.5)
    assert table_row(s) == "| 1.750 (2.000 / 2.500 / 1.000) | 3.250 / 1.500 | 2.250 (2.000) | 1.750 |"
    short = heldout_summary({k: v for k, v in _calls().items() if k != "ctx4096"})
    assert "ctx4096" not in short and table_row(short).count("|") == 3


def test_rerun_reuses_finished_calls(tmp_path):
    """Every call's JSON already there: nothing is generated (the engine folder is never opened)."""
    for name, call in _calls().items():
        (tmp_path / f"eval_{name}.json").write_text(json.dumps(call))
    assert set(CALLS) == set(_calls())
    res = CliRunner().invoke(main, ["--engine", str(tmp_path), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "summary.json").read_text()) == heldout_summary(_calls())
    assert res.output.strip().endswith("| 1.750 |")
