"""Drafter training: the recipes behind the shipped demo drafters, as a library (docs/design.md §2).

- ``corpus``: the offline text, its train / held-out split and each held-out document's kind (prose, code, chat);
- ``shards``: the feature and token shard formats and the one train / validation split;
- ``metrics``: teacher-forced acceptance proxies; ``autocast``: the CPU autocast choice;
- one module per drafter family (``dflash``, ``pard``, ``eagle3``): layout, losses, validation, the steps of its
  recipe; ``distill``: the self-distilled corpus from a served target graph.

``scripts/train_*.py`` and ``scripts/distill.py`` are the command lines. Imports runtime/ and plugins/, never
export/.
"""
