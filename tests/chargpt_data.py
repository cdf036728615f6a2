"""The char-GPT examples' dataset, as the tests that train them prepare it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def tokens(tmp_path_factory: pytest.TempPathFactory, name: str, max_bytes: int) -> Path:
    """The first ``max_bytes`` of the Shakespeare text, tokenised by
    ``examples/chargpt_model.py`` into a new temporary folder ``name``."""
    path = tmp_path_factory.mktemp(name) / "tokens"
    subprocess.run([sys.executable, str(EXAMPLES / "chargpt_model.py"), "--data-dir",
                    str(path), "--max-bytes", str(max_bytes)], check=True, timeout=120)
    return path
