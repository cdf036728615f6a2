"""Seeing the end of a process this agent cannot wait for: one it adopted (started by an
earlier agent) or one forked by a zygote that is gone.

Only a process's parent collects its exit status; anyone may open a *pidfd* on it
(``pidfd_open``, Linux 5.3), which becomes readable when the process ends. The end is
then known, the status is not.
"""

from __future__ import annotations

import asyncio
import os


async def ended(pid: int) -> None:
    """Return once process ``pid`` has ended; at once if none runs under that pid."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    gone = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(fd)
        os.close(fd)
