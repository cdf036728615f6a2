"""A deadline never loses a cancellation (Python 3.11's ``asyncio.wait_for`` can)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from phalanx.services.deadline import wait_set

ROOT = Path(__file__).resolve().parents[3]


async def test_the_event_set_as_the_waiter_is_cancelled_still_cancels_it() -> None:
    """The race that kept a cancelled health leader's timer looping: the event it waits
    on is set in the same loop iteration as its task is cancelled."""
    event = asyncio.Event()
    loops = 0

    async def timer() -> None:
        nonlocal loops
        while loops < 3:  # as a leader's timer: wake, recompute, wait again
            await wait_set(event, 0.01)
            event.clear()
            loops += 1

    task = asyncio.create_task(timer())
    await asyncio.sleep(0)  # the timer waits
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loops == 0


async def test_wait_set_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_set(event, 30.0) is True


def test_no_service_runtime_or_bus_module_calls_asyncio_wait_for() -> None:
    """The whole class: every deadline there is an ``asyncio.timeout`` (or wait_set)."""
    calls = []
    for package in ("services", "runtime", "bus"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "wait_for" \
                        and isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []
