"""The environment the processes the tests start run in."""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Set by pytest, to each test's name and phase, while it runs: left out of what the
#: tests' clusters and ranks are given, so that their import environments are equal and
#: one zygote template serves them all (tests/conftest.py).
PER_TEST_VARIABLE = "PYTEST_CURRENT_TEST"


def shared_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment by default) without pytest's per-test
    variable."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k != PER_TEST_VARIABLE}
