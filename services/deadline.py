"""Waiting with a deadline without losing a cancellation.

On Python 3.11, ``asyncio.wait_for`` returns normally when what it awaits finishes in
the same loop iteration as the waiting task is cancelled: the cancellation is lost. A
loop that waits that way (a leader's timer, a service's periodic tick) then runs on
after its term was cancelled, and whatever waits for it to end waits forever — seen
as a fuzz run whose services never finished stopping, the health leader's timer
looping under a cancelled task. ``asyncio.timeout`` has no such window: the task is
cancelled in place and a cancellation it did not make itself always propagates. Every
deadline in the services and the bus layer is therefore an ``asyncio.timeout``; this
module holds the one shape that recurs.
"""

from __future__ import annotations

import asyncio
import contextlib


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` has passed; True if it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()
