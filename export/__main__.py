"""``python -m export`` = ``sharpdraft-export`` (export/cli.py)."""
from export.cli import main

main()
