"""A node's GPU health on a node without NVML (a fault injected names a CPU slot): what a
fault cordons and kills, what the registry is asked to store, and which cordons a launch
avoids. No NVML, no process, no bus: the agent's callbacks are recorded."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from phalanx.schemas.messages import GpuFaultKind, NodeInfo, NodeRecord
from phalanx.services.agent.gpu_health import GpuHealth
from phalanx.services.agent.nvml import GpuWatch
from phalanx.services.agent.ranks import Rank

NODE = NodeInfo(node_id="n1", host="h", slots=4, failure_domain="r", agent_pid=1)
SLOT_2_LOST = "GPU lost (fallen off the bus or unreachable) on slot 2 (a CPU slot: no GPU " \
    "seen here), injected by phalanx chaos"


class Agent:
    """What the agent gives its GPU health: its stored record, the registry, its ranks."""

    def __init__(self, stored: dict[int, str] | None = None,
                 registry: dict[int, str] | None = None) -> None:
        self.stored = NodeRecord(node=NODE, cordoned_slots=stored or {})
        self.registry = registry
        self.reads = 0
        self.killed: list[tuple[tuple[int, ...], str]] = []
        self.writes = 0
        self.health = GpuHealth(GpuWatch(None), (), 4, stored=lambda: self.stored,
                                read=self.read, kill=self.kill, write=self.write)

    async def read(self) -> NodeRecord | None:
        self.reads += 1
        if self.registry is None:
            raise TimeoutError("the registry did not answer")
        return NodeRecord(node=NODE, cordoned_slots=self.registry)

    def kill(self, slots: Collection[int], why: str, _seen_at: float) -> Sequence[Rank]:
        self.killed.append((tuple(slots), why))
        return [Rank("j", 2, 4, ("n1",) * 4, pid=42, ticks=None, grace_s=1.0, slots=1,
                     replica_id="r2-0", node_slots=(2,))] if 2 in slots else []

    async def write(self) -> None:
        self.writes += 1


async def test_a_fault_cordons_its_slot_kills_its_rank_and_asks_for_a_write() -> None:
    agent = Agent(stored={0: "Xid 79"})
    done = await agent.health.inject(2, GpuFaultKind.LOST, None)
    assert done == [f"{SLOT_2_LOST}: slot(s) 2 cordoned, killed rank 2 of j (pid 42)"]
    assert agent.killed == [((2,), SLOT_2_LOST)] and agent.writes == 1
    assert agent.health.cordoned == {0: "Xid 79", 2: SLOT_2_LOST}
    agent.health.written([2])  # stored now: the record holds it from here on
    assert agent.health.unstored == {}


async def test_a_slot_cordoned_already_keeps_its_reason_and_a_throttle_is_reported_only(
        ) -> None:
    agent = Agent(stored={2: "Xid 79"})
    await agent.health.inject(2, GpuFaultKind.ECC, None)
    assert agent.health.cordoned == {2: "Xid 79"} and agent.writes == 0
    assert len(agent.killed) == 1  # its rank, if any, is killed all the same
    done = await agent.health.inject(1, GpuFaultKind.THROTTLE, None)
    assert done[0].endswith("(reported, not a fault)") and len(agent.killed) == 1


async def test_a_fault_on_no_such_slot_is_refused_saying_the_slots() -> None:
    agent = Agent()
    with pytest.raises(ValueError, match=r"no GPU and no slot 4 \(slots 0\.\.3\)"):
        await agent.health.inject(4, GpuFaultKind.LOST, None)
    assert agent.killed == []


async def test_a_launch_reads_the_cordons_only_when_some_are_known() -> None:
    none_known = Agent(registry={})
    assert set(await none_known.health.cordoned_now()) == set() and none_known.reads == 0
    # An operator uncordoned slot 0 since the last heartbeat: it counts at once.
    uncordoned = Agent(stored={0: "Xid 79", 3: "ECC"}, registry={3: "ECC"})
    assert set(await uncordoned.health.cordoned_now()) == {3} and uncordoned.reads == 1
    # The registry unreadable: what the agent last knew.
    unreadable = Agent(stored={0: "Xid 79"})
    assert set(await unreadable.health.cordoned_now()) == {0}
