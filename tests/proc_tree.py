"""The machine's processes as /proc shows them: who is whose child, and a poll until
something holds (a process tree changes without any event to subscribe to)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any


def children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


async def until(check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true (a /proc scan or a log file: there
    is nothing to subscribe to); fails after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.05)):
        if found := check():
            return found
        await asyncio.sleep(0.05)
    raise TimeoutError(f"nothing found in {timeout_s} s")
