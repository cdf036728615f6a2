"""What the health leader decided, carried out: actions first, state writes behind them.

The core decides in memory; the shell must then act on the bus (publish a fault, a
node's condition, end a job's record) and store what a successor needs (each job's
snapshot, its progress record, the stream cursor). Both are round trips to the
server. Done in one line, a storm of rank exits puts every fault behind the snapshot
writes of the exits before it (suspected, not yet measured, as the cause of the 924 ms
crash -> fault p99 at 200 simulated nodes in bench/scale.py).

So there are two lanes. **Actions** go out one at a time in the order decided.
**Writes** wait only for the actions decided before them — a stored snapshot never
reflects an event whose fault is not out yet, so a successor restoring it cannot
miss that fault — and are *coalesced per key*: a job's snapshot still waiting is
replaced by a newer one in its place in line (the newer reflects every event the
older did), so a storm costs one write per job, not one per exit. Writes run in the
order their keys first joined the line; a key that must not be merged (each cursor
position, written after the snapshots before it) is given a key of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import TypeVar

Work = Callable[[], Awaitable[object]]  # its result is not used
T = TypeVar("T")


class Outbox:
    """Two lanes of work for one term of leadership; :meth:`run` carries them out."""

    def __init__(self) -> None:
        self._actions: asyncio.Queue[Work] = asyncio.Queue()
        self._decided = 0  # actions queued so far
        self._done = 0  # actions carried out so far (in order, so the first _done of them)
        self._progress = asyncio.Condition()
        # key -> (actions it must follow, the write): insertion order is the line
        self._writes: dict[Hashable, tuple[int, Work]] = {}
        self._writes_waiting = asyncio.Event()
        self._writing = 0  # writes popped from the line and under way

    def act(self, work: Work) -> None:
        """Queue an action (after every action queued before it)."""
        self._decided += 1
        self._actions.put_nowait(work)

    def write(self, key: Hashable, work: Work) -> None:
        """Queue a write for after the actions queued so far; a write of ``key`` still
        waiting is replaced by this one, keeping its place in line."""
        self._writes[key] = (self._decided, work)
        self._writes_waiting.set()

    async def settled(self, make: Callable[[], T]) -> T:
        """``make()``, run once every action decided so far is carried out: a state read
        then reflects no decision still to go out (a write that reads its state when its
        turn comes, not when it was queued)."""
        async with self._progress:
            await self._progress.wait_for(lambda: self._done >= self._decided)
            return make()

    @property
    def pending(self) -> tuple[int, int]:
        """Actions and writes not yet carried out (or under way)."""
        return self._decided - self._done, len(self._writes) + self._writing

    async def idle(self) -> None:
        """Return once everything queued so far, and since, is carried out."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.pending == (0, 0))

    async def run(self) -> None:
        """Carry out both lanes until cancelled; an error in any work ends it (raised)."""
        async with asyncio.TaskGroup() as lanes:
            lanes.create_task(self._run_actions())
            lanes.create_task(self._run_writes())

    async def _run_actions(self) -> None:
        while True:
            work = await self._actions.get()
            await work()
            async with self._progress:
                self._done += 1
                self._progress.notify_all()

    async def _run_writes(self) -> None:
        while True:
            while not self._writes:
                self._writes_waiting.clear()
                await self._writes_waiting.wait()
            key = next(iter(self._writes))
            # The write may be replaced while it waits, by one that must follow more actions.
            async with self._progress:
                while self._done < self._writes[key][0]:
                    await self._progress.wait()
            _, work = self._writes.pop(key)
            self._writing += 1
            try:
                await work()
            finally:
                self._writing -= 1
            async with self._progress:
                self._progress.notify_all()
