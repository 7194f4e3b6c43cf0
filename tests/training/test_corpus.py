"""training/corpus.py: each held-out prompt's kind, in one place."""
from training.corpus import HELDOUT_DOCUMENTS, HELDOUT_MODULES, HELDOUT_PLAYS, document_kind, mean_by_kind, prompt_kind


def test_kinds():
    assert {document_kind(n) for n in HELDOUT_DOCUMENTS["prose"]} == {"prose"}
    assert {document_kind(n) for n in HELDOUT_DOCUMENTS["code"]} == {"code"}
    assert set(HELDOUT_DOCUMENTS["code"]) == set(HELDOUT_MODULES)
    assert {n.split("_")[0] for n in HELDOUT_DOCUMENTS["prose"]} == set(HELDOUT_PLAYS)
    assert document_kind("argparse.py@1024") == "code" and document_kind("hamlet_gut@1024") == "prose"
    assert prompt_kind("chat3") == "chat" and prompt_kind("typing.py") == "code" and prompt_kind("hamlet") == "prose"
    rows = [{"prompt": "chat0", "m": 1.0}, {"prompt": "typing.py", "m": 3.0}, {"prompt": "hamlet", "m": 2.0},
            {"prompt": "othello", "m": 4.0}]
    assert list(mean_by_kind(rows, "m").items()) == [("prose", 3.0), ("code", 3.0), ("chat", 1.0)]
