"""Entry point for ``nox -s "bench(integration)"``: the ablation table on one GPU.

Runs :mod:`ablation` (about 9 minutes on one H200; ``-- --quick`` for about 4) and writes
its JSON and markdown table into ``integration/results/``. Arguments are passed through,
e.g. ``nox -s "bench(integration)" -- --quick``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablation import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
