"""``concurrently``: calls run at once, and none outlives the call that ran them."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.bus.tasks import concurrently


class Boom(RuntimeError):
    pass


async def test_results_come_in_order() -> None:
    async def after(steps: int, value: int) -> int:
        for _ in range(steps):
            await asyncio.sleep(0)
        return value

    # The first call finishes last, the second first.
    assert await concurrently([after(3, 1), after(0, 2), after(1, 3)]) == [1, 2, 3]
    assert await concurrently([]) == []


async def test_the_first_failure_cancels_the_rest_and_is_raised_once_they_finished() -> None:
    started, finished = asyncio.Event(), []

    async def slow(name: str) -> None:
        try:
            started.set()
            await asyncio.Event().wait()  # a write still on its way
        finally:
            await asyncio.sleep(0)  # winding down takes a step of its own
            finished.append(name)

    async def fails() -> None:
        await started.wait()
        raise Boom("the write that failed")

    with pytest.raises(Boom, match="the write that failed") as raised:
        await concurrently([slow("a"), fails(), slow("b")])
    assert sorted(finished) == ["a", "b"]  # none left running
    assert not isinstance(raised.value, BaseExceptionGroup)


async def test_cancelling_the_caller_cancels_every_call_and_waits_for_them() -> None:
    running, finished = asyncio.Event(), []

    async def slow() -> None:
        try:
            running.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)
            finished.append(True)

    caller = asyncio.create_task(concurrently([slow(), slow()]))
    await running.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished == [True, True]
