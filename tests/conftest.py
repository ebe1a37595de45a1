from __future__ import annotations

import sys
from pathlib import Path

# `tests` helpers import as plain modules (tests/trees.py) without packaging.
sys.path.insert(0, str(Path(__file__).resolve().parent))
