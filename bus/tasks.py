"""Running several bus calls at once, none of which outlives the call that made them.

``asyncio.gather`` raises the first failure at once and leaves the other awaitables
running, unowned. For writes that is wrong: a leader whose pass failed (one write
timed out through an overloaded server, or lost a compare-and-swap) steps down, and
the next term — of this instance or another — restores from what is stored, while the
failed pass's other writes go on landing after it. A :meth:`~.kv.TypedKV.modify` among
them even re-reads and re-applies its old decision when the new term has written the
key meanwhile (an admitted job record over the new leader's requeue, with no placement
behind it). :func:`concurrently` cancels the rest on the first failure and returns only
once every one has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def concurrently(calls: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``calls`` at once; their results, in order.

    The first to fail cancels the others, and its exception is raised as it is (not in
    an exception group) once all of them have finished; cancelling the caller cancels
    them all the same way. So when this returns or raises, none of ``calls`` runs on.
    """
    failure: BaseException | None = None
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as errors:
        failure = errors.exceptions[0]
        while isinstance(failure, BaseExceptionGroup):
            failure = failure.exceptions[0]
    if failure is not None:
        raise failure  # outside the except clause: the exception keeps its own context
    return [task.result() for task in tasks]
