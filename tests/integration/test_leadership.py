"""A leader lease on a real bus, as its metrics show it: ``phalanx_leader`` is 1 exactly
while this instance holds the lease."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

from prometheus_client import REGISTRY

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import Lease
from phalanx.services import metrics
from phalanx.services.deadline import wait_set
from phalanx.services.lease import ACTS_FOR, Leadership
from phalanx.services.natsd import NatsServer


def leader_gauge(key: str) -> float | None:
    return REGISTRY.get_sample_value("phalanx_leader", {"service": key})


def waiting_term() -> tuple[asyncio.Event, asyncio.Event, Callable[[], Awaitable[None]]]:
    """A leader's work that only waits, and events set as it starts and as it ends."""
    leading, ended = asyncio.Event(), asyncio.Event()

    async def lead() -> None:
        leading.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    return leading, ended, lead


async def test_the_leader_gauge_is_one_while_the_lease_is_held_and_zero_after(
        bus: Bus, uid: str) -> None:
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    key = f"gauge-{uid}"
    leading, ended, lead = waiting_term()
    stop = asyncio.Event()

    # What a leader service's shell does at start: the test must not rely on one having
    # started earlier in this process.
    metrics.register(metrics.LEADERSHIP)
    leadership = Leadership(leases, key, "a", 3.0, lead, bus_config=bus.config)
    assert leader_gauge(key) == 0  # a standby shows 0, not nothing
    running = asyncio.create_task(leadership.run(lambda s: wait_set(stop, s)))
    try:
        assert await wait_set(leading, 10)
        assert leader_gauge(key) == 1
        # Another instance takes the lease over: the next renewal finds it gone.
        current, revision = await leases.current(key)
        assert current is not None
        await leases.update(key, Lease(holder="b", epoch=current.epoch + 1,
                                       expires_at=current.expires_at + 60), revision)
        assert await wait_set(ended, 10)
        assert leader_gauge(key) == 0
    finally:
        stop.set()
        await running
    assert leader_gauge(key) == 0


async def test_a_lease_is_judged_by_the_standbys_own_clock_never_the_holders(
        bus: Bus, uid: str) -> None:
    """A live holder stamping an hour behind keeps its lease; a dead one that stamped
    an hour ahead loses it after a lease's length of watching, not after the hour."""
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    key = f"clocks-{uid}"
    lease_s = 2.0  # far above any stall of this test's renewals on a loaded machine
    leading, stop = asyncio.Event(), asyncio.Event()

    async def lead() -> None:
        leading.set()
        await asyncio.Event().wait()

    metrics.register(metrics.LEADERSHIP)
    revision = await leases.create(key, Lease(holder="behind", epoch=1, expires_at=1.0))
    standby = Leadership(leases, key, "standby", lease_s, lead,
                         bus_config=bus.config)
    running = asyncio.create_task(standby.run(lambda s: wait_set(stop, s)))
    try:
        for _ in range(int(1.5 * lease_s / 0.1)):  # renewed: its stamps long expired
            await asyncio.sleep(0.1)
            revision = await leases.update(key, Lease(holder="behind", epoch=1,
                                                      expires_at=1.0), revision)
            assert not leading.is_set()
        # It dies, having stamped its last renewal an hour ahead of the standby's clock.
        await leases.update(key, Lease(holder="behind", epoch=1,
                                       expires_at=time.time() + 3600), revision)
        assert await wait_set(leading, 5 * lease_s)
        current, _ = await leases.current(key)
        assert current is not None and (current.holder, current.epoch) == ("standby", 2)
    finally:
        stop.set()
        await running


async def test_a_leader_whose_renewals_go_unanswered_stops_before_a_standby_may_take(
        own_nats: NatsServer, uid: str) -> None:
    """The server stops answering (SIGSTOP): the leader's renewal hangs, and its work is
    cancelled ``lease_s * 2 / 3`` after it sent its last confirmed renewal, long before
    the retries of that renewal give up (15 s) and before a standby could take over
    (``lease_s``). Answered again, it finds the lease still its own and leads again."""
    lease_s = 1.5
    async with await Bus.connect(BusConfig.load(env={}, servers=[own_nats.url]),
                                 name="test") as bus:
        leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
        terms = [asyncio.Event(), asyncio.Event()]  # set as the first and second start
        gone = asyncio.Event()
        ended: list[float] = []

        async def lead() -> None:
            next(t for t in terms if not t.is_set()).set()
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(time.monotonic())
                gone.set()

        leadership = Leadership(leases, f"cut-{uid}", "a", lease_s, lead,
                                bus_config=bus.config)
        stop = asyncio.Event()
        running = asyncio.create_task(leadership.run(lambda s: wait_set(stop, s)))
        assert own_nats.process is not None
        try:
            assert await wait_set(terms[0], 10)
            await asyncio.sleep(lease_s)  # a few renewals confirmed
            os.kill(own_nats.process.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                await wait_set(gone, 5 * lease_s)
                deadline = leadership.acts_until
            finally:
                os.kill(own_nats.process.pid, signal.SIGCONT)
            assert ended, "the leader went on acting with its renewals unanswered"
            # Its last confirmed renewal was sent before the stop: it stopped within 2/3
            # of a lease of the stop (and of that renewal), plus the timer's wake-up.
            assert ended[0] - stopped_at <= lease_s * ACTS_FOR + 0.3, ended[0] - stopped_at
            assert ended[0] - deadline <= 0.3 and leadership.deposals == 1
            assert not leadership.leading
            # Answered again: the lease is still its own, and it leads again.
            assert await wait_set(terms[1], 10 * lease_s) and leadership.leading
        finally:
            stop.set()
            await running


def hold_the_loop(seconds: float) -> None:
    """What a long restore does to its event loop: compute without awaiting."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def test_a_leader_whose_own_work_holds_its_loop_keeps_its_lease(
        bus: Bus, uid: str) -> None:
    """A restore holds the loop a whole lease at a time, longer than a leader acts after a
    renewal (``lease_s * 2 / 3``): its renewals go on from their own thread, so the term
    is neither deposed nor cancelled. Renewed from the loop (before), the first hold
    deposed it, and every term after restored again and was deposed again."""
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    lease_s = 1.0
    restored, stop = asyncio.Event(), asyncio.Event()
    cancelled: list[bool] = []

    async def lead() -> None:
        try:
            for _ in range(3):
                hold_the_loop(lease_s)
                await asyncio.sleep(0)  # a chunk done: the loop turns once
            restored.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    metrics.register(metrics.LEADERSHIP)
    leadership = Leadership(leases, f"busy-{uid}", "a", lease_s, lead,
                            bus_config=bus.config)
    running = asyncio.create_task(leadership.run(lambda s: wait_set(stop, s)))
    try:
        assert await wait_set(restored, 20)
        assert leadership.deposals == 0 and not cancelled
        assert leadership.leading and leadership.epoch == 1
        current, _ = await leases.current(f"busy-{uid}")
        assert current is not None and (current.holder, current.epoch) == ("a", 1)
    finally:
        stop.set()
        await running


async def test_a_leader_whose_loop_hangs_stops_renewing_and_is_deposed(
        bus: Bus, uid: str) -> None:
    """A loop that has not turned for ``hung_s`` is hung: the thread renews no more, and
    once the loop turns again the term is deposed (a standby has meanwhile been free to
    take the lease a lease after the last renewal)."""
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    lease_s, hung_s = 1.0, 0.5
    leading, ended, lead = waiting_term()
    stop = asyncio.Event()

    metrics.register(metrics.LEADERSHIP)
    leadership = Leadership(leases, f"hung-{uid}", "a", lease_s, lead,
                            bus_config=bus.config, hung_s=hung_s)
    running = asyncio.create_task(leadership.run(lambda s: wait_set(stop, s)))
    try:
        assert await wait_set(leading, 10)
        held_from = time.monotonic()
        hold_the_loop(hung_s + lease_s * 1.5)
        # Renewals stopped about hung_s into the hold: the term ended well before its end.
        assert leadership.acts_until < held_from + hung_s + lease_s
        assert await wait_set(ended, 5) and leadership.deposals == 1
    finally:
        stop.set()
        await running


async def test_a_leader_on_a_minority_server_stands_down_and_takes_no_term_there(
        bus: Bus, uid: str) -> None:
    """Its connection judged cut from the cluster's majority (``Bus.in_majority``), a
    leader stops at its next check and takes no term, its own lease free for it and
    every write answered (a lone server stands in for the minority's), until its
    connection is in the majority again. Before, it acted on, and once deposed took the
    lease back term after term (issue 53)."""
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    lease_s = 1.5
    leading, ended, lead = waiting_term()
    majority = [True]
    stop = asyncio.Event()

    metrics.register(metrics.LEADERSHIP)
    leadership = Leadership(leases, f"minority-{uid}", "a", lease_s, lead,
                            bus_config=bus.config, in_majority=lambda: majority[0])
    running = asyncio.create_task(leadership.run(lambda s: wait_set(stop, s)))
    try:
        assert await wait_set(leading, 10) and leadership.epoch == 1
        leading.clear()
        majority[0] = False
        assert await wait_set(ended, lease_s), "it acted on from the minority"
        assert leadership.deposals == 0  # it stood down; no deadline passed
        # Its renewals are answered and the lease is its own: still it takes no term.
        assert not await wait_set(leading, 3 * lease_s)
        assert not leadership.leading and leadership.epoch == 1
        majority[0] = True
        assert await wait_set(leading, lease_s) and leadership.epoch == 2
    finally:
        stop.set()
        await running
