"""Property test of admission's stored ledger: no slot is ever given twice.

Several instances of :class:`~phalanx.services.admission.store.LedgerStore` share one
bucket on the real nats-server, each with its own view, as leaders of successive
(or, for a while, overlapping) terms do: each one decides from what it knows, plans
with :func:`~phalanx.services.admission.ledger.plan` and makes the plan's writes one
at a time, interleaved with the others' writes, crashes (its remaining writes never
made) and restarts (it reads the ledger and repairs it, as a new leader does). An
instance whose write conflicts stops acting, as the leader steps down.

After every single write the stored ledger is read whole and must hold: no node's
claims exceed its slots, and every placement holds only slots its nodes' claims give
it — so no slot is in two placements. And an instance that finished its writes while
nobody else wrote since restores, from a fresh read, exactly the placements it had.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nats.js.api import StorageType

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas.messages import JobPlacement, Lease
from phalanx.services.admission import ledger
from phalanx.services.admission.store import LedgerStore
from phalanx.services.lease import LeadershipLost
from phalanx.services.natsd import NatsServer

NODES = {"n0": 2, "n1": 2, "n2": 3}
JOBS = [f"j{i}" for i in range(6)]
INSTANCES = 3

instance = st.integers(0, INSTANCES - 1)
step = st.tuples(st.just("step"), instance)
operations = st.lists(st.one_of(
    st.tuples(st.just("decide"), instance, st.sampled_from(JOBS), st.integers(0, 2**16)),
    step, step, step, step,
    st.tuples(st.just("crash"), instance),
    st.tuples(st.just("restart"), instance),
), min_size=1, max_size=60)


def _placement(nodes: list[str]) -> JobPlacement:
    return JobPlacement(team="t", slots_per_replica=1, nodes=nodes)


class Instance:
    """One admission instance: a store, the placements its core holds, its pending writes."""

    def __init__(self, store: LedgerStore) -> None:
        self.store = store
        self.view: dict[str, list[str]] = {}
        self.pending: list[list] = []  # phases of writes still to make

    def used(self) -> Counter[str]:
        return Counter(node for nodes in self.view.values() for node in nodes)

    def queue(self, after: dict[str, JobPlacement | None], repair: ledger.Restored | None = None
              ) -> None:
        plan = ledger.plan(self.store.stored, self.store.claims, after,
                           dirty=repair.dirty if repair else (),
                           fence=repair.fence if repair else ())
        self.pending = [phase for phase in self.store.phases(plan) if phase]

    async def restart(self) -> None:
        """Read the ledger and queue its repair, as a new leader's first pass does."""
        await self.store.load()
        repair = ledger.restore(self.store.stored, self.store.claims)
        used: Counter[str] = Counter()
        for job, placement in sorted(repair.placements.items()):
            need = Counter(placement.nodes)
            if all(used[node] + count <= NODES[node] for node, count in need.items()):
                self.view[job] = list(placement.nodes)  # the core restores what fits
                used.update(need)
        repairs = set(repair.fence) | self.store.unreadable | set(self.store.stored)
        for node in repair.dirty:
            repairs.update(self.store.claims.get(node, {}))
            repairs.update(j for j, p in self.store.stored.items() if node in p.nodes)
        self.queue({job: _placement(self.view.get(job, [])) for job in repairs}, repair)

    def decide(self, job: str, seed: int) -> None:
        """Change ``job``'s placement within what this instance believes is free."""
        rng = random.Random(seed)
        kind = rng.choice(["place", "place", "requeue", "end"])
        self.view.pop(job, None)
        if kind == "end":
            self.queue({job: None})
            return
        nodes: list[str] = []
        if kind == "place":
            free = Counter({node: slots for node, slots in NODES.items()})
            free.subtract(self.used())
            for _ in range(rng.randint(1, 3)):
                choices = [node for node in sorted(NODES) if free[node] > 0]
                if not choices:
                    break
                node = rng.choice(choices)
                free[node] -= 1
                nodes.append(node)
        if nodes:
            self.view[job] = nodes
        self.queue({job: _placement(nodes)})


def _check(store: LedgerStore) -> None:
    for node, held in store.claims.items():
        assert sum(held.values()) <= NODES[node], f"{node} over-claimed: {held}"
    in_placements: Counter[str] = Counter()
    for job, placement in store.stored.items():
        for node, slots in ledger.slots_by_node(placement).items():
            assert slots <= store.claims.get(node, {}).get(job, 0), (
                f"{job} holds {slots} slot(s) on {node} beyond its claims {store.claims}")
            in_placements[node] += slots
    assert all(in_placements[node] <= NODES[node] for node in in_placements), in_placements


async def _run(url: str, ops: list[tuple]) -> None:
    async with await Bus.connect(BusConfig.load(env={}, servers=[url]), name="ledger") as bus:
        bucket = f"ledger_{uuid.uuid4().hex[:10]}"
        kv = (await TypedKV.open(bus.js, bucket, Lease, storage=StorageType.MEMORY)).kv
        try:
            instances: list[Instance | None] = [Instance(LedgerStore(kv, bucket))
                                                for _ in range(INSTANCES)]
            checker = LedgerStore(kv, bucket)
            last_writer: int | None = None
            writers: set[int] = set()  # every instance (incarnation) that wrote
            for op in ops:
                i = op[1]
                instance = instances[i]
                if op[0] == "restart":
                    instances[i] = instance = Instance(LedgerStore(kv, bucket))
                    await instance.restart()
                elif op[0] == "crash":
                    instances[i] = None
                elif instance is None:
                    continue
                elif op[0] == "decide" and not instance.pending:
                    instance.decide(op[2], op[3])
                elif op[0] == "step" and instance.pending:
                    write = instance.pending[0].pop(0)
                    if not instance.pending[0]:
                        instance.pending.pop(0)
                    try:
                        await write()
                    except LeadershipLost:
                        instances[i] = None  # steps down: acts no more
                    last_writer = i
                    writers.add(id(instance))
                    await checker.load()
                    _check(checker)
            # An instance that made all its writes, with nobody writing after it, is
            # restored exactly by a fresh read; with nobody else writing ever, the ledger
            # needs no repair either.
            done = instances[last_writer] if last_writer is not None else None
            if done is not None and not done.pending:
                fresh = Instance(LedgerStore(kv, bucket))
                await fresh.restart()
                assert fresh.view == done.view
                assert not fresh.pending or len(writers) > 1, "a clean ledger was repaired"
        finally:
            await bus.js.delete_key_value(bucket)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(operations)
# A leader claimed a slot and had yet to commit its placement when a new leader read the
# ledger and released the claim: without the fence, the old leader's commit then lands
# on a slot no claim holds.
@example([("decide", 0, "j0", 2), ("step", 0), ("restart", 1), ("step", 1), ("step", 1),
          ("step", 0)])
def test_no_slot_is_ever_given_twice(nats_server: NatsServer, ops: list[tuple]) -> None:
    asyncio.run(_run(nats_server.url, ops))
