"""Running bus calls so that none outlives the call that made them: several at once
(:func:`concurrently`), or one with a deadline (:func:`within`).

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
import contextlib
from collections.abc import Awaitable, Coroutine, Iterable
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
    caller = asyncio.current_task()
    cancels = caller.cancelling() if caller is not None else 0
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as errors:
        failure = errors.exceptions[0]
        while isinstance(failure, BaseExceptionGroup):
            failure = failure.exceptions[0]
        # Python 3.11's TaskGroup cancels its caller to stop on a child's failure and
        # leaves that cancellation requested: every later check of it
        # (``raise_if_cancelled``) took the caller for cancelled.
        while caller is not None and caller.cancelling() > cancels:
            caller.uncancel()
    if failure is not None:
        raise failure  # outside the except clause: the exception keeps its own context
    return [task.result() for task in tasks]


async def within(call: Awaitable[T], timeout_s: float) -> T:
    """``await call``, ended (``TimeoutError``) once ``timeout_s`` has passed.

    Unlike ``asyncio.timeout``, which cancels once, the call is cancelled again until it
    ends: nats-py's connect retries its servers in a loop whose ``wait_for`` can swallow
    a cancellation (:func:`~.client.raise_if_cancelled`), and a refused first
    connection then went on retrying for good on a loaded machine instead of failing at
    its deadline.
    """
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    finally:
        while not task.done():  # out of time, or the caller cancelled: so is the call
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        task.result()  # its own error, if it ended with one before its cancel
    raise TimeoutError(f"not done within {timeout_s:g} s")


def raise_if_cancelled() -> None:
    """Raise the current task's cancellation if nats-py swallowed it.

    nats-py's flush of pending writes catches ``CancelledError`` and returns, and its
    requests wait with ``asyncio.wait_for``, which on Python 3.11 returns the reply
    instead of raising when the reply and the cancellation arrive together. A task
    cancelled then (a leader stepping down mid-write, a service stopping, a watcher
    closed) would carry on and then wait forever. Every call into nats-py is followed
    by this check, so a cancellation always takes effect.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
