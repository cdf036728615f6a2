"""Fixtures the integration modules share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset ``runtime_worker.py`` trains on, prepared once per module."""
    path = tmp_path_factory.mktemp("runtime") / "data"
    worker = Path(__file__).resolve().parent / "runtime_worker.py"
    subprocess.run([sys.executable, str(worker), "--prepare", str(path)], check=True,
                   timeout=120)
    return path
