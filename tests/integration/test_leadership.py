"""A leader lease on a real bus, as its metrics show it: ``phalanx_leader`` is 1 exactly
while this instance holds the lease."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import Lease
from phalanx.services import metrics
from phalanx.services.deadline import wait_set
from phalanx.services.lease import Leadership


def leader_gauge(key: str) -> float | None:
    return REGISTRY.get_sample_value("phalanx_leader", {"service": key})


async def test_the_leader_gauge_is_one_while_the_lease_is_held_and_zero_after(
        bus: Bus, uid: str) -> None:
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    key = f"gauge-{uid}"
    leading, ended, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def lead() -> None:
        leading.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    # What a leader service's shell does at start: the test must not rely on one having
    # started earlier in this process.
    metrics.register(metrics.LEADERSHIP)
    leadership = Leadership(leases, key, "a", 3.0, lead)
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
