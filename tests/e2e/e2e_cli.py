"""Helpers of the end-to-end tests: the ``phalanx`` command line as a user runs it, and
waiting for the bus event a test expects."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from process_env import shared_environment


def phalanx(*args: str, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``phalanx ARGS`` in a fresh interpreter; asserts success unless ``check=False``."""
    # The test's own name left out: the clusters of a test process share a zygote template.
    env = shared_environment(env)
    result = subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args],
                            capture_output=True, text=True, timeout=60, env=env)
    if check:
        assert result.returncode == 0, result.stderr
    return result


async def next_of(queue: asyncio.Queue, predicate: Callable[[Any], bool],
                  timeout_s: float = 30.0) -> Any:
    """The next item of ``queue`` that satisfies ``predicate`` (others are dropped)."""
    async def scan() -> Any:
        while True:
            item = await queue.get()
            if predicate(item):
                return item

    return await asyncio.wait_for(scan(), timeout_s)
