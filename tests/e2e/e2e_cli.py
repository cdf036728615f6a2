"""Runs the ``phalanx`` command line as a user would, for the end-to-end tests."""

from __future__ import annotations

import subprocess
import sys


def phalanx(*args: str, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``phalanx ARGS`` in a fresh interpreter; asserts success unless ``check=False``."""
    result = subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args],
                            capture_output=True, text=True, timeout=60, env=env)
    if check:
        assert result.returncode == 0, result.stderr
    return result
