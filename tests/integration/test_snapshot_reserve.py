"""A rank's snapshot buffers asked of its node's agent (:class:`~phalanx.runtime.snapshot.
Snapshotter`), on a real nats-server: an agent that does not answer is asked again a
moment later, not once a membership."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.runtime.bus_thread import BusThread
from phalanx.runtime.snapshot import RESERVE_RETRY_S, Snapshotter
from phalanx.runtime.snapshot_interval import IntervalPolicy, SnapshotSchedule
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode, encode
from phalanx.schemas.messages import SnapshotReservation, SnapshotReserve
from phalanx.services.agent.snapshots import SnapshotStore


async def test_an_agent_down_at_the_reservation_is_asked_again_once_it_is_back(
        bus: Bus, bus_config: BusConfig, uid: str, tmp_path: Path) -> None:
    """A generation's first snapshot came while the agent restarted: the whole generation
    went without snapshots (176 steps in a chaos run), and a fault then restored a step
    that old."""
    node, job = f"{uid}-n", f"{uid}-job"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    now = [100.0]
    thread = BusThread(bus_config, f"test-{uid}").start()
    snapshots = Snapshotter(thread, job, "r0-0", node,
                            schedule=SnapshotSchedule(IntervalPolicy(every=1)),
                            clock=lambda: now[0])
    store = SnapshotStore(tmp_path / "store", limit=1 << 20)
    asked: list[SnapshotReserve] = []

    async def reserve(msg) -> None:  # the agent's endpoint, as it answers a rank of its own
        request = decode(msg.data, SnapshotReserve)
        asked.append(request)
        paths = store.reserve(request)
        await msg.respond(encode(SnapshotReservation(node_id=node,
                                                     paths=[str(p) for p in paths])))

    async def take(step: int) -> bool:  # the training thread's call; the agent runs here
        return await asyncio.to_thread(snapshots.take, model, optimizer, {}, step, 0, 0, 1)

    try:
        # No agent listens on the node yet: no snapshot, and no refusal for the generation.
        assert not await take(1)
        await bus.nc.subscribe(subjects.agent_snapshot(node), cb=reserve)
        await bus.nc.flush()
        # Back, but not asked again at once: a snapshot a step would be a request a step.
        assert not await take(2)
        assert asked == []
        now[0] += RESERVE_RETRY_S
        assert await take(3)  # the same generation
        assert [(a.job_id, a.shards) for a in asked] == [(job, 1)]
        assert sorted(p.name for p in store.job_dir(job).iterdir()) == ["w1-s0.0", "w1-s0.1"]
    finally:
        thread.close()
