"""``concurrently``: calls run at once, and none outlives the call that ran them."""

from __future__ import annotations

import asyncio

import pytest

from phalanx.bus.tasks import concurrently, within


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


async def test_a_failure_leaves_the_caller_not_cancelled() -> None:
    """Python 3.11's TaskGroup cancels its caller to stop at a failure and leaves that
    request standing: the caller's next bus call raised CancelledError for it."""
    async def fails(i: int) -> None:
        await asyncio.sleep(0)
        raise Boom(f"call {i}")

    caller = asyncio.current_task()
    assert caller is not None and caller.cancelling() == 0
    with pytest.raises(Boom):
        await concurrently(fails(i) for i in range(3))
    assert caller.cancelling() == 0
    await asyncio.sleep(0)  # and it goes on


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


async def test_within_returns_the_result_or_the_calls_own_error_in_time() -> None:
    async def after(value: int) -> int:
        await asyncio.sleep(0)
        return value

    async def fails() -> None:
        raise Boom("refused")

    assert await within(after(7), 1.0) == 7
    with pytest.raises(Boom, match="refused"):
        await within(fails(), 1.0)


async def test_within_cancels_again_a_call_that_swallows_its_cancellation() -> None:
    swallowed = 0

    async def retries_forever() -> None:  # as nats-py's connect loop does
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 3:
                    raise

    with pytest.raises(TimeoutError, match="not done within 0.01 s"):
        await within(retries_forever(), 0.01)
    assert swallowed == 3


async def test_within_cancelled_returns_once_its_call_ended() -> None:
    started, ended = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    waiting = asyncio.ensure_future(within(slow(), 3600))
    await started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ended.is_set()
