"""The checkpoint service places buddies over a real nats-server: every live node of the
registry gets a BuddyPlacement in another failure domain in ``phalanx_buddies``; a node
that falls silent loses its placement and its wards are re-placed; a new leader takes the
placements back as they were: a node coming back is placed beside them, and none of them
is rewritten.

No agents: the test writes the node records (heartbeats) itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import BuddyPlacement, BuddyReason, NodeInfo, NodeRecord
from phalanx.services.checkpoint.service import CheckpointService
from phalanx.services.natsd import NatsServer

DOMAINS = {"n0": "d0", "n1": "d1", "n2": "d0", "n3": "d1"}


@contextlib.asynccontextmanager
async def beating(nodes: TypedKV[NodeRecord], alive: set[str]) -> AsyncIterator[None]:
    """Refresh the records of the nodes in ``alive`` (a set the test may change) every
    0.1 s, as their agents would."""

    async def beat() -> None:
        while True:
            for node in sorted(alive):
                await nodes.put(node, NodeRecord(
                    node=NodeInfo(node_id=node, host="h", slots=2,
                                  failure_domain=DOMAINS[node], replica_port=7000),
                    heartbeat_at=time.time()))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def placed(buddies: TypedKV[BuddyPlacement], wanted) -> dict[str, BuddyPlacement]:
    """The placements once ``wanted(placements)`` holds (read at every change)."""
    async with asyncio.timeout(30):
        current: dict[str, BuddyPlacement] = {}
        async for change in buddies.watch():
            if change is not None and change.value is None:
                current.pop(change.key, None)
            elif change is not None:
                current[change.key] = change.value
            if wanted(current):
                return current
    raise AssertionError("the watch ended")


async def test_buddies_are_placed_across_domains_replaced_and_restored(
        own_nats: NatsServer) -> None:
    """(Its own server: no other test's nodes in the registry.)"""
    bus_config = BusConfig.load(env={}, servers=[own_nats.url])
    async with await Bus.connect(bus_config) as bus:
        await placing(bus, bus_config)


async def placing(bus: Bus, bus_config: BusConfig) -> None:
    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    buddies = await TypedKV.open(bus.js, subjects.BUDDIES_BUCKET, BuddyPlacement)
    alive = set(DOMAINS)
    async with beating(nodes, alive):
        service = CheckpointService(bus_config, instance="ckpt-a", lease_s=1.0,
                                    lost_after_s=1.0)
        await service.start()
        try:
            first = await placed(buddies, lambda p: p.keys() == set(DOMAINS))
            assert {n: p.buddy_id for n, p in first.items()} == {
                "n0": "n1", "n1": "n0", "n2": "n3", "n3": "n2"}
            alive.discard("n1")  # n1 falls silent: n0 needs another buddy in d1
            second = await placed(buddies, lambda p: "n1" not in p and p["n0"].buddy_id != "n1")
            assert second["n0"].buddy_id == "n3" and second["n0"].reason is \
                BuddyReason.BUDDY_LOST
            assert {n: p.buddy_id for n, p in second.items() if n != "n0"} == {
                "n2": "n3", "n3": "n2"}  # the others stay where they were
        finally:
            await service.stop()
        revisions = {e.key: e.revision for e in (await buddies.entries())[0]}
        successor = CheckpointService(bus_config, instance="ckpt-b", lease_s=1.0,
                                      lost_after_s=1.0)
        await successor.start()
        try:
            alive.add("n1")  # back: placed beside the restored placements (n0 has no ward)
            third = await placed(buddies, lambda p: "n1" in p)
        finally:
            await successor.stop()
        assert third["n1"].buddy_id == "n0"
        # A leader that started afresh would have moved n0 back to n1; this one kept it.
        assert {n: p for n, p in third.items() if n != "n1"} == second
        assert {e.key: e.revision for e in (await buddies.entries())[0]
                if e.key != "n1"} == revisions
