"""The admission service over a real nats-server with real agents.

Each test gets its own server, so the shared ledger, lease and job records
start empty; agents are the real AgentService, in-process or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from phalanx.bus.client import Bus, Delivery, raise_for_error
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.codec import encode
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    Lease,
    NodeInfo,
    NodeRecord,
    Placement,
    ReasonCode,
    ReplicaRange,
    RequeueRequest,
    ScaleRequest,
    ScalingEvent,
    ScalingEventKind,
    ScalingPolicy,
)
from phalanx.services import metrics
from phalanx.services.admission import ledger
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.service import AdmissionService
from phalanx.services.admission.store import LedgerStore
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.client import AdmissionClient
from phalanx.services.lease import LeadershipLost
from phalanx.services.natsd import NatsServer


@pytest.fixture
def config(own_nats: NatsServer) -> BusConfig:
    return BusConfig.load(env={}, servers=[own_nats.url])


@pytest.fixture
async def client_bus(config: BusConfig) -> AsyncIterator[Bus]:
    async with await Bus.connect(config, name="test-client") as bus:
        yield bus


async def stored_ledger(bus: Bus) -> LedgerStore:
    """Admission's ledger as stored, read whole."""
    bucket = await TypedKV.open(bus.js, subjects.ADMISSION_BUCKET, Lease)
    store = LedgerStore(bucket.kv, subjects.ADMISSION_BUCKET)
    await store.load()
    return store


async def start_agents(config: BusConfig, slots: int, count: int) -> list[AgentService]:
    agents = []
    for i in range(count):
        agent = AgentService(AgentConfig(node_id=f"node-{i}", slots=slots,
                                         failure_domain=f"d{i}", heartbeat_interval_s=0.2,
                                         lost_after_s=3.0), config)
        await agent.start()
        agents.append(agent)
    return agents


def spec(name: str, replicas: int, *, priority: str = "normal", team: str = "t",
         **fields) -> JobSpec:
    return JobSpec(name=name, team=team, priority_class=priority,
                   replicas=ReplicaRange(min=replicas, max=replicas), command=["true"], **fields)


async def wait_state(bus: Bus, job_id: str, state: JobState, timeout_s: float = 20) -> JobRecord:
    """Wait for ``job_id``'s record to reach ``state`` (KV watch, no polling)."""
    return await wait_record(bus, job_id, lambda record: record.state is state, timeout_s)


async def wait_record(bus: Bus, job_id: str, accept: Callable[[JobRecord], bool],
                      timeout_s: float = 20) -> JobRecord:
    """Wait for a record of ``job_id`` that ``accept`` takes (KV watch, no polling)."""
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)

    async def watch() -> JobRecord:
        async for change in jobs.watch():
            if change is not None and change.key == job_id and change.value is not None \
                    and accept(change.value):
                return change.value
        raise AssertionError("watch ended")

    return await asyncio.wait_for(watch(), timeout_s)


async def test_submit_wait_with_reason_then_admit_on_cancel(config: BusConfig,
                                                            client_bus: Bus) -> None:
    agents = await start_agents(config, slots=2, count=2)
    service = AdmissionService(AdmissionConfig(lease_s=1.0), config, instance="a0")
    await service.start()
    client = AdmissionClient(client_bus)
    events: asyncio.Queue[JobRecord] = asyncio.Queue()

    async def on_state(record: JobRecord, _: Delivery) -> None:
        await events.put(record)

    await client_bus.subscribe(subjects.job_states(), JobRecord, on_state)
    try:
        small = await client.submit(spec("small", 2), "small-1")
        assert small.state is JobState.PENDING
        assert (await wait_state(client_bus, "small-1", JobState.ADMITTED)).nodes
        await client.submit(spec("big", 4), "big-1")
        pending = await client.explain("big-1")
        while pending.reason_code is ReasonCode.QUEUED:  # submitted, pass not yet run
            pending = await client.explain("big-1")
        assert pending.state is JobState.PENDING and pending.position == 1
        assert pending.reason_code is ReasonCode.RESERVED
        assert "needs 4 replica(s) x 1 slot(s) = 4 slots" in pending.reason

        # Retrying the same submit is a no-op; another spec under the same id is refused.
        assert (await client.submit(spec("big", 4), "big-1")).job_id == "big-1"
        with pytest.raises(RemoteError) as conflict:
            await client.submit(spec("big", 3), "big-1")
        assert conflict.value.code == "409"

        cancelled = await client.cancel("small-1")
        assert cancelled.state is JobState.CANCELLED
        admitted = await wait_state(client_bus, "big-1", JobState.ADMITTED)
        assert sorted(admitted.nodes) == ["node-0", "node-0", "node-1", "node-1"]
        seen = []
        while not events.empty():
            seen.append((events.get_nowait().job_id, "x"))
        assert ("big-1", "x") in seen  # state changes were published

        ledger = await stored_ledger(client_bus)
        held = {job: p.nodes for job, p in ledger.stored.items() if p.nodes}
        assert held == {"big-1": admitted.nodes}  # small-1's placement is deleted
        assert ledger.claims == {"node-0": {"big-1": 2}, "node-1": {"big-1": 2}}
    finally:
        await service.stop()
        for agent in agents:
            await agent.stop()


async def test_an_elastic_job_shrunk_by_a_lost_node_grows_back_with_new_slot_numbers(
        config: BusConfig, client_bus: Bus) -> None:
    def agent(node_id: str) -> AgentService:
        return AgentService(AgentConfig(node_id=node_id, slots=2, heartbeat_interval_s=0.2,
                                        lost_after_s=3.0, launch=False), config)

    first, second = agent("node-a"), agent("node-b")
    await first.start()
    await second.start()
    service = AdmissionService(AdmissionConfig(lease_s=1.0), config, instance="a0")
    await service.start()
    third = None
    jobs = await TypedKV.open(client_bus.js, subjects.JOBS_BUCKET, JobRecord)
    changes: asyncio.Queue[JobRecord] = asyncio.Queue()

    async def on_state(record: JobRecord, _: Delivery) -> None:
        await changes.put(record)

    async def next_placement(nodes: list[str]) -> JobRecord:
        while True:
            record = await asyncio.wait_for(changes.get(), 20)
            if record.state is JobState.ADMITTED and sorted(record.nodes) == nodes:
                return record

    await client_bus.subscribe(subjects.job_state("el-1"), JobRecord, on_state)
    try:
        await AdmissionClient(client_bus).submit(JobSpec(
            name="el", team="t", priority_class="normal", replicas=ReplicaRange(min=2, max=4),
            command=["true"]), "el-1")
        full = await next_placement(["node-a", "node-a", "node-b", "node-b"])
        kept = sorted(s for s, n in full.placement().items() if n == "node-a")
        await second.stop()  # node-b leaves: the job keeps node-a's two slots
        shrunk = await next_placement(["node-a", "node-a"])
        assert sorted(shrunk.placement()) == kept
        third = agent("node-c")
        await third.start()
        grown = await next_placement(["node-a", "node-a", "node-c", "node-c"])
        placement = grown.placement()
        assert sorted(s for s, n in placement.items() if n == "node-a") == kept
        assert sorted(s for s, n in placement.items() if n == "node-c") == [4, 5]  # not 2, 3
        assert grown.next_slot == 6
        assert (await jobs.get("el-1")).value == grown
    finally:
        await service.stop()
        for agent_service in (first, third):
            if agent_service is not None:
                await agent_service.stop()


async def test_invalid_specs_are_refused_naming_the_field(config: BusConfig,
                                                          client_bus: Bus) -> None:
    agents = await start_agents(config, slots=2, count=2)
    service = AdmissionService(AdmissionConfig(lease_s=1.0), config, instance="a0")
    await service.start()
    client = AdmissionClient(client_bus)
    try:
        cases = [
            (spec("x", 1, priority="urgent"), "priority_class 'urgent' is not one of"),
            (spec("x", 5), "= 5 slots, but the whole cluster has 4"),
            (spec("x", 1, slots_per_replica=3), "slots_per_replica 3 exceeds every node"),
            (spec("x", 1, ranks_per_replica=3),
             "ranks_per_replica x slots_per_replica = 3 x 1 = 3 slots on one node, but the "
             "largest node has 2"),
        ]
        for bad, message in cases:
            with pytest.raises(RemoteError) as err:
                await client.submit(bad)
            assert err.value.code == "400" and message in err.value.description
        jobs = await client.jobs()
        assert jobs == []  # nothing stored
        with pytest.raises(RemoteError) as missing:
            await client.explain("nope")
        assert missing.value.code == "404"
    finally:
        await service.stop()
        for agent in agents:
            await agent.stop()


async def test_garbage_on_every_admission_subject(config: BusConfig, client_bus: Bus) -> None:
    service = AdmissionService(AdmissionConfig(lease_s=1.0), config, instance="a0")
    await service.start()
    try:
        with pytest.raises(RemoteError, match="404"):  # answered by the leader: it leads
            await AdmissionClient(client_bus).explain("probe")
        for verb in ("submit", "cancel", "explain", "scale"):
            for subject in (f"phalanx.admission.{verb}", subjects.admission_leader(verb)):
                reply = await client_bus.nc.request(subject, b"\x00garbage", timeout=5)
                with pytest.raises(RemoteError) as err:
                    raise_for_error(reply, subject)
                assert err.value.code == "400", (subject, err.value)
        ping = await client_bus.nc.request("$SRV.PING.phalanx-admission", b"", timeout=5)
        assert json.loads(ping.data)["name"] == "phalanx-admission"
    finally:
        await service.stop()


async def test_a_requeue_forwarded_by_a_standby_is_served_by_the_leader(
        config: BusConfig, client_bus: Bus) -> None:
    """A standby forwards every verb to ``phalanx.admission.leader.<verb>``; the leader
    serves requeue there too (it used to serve only submit, cancel and explain, so
    elasticity's requeue reaching a standby went to no one and the job kept its slots)."""
    def agent(node_id: str, slots: int) -> AgentService:
        return AgentService(AgentConfig(node_id=node_id, slots=slots, heartbeat_interval_s=0.2,
                                        launch=False), config)

    first, second = agent("node-0", 2), agent("node-1", 1)
    await first.start()
    instances = [AdmissionService(AdmissionConfig(lease_s=1.0), config, instance=name)
                 for name in ("a0", "a1")]
    for instance in instances:
        await instance.start()
    client = AdmissionClient(client_bus)
    nodes = await TypedKV.open(client_bus.js, subjects.NODES_BUCKET, NodeRecord)
    try:
        await client.submit(spec("runs", 2), "runs-1")
        assert (await wait_state(client_bus, "runs-1", JobState.ADMITTED)).admission == 1
        await client.submit(spec("waits", 1), "waits-1")
        # Cordoned, node-0 keeps its running job but could not take it back once requeued.
        # The leader reads the registry in order: once it admits the waiting job on the
        # node that registers next, it knows of the cordon.
        await nodes.modify("node-0", lambda r: msgspec.structs.replace(r, cordoned=True))
        await second.start()
        assert (await wait_state(client_bus, "waits-1", JobState.ADMITTED)).nodes == ["node-1"]

        reply = await client_bus.request(
            subjects.admission_leader("requeue"),
            RequeueRequest(job_id="runs-1", reason="1 of 2 members left for too long"),
            JobRecord)
        assert reply.job_id == "runs-1"
        requeued = await wait_state(client_bus, "runs-1", JobState.PENDING)
        assert requeued.nodes == [] and requeued.admission == 1
        # Admitted again: its ranks' events then name the second admission.
        await nodes.modify("node-0", lambda r: msgspec.structs.replace(r, cordoned=False))
        assert (await wait_state(client_bus, "runs-1", JobState.ADMITTED)).admission == 2
    finally:
        for instance in instances:
            await instance.stop()
        for agent_service in (first, second):
            await agent_service.stop()


async def test_scale_pins_and_releases_through_the_leader_with_clear_refusals(
        config: BusConfig, client_bus: Bus) -> None:
    """``scale`` is served like the other verbs: by the leader on its subject (where a
    standby forwards it) and on the public one; a pin shrinks at once, a release lets the
    job grow back, each announced on ``phalanx.job.<job>.scaling``; a size its rules do
    not allow, a rigid job, an unknown one and a bad request are refused, saying why."""
    node = AgentService(AgentConfig(node_id="node-0", slots=4, heartbeat_interval_s=0.2,
                                    launch=False), config)
    await node.start()
    instances = [AdmissionService(AdmissionConfig(lease_s=1.0), config, instance=name)
                 for name in ("a0", "a1")]
    for instance in instances:
        await instance.start()
    client = AdmissionClient(client_bus)
    events: asyncio.Queue[ScalingEvent] = asyncio.Queue()

    async def on_event(event: ScalingEvent, _: Delivery) -> None:
        await events.put(event)

    async def next_event() -> tuple[ScalingEventKind, int, int]:
        event = await asyncio.wait_for(events.get(), 20)
        return event.kind, event.from_replicas, event.to_replicas

    await client_bus.subscribe(subjects.job_scaling("el-1"), ScalingEvent, on_event)
    try:
        await client.submit(JobSpec(
            name="el", team="t", priority_class="normal", replicas=ReplicaRange(min=1, max=4),
            scaling=ScalingPolicy(replica_discrete_values=[1, 2, 4]), command=["true"]), "el-1")
        await wait_record(client_bus, "el-1", lambda r: len(r.nodes) == 4)
        await client.submit(spec("rigid", 1), "rigid-1")  # waits: it may not preempt
        with pytest.raises(RemoteError) as rigid:
            await client.scale("rigid-1", 1)
        assert rigid.value.code == "400" and "rigid-1 is rigid: it runs 1 replica(s)" in \
            rigid.value.description
        await client.cancel("rigid-1")
        with pytest.raises(RemoteError) as ended:
            await client.scale("rigid-1", None)
        assert ended.value.code == "409" and "cancelled" in ended.value.description

        pinned = await client.scale("el-1", 2)
        assert pinned.pinned_replicas == 2
        shrunk = await wait_record(client_bus, "el-1", lambda r: len(r.nodes) == 2)
        assert shrunk.reason_code is ReasonCode.SCALED and shrunk.pinned_replicas == 2
        assert await next_event() == (ScalingEventKind.PIN, 4, 2)
        assert await next_event() == (ScalingEventKind.SHRINK, 4, 2)

        for job_id, replicas, code, says in (
                ("el-1", 3, "400", "3 replica(s) is not an allowed size of this job; "
                                   "allowed: 1, 2, 4"),
                ("el-1", 8, "400", "not an allowed size"),
                ("nope", 1, "404", "no job 'nope'")):
            with pytest.raises(RemoteError) as refused:
                await client.scale(job_id, replicas)
            assert refused.value.code == code and says in refused.value.description, \
                refused.value
        with pytest.raises(RemoteError) as bad:  # below 1: the wire type refuses it
            await client_bus.request(subjects.admission_scale(),
                                     ScaleRequest(job_id="el-1", replicas=0), JobRecord)
        assert bad.value.code == "400" and "replicas" in bad.value.description

        # As a standby forwards it: on the leader's subject. The release lets it grow
        # back into the 2 slots it gave up.
        released = await client_bus.request(subjects.admission_leader("scale"),
                                            ScaleRequest(job_id="el-1"), JobRecord)
        assert released.pinned_replicas is None
        assert await next_event() == (ScalingEventKind.RELEASE, 2, 2)
        grown = await wait_record(client_bus, "el-1", lambda r: len(r.nodes) == 4)
        assert grown.pinned_replicas is None
        assert await next_event() == (ScalingEventKind.GROW, 2, 4)
    finally:
        for instance in instances:
            await instance.stop()
        await node.stop()


async def _spawn_admission(url: str, instance: str, logs: Path) -> asyncio.subprocess.Process:
    """An admission instance, its log in ``logs/<instance>.log``."""
    env = {**os.environ, "PHALANX_ADMISSION_LEASE_S": "1.0"}
    with (logs / f"{instance}.log").open("wb") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "phalanx.services.admission", "--nats", url,
            "--instance", instance, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT)


async def heartbeat_nodes(bus: Bus, nodes: list[NodeInfo], stop: asyncio.Event,
                          registered: asyncio.Event, silent: set[str] = frozenset(),
                          clock_off: dict[str, float] | None = None) -> None:
    """Keep registry entries for ``nodes`` fresh (every 0.5 s), as their agents would: the
    big burst needs thousands of slots, and admission reads only the registry. Sets
    ``registered`` once every node has its entry. Nodes in ``silent`` (the caller may
    change it) send nothing meanwhile. A node in ``clock_off`` stamps its heartbeats by
    a clock that many seconds off."""
    clock_off = clock_off or {}
    registry = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    seq = 0
    while not stop.is_set():
        seq += 1
        now = time.time()
        await asyncio.gather(*(registry.put(node.node_id, NodeRecord(
            node=node, heartbeat_seq=seq,
            heartbeat_at=now + clock_off.get(node.node_id, 0.0))) for node in nodes
            if node.node_id not in silent))
        registered.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def admit_one_slot_jobs(bus: Bus, prefix: str, count: int) -> list[str]:
    """Submit ``count`` jobs of one slot and wait until each is admitted; their ids."""
    client = AdmissionClient(bus)
    ids = [f"{prefix}-{i}" for i in range(count)]
    for job_id in ids:
        await client.submit(spec(job_id, 1), job_id)
    for job_id in ids:
        await wait_state(bus, job_id, JobState.ADMITTED)
    return ids


async def record_jobs(bus: Bus) -> tuple[list[JobRecord], asyncio.Task[None]]:
    """Every job record the jobs bucket holds and is written from now on, in order, as a
    watch delivers them; cancel the task to stop."""
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    seen: list[JobRecord] = []

    async def record_all() -> None:
        async for change in jobs.watch():
            if change is not None and change.value is not None:
                seen.append(change.value)

    return seen, asyncio.create_task(record_all())


@contextlib.contextmanager
def heartbeats_elsewhere(config: BusConfig, nodes: list[NodeInfo]) -> Iterator[None]:
    """:func:`heartbeat_nodes` from a thread of its own, on a connection of its own: the
    heartbeats go on while the test's loop (and a service in it) is held up, as the
    agents' would."""
    registered = threading.Event()
    stopping: list[Callable[[], None]] = []  # how the test's thread stops the beats

    async def beat() -> None:
        bus = await Bus.connect(config, name="heartbeats")
        stop, ours = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        stopping.append(lambda: loop.call_soon_threadsafe(stop.set))
        task = asyncio.create_task(heartbeat_nodes(bus, nodes, stop, ours))
        await ours.wait()
        registered.set()
        await task
        await bus.close()

    thread = threading.Thread(target=asyncio.run, args=(beat(),), name="heartbeats")
    thread.start()
    try:
        assert registered.wait(60), "the registry entries were never written"
        yield
    finally:
        if stopping:
            stopping[0]()
        thread.join(10)


@pytest.mark.parametrize("n_jobs", [
    120,
    # Past the old single-value ledger's ceiling: these placements would not fit in one
    # 1 MB record (asserted below). Nodes are registry entries kept fresh by the test.
    # About 15 s on an idle 2-core machine.
    pytest.param(12_000, marks=pytest.mark.timeout(600)),
])
async def test_sigkill_mid_burst_loses_nothing_and_admits_nothing_twice(
        own_nats: NatsServer, config: BusConfig, client_bus: Bus, n_jobs: int,
        tmp_path: Path) -> None:
    big = n_jobs > 1_000
    agents = []
    beats = contextlib.ExitStack()
    slots_per_node, node_count = (128, n_jobs // 128 + 2) if big else (64, 2)
    if big:
        nodes = [NodeInfo(node_id=f"node-{i}", host="h", slots=slots_per_node,
                          failure_domain=f"d{i % 8}") for i in range(node_count)]
        # A burst against a running cluster: the nodes are registered before admission
        # starts (a leader reads the registry whole before it serves). Their heartbeats
        # come from a thread of their own: the burst's 12,000 requests, in this loop,
        # must not starve them into a silence the leaders would rightly judge.
        beats.enter_context(heartbeats_elsewhere(config, nodes))
    else:
        agents = await start_agents(config, slots=slots_per_node, count=node_count)
    first = await _spawn_admission(own_nats.url, "first", tmp_path)
    client = AdmissionClient(client_bus, timeout_s=5.0)
    # Long ids, as generated ones are: they make each placement ~100 bytes.
    ids = [f"burst-job-{i:05d}-{i * 7919 % 10**12:012d}-0123456789abcdef0123456789abcdef"
           for i in range(n_jobs)]
    replied = 0
    half = asyncio.Event()
    gate = asyncio.Semaphore(64 if big else 16)

    async def submit(i: int) -> JobRecord:
        nonlocal replied
        async with gate:
            record = await client.submit(spec(f"j{i}", 1), ids[i], retry_s=120)
        replied += 1
        if replied == n_jobs // 3:
            half.set()
        return record

    second = None
    try:
        burst = asyncio.gather(*(submit(i) for i in range(n_jobs)))
        await asyncio.wait_for(half.wait(), 600)
        first.send_signal(signal.SIGKILL)
        await first.wait()
        second = await _spawn_admission(own_nats.url, "second", tmp_path)
        records = await asyncio.wait_for(burst, 900)
        assert sorted(r.job_id for r in records) == sorted(ids)

        jobs = await TypedKV.open(client_bus.js, subjects.JOBS_BUCKET, JobRecord)

        async def all_admitted() -> dict[str, JobRecord]:
            latest: dict[str, JobRecord] = {}
            admitted = 0
            async for change in jobs.watch():
                if change is not None and change.value is not None:
                    was = latest.get(change.key)
                    admitted -= was is not None and was.state is JobState.ADMITTED
                    latest[change.key] = change.value
                    admitted += change.value.state is JobState.ADMITTED
                if admitted == n_jobs:
                    return latest
            raise AssertionError("watch ended")

        final = await asyncio.wait_for(all_admitted(), 600)
        ledger = await stored_ledger(client_bus)
        placements = {job: p for job, p in ledger.stored.items() if p.nodes}
        assert sorted(placements) == sorted(final)  # every job placed exactly once
        per_node: dict[str, int] = {}
        for job_id, placement in placements.items():
            assert placement.nodes == final[job_id].nodes
            for node in placement.nodes:
                per_node[node] = per_node.get(node, 0) + placement.slots_per_replica
        assert all(used <= slots_per_node for used in per_node.values())
        assert sum(per_node.values()) == n_jobs
        # The claims cover exactly the placements: no slot held twice, none left over.
        claimed = {node: sum(held.values()) for node, held in ledger.claims.items() if held}
        assert claimed == per_node
        if big:
            assert sum(len(encode(p)) for p in placements.values()) > 1_048_576
    finally:
        beats.close()
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        for agent in agents:
            await agent.stop()


async def test_a_ledger_write_that_fails_leaves_none_of_its_pass_running(
        own_nats: NatsServer, client_bus: Bus) -> None:
    # A pass's writes run at once. When one fails, the leader steps down and the next term
    # restores from what is stored: no other write of the failed pass may still be going
    # on then, to land after the restore (seen on a loaded server: a record write timed
    # out, the leader stepped down, and admitted records of the failed pass were written
    # over the next term's requeue, with no placement behind them).
    bucket = await TypedKV.open(client_bus.js, subjects.ADMISSION_BUCKET, Lease)
    store = LedgerStore(bucket.kv, subjects.ADMISSION_BUCKET)
    await store.load()
    # Another instance claims on one node after this one read the ledger: this one's
    # write there fails at its first answer, while the pass's other writes are on their
    # way.
    other = LedgerStore(bucket.kv, subjects.ADMISSION_BUCKET)
    await other.load()
    await other.write(ledger.WritePlan({}, {"taken": {"elsewhere": 1}}, {}))
    claims = {"taken": {"job": 1}} | {f"n{i}": {f"j{i}": 1} for i in range(500)}
    before = asyncio.all_tasks()
    with pytest.raises(LeadershipLost, match="taken"):
        await store.write(ledger.WritePlan({}, claims, {}))
    assert [task for task in asyncio.all_tasks() - before if not task.done()] == []
    assert "taken" not in store.claims


async def test_two_instances_hand_over_when_the_leader_dies(
        own_nats: NatsServer, config: BusConfig, client_bus: Bus, tmp_path: Path) -> None:
    agents = await start_agents(config, slots=4, count=1)
    procs = {name: await _spawn_admission(own_nats.url, name, tmp_path) for name in ("a", "b")}
    client = AdmissionClient(client_bus)
    leases = TypedKV((await TypedKV.open(client_bus.js, subjects.ADMISSION_BUCKET,
                                         Lease)).kv, subjects.ADMISSION_BUCKET, Lease)
    try:
        await client.submit(spec("before", 1), "before-1")
        await wait_state(client_bus, "before-1", JobState.ADMITTED)
        lease = await leases.get("leader")
        assert lease is not None and lease.value.holder in procs
        leader, standby = lease.value.holder, ({"a", "b"} - {lease.value.holder}).pop()

        procs[leader].send_signal(signal.SIGKILL)
        await procs[leader].wait()

        async def taken_over() -> Lease:
            async for change in leases.watch():
                if change is not None and change.value is not None \
                        and change.value.holder == standby:
                    return change.value
            raise AssertionError("watch ended")

        new = await asyncio.wait_for(taken_over(), 15)
        assert new.epoch == lease.value.epoch + 1
        await client.submit(spec("after", 1), "after-1")
        assert (await wait_state(client_bus, "after-1", JobState.ADMITTED)).nodes == ["node-0"]
        assert (await client.explain("before-1")).state is JobState.ADMITTED  # kept its slot
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for agent in agents:
            await agent.stop()


def test_config_reads_policy_and_timings(tmp_path: Path) -> None:
    path = tmp_path / "phalanx.toml"
    path.write_text("[admission]\nlease_s = 2\nmax_reservations = 2\n"
                    "[admission.priority_classes]\nbatch = 1\nprod = 10\n"
                    "[admission.teams.vision]\nnominal = 8\nborrow_limit = 4\n")
    config = AdmissionConfig.load(path, env={"PHALANX_ADMISSION_TICK_S": "0.5"})
    assert config.lease_s == 2 and config.tick_s == 0.5
    assert dict(config.policy.priority_classes) == {"batch": 1, "prod": 10}
    assert config.policy.quota("vision").ceiling == 12
    assert config.policy.max_reservations == 2
    assert Placement() == Placement()


async def test_a_slow_restore_does_not_judge_live_nodes_on_records_read_before_it(
        own_nats: NatsServer, config: BusConfig, client_bus: Bus,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen on a loaded machine with 12,000 jobs: a new leader read the registry, then took
    # longer than lost_after_s to read the jobs back, and its first liveness checks judged
    # the registry as read before that restore (its node watch had not delivered yet):
    # every node, heartbeating all along, was lost and every running job requeued.
    lost_after_s = 1.5
    nodes = [NodeInfo(node_id=f"node-{i}", host="h", slots=2, failure_domain=f"d{i}")
             for i in range(2)]
    stop_beats, registered = asyncio.Event(), asyncio.Event()
    beats = asyncio.create_task(heartbeat_nodes(client_bus, nodes, stop_beats, registered))
    await asyncio.wait_for(registered.wait(), 10)
    timings = AdmissionConfig(lease_s=1.0, lost_after_s=lost_after_s, tick_s=0.1)
    first = AdmissionService(timings, config, instance="first")
    second = None
    try:
        await first.start()
        ids = await admit_one_slot_jobs(client_bus, "job", 4)
        await first.stop()  # hands over at once

        seen, watching = await record_jobs(client_bus)
        # The new leader on a loaded server: its restore takes twice lost_after_s, and
        # reading the registry whole takes a while (the heartbeats go on meanwhile).
        restore = AdmissionService._restore

        async def slow_restore(self: AdmissionService, term, changes):
            result = await restore(self, term, changes)
            await asyncio.sleep(2 * lost_after_s)
            return result

        entries = TypedKV.entries

        async def slow_entries(self: TypedKV, *args, **kwargs):
            result = await entries(self, *args, **kwargs)
            if self.bucket == subjects.NODES_BUCKET:
                await asyncio.sleep(0.5)
            return result

        monkeypatch.setattr(AdmissionService, "_restore", slow_restore)
        monkeypatch.setattr(TypedKV, "entries", slow_entries)
        second = AdmissionService(timings, config, instance="second")
        await second.start()
        served = time.monotonic() + 30
        while second.term is None or not second.term.serving:
            assert time.monotonic() < served, "the second instance never served"
            await asyncio.sleep(0.05)
        await asyncio.sleep(4 * lost_after_s)  # long past the first ticks after the restore
        watching.cancel()
        assert second.term is not None and len(second.term.core.running) == len(ids)
        assert [(r.job_id, r.state, r.reason_code) for r in seen
                if r.job_id in ids and r.state is not JobState.ADMITTED] == []
    finally:
        for service in (first, second):
            if service is not None:
                await service.stop()
        stop_beats.set()
        await beats


#: The silences below, against this timeout.
SHORT_LOST_AFTER_S = 1.5
TWO_NODES = [NodeInfo(node_id=f"node-{i}", host="h", slots=2, failure_domain=f"d{i}")
             for i in range(2)]


def mass_silence_gauge() -> float:
    """Admission's ``phalanx_mass_silence``, as its ``/metrics`` page would show it."""
    [family] = metrics.MASS_SILENCE.collect()
    return next(s.value for s in family.samples if s.labels == {"service": "admission"})


def short_timeout_leader(config: BusConfig, instance: str) -> AdmissionService:
    return AdmissionService(AdmissionConfig(lease_s=5.0, lost_after_s=SHORT_LOST_AFTER_S,
                                            tick_s=0.1), config, instance=instance)


def stayed_admitted(leader: AdmissionService, seen: list[JobRecord],
                    ids: list[str]) -> dict[str, JobRecord]:
    """Asserts every job of ``ids`` runs and no record of one had another state once it
    was admitted; the admitted records."""
    assert leader.term is not None and len(leader.term.core.running) == len(ids)
    admitted: dict[str, JobRecord] = {}
    for record in seen:
        assert record.job_id not in admitted or record.state is JobState.ADMITTED, record
        if record.state is JobState.ADMITTED:
            admitted[record.job_id] = record
    assert sorted(admitted) == sorted(ids)
    return admitted


async def test_a_leader_held_up_longer_than_lost_after_s_judges_no_node_on_that_silence(
        config: BusConfig, client_bus: Bus) -> None:
    # A long pass holds the leader's loop: the heartbeats of that time wait unread in its
    # connection, and the first tick after it must not judge the nodes on what it read
    # before (every node lost, every running job requeued).
    leader = short_timeout_leader(config, "held")
    with heartbeats_elsewhere(config, TWO_NODES):
        await leader.start()
        seen, watching = await record_jobs(client_bus)
        try:
            ids = await admit_one_slot_jobs(client_bus, "held", 4)
            time.sleep(2 * SHORT_LOST_AFTER_S)  # the loop held up, the leader inside it
            await asyncio.sleep(3 * SHORT_LOST_AFTER_S)  # long past the ticks after it
            stayed_admitted(leader, seen, ids)
        finally:
            watching.cancel()
            await leader.stop()


@contextlib.asynccontextmanager
async def leading_two_beating_nodes(
        config: BusConfig, client_bus: Bus, instance: str,
        clock_off: dict[str, float] | None = None,
) -> AsyncIterator[tuple[AdmissionService, set[str], list[JobRecord]]]:
    """A short-timeout leader over ``TWO_NODES``, which beat until the end (those in
    the set yielded, which the caller may change, fall silent); every job record
    written meanwhile."""
    leader = short_timeout_leader(config, instance)
    silent: set[str] = set()
    stop, registered = asyncio.Event(), asyncio.Event()
    beats = asyncio.create_task(heartbeat_nodes(client_bus, TWO_NODES, stop, registered,
                                                silent, clock_off))
    await registered.wait()
    await leader.start()
    seen, watching = await record_jobs(client_bus)
    try:
        yield leader, silent, seen
    finally:
        watching.cancel()
        await leader.stop()
        stop.set()
        await beats


async def requeued_off_node_1(client_bus: Bus, admitted: dict[str, JobRecord]) -> None:
    """Asserts the two jobs that ran on node-1 go back to pending, their node lost."""
    on_node_1 = [job_id for job_id, r in admitted.items() if r.nodes == ["node-1"]]
    assert len(on_node_1) == 2
    for job_id in on_node_1:
        requeued = await wait_state(client_bus, job_id, JobState.PENDING)
        assert requeued.reason_code is ReasonCode.NODE_LOST


async def test_every_node_silent_at_once_requeues_nothing_and_one_left_silent_is_lost(
        config: BusConfig, client_bus: Bus) -> None:
    # The 12,000-job burst on a loaded machine starved every node's heartbeats at once,
    # and each node, judged on its own, was lost with every job on it.
    async with leading_two_beating_nodes(config, client_bus, "silence") as (
            leader, silent, seen):
        ids = await admit_one_slot_jobs(client_bus, "silence", 4)
        silent.update(n.node_id for n in TWO_NODES)  # every node at once, for 3 timeouts
        await asyncio.sleep(3 * SHORT_LOST_AFTER_S)
        assert mass_silence_gauge() == 1.0
        silent.clear()
        await asyncio.sleep(2 * SHORT_LOST_AFTER_S)
        assert mass_silence_gauge() == 0.0
        admitted = stayed_admitted(leader, seen, ids)
        # Again, but one node stays silent after the other is heard: its jobs go back.
        silent.update(n.node_id for n in TWO_NODES)
        await asyncio.sleep(2 * SHORT_LOST_AFTER_S)
        silent.discard("node-0")
        await requeued_off_node_1(client_bus, admitted)


async def test_nodes_whose_clocks_are_off_are_judged_by_when_their_heartbeats_arrive(
        config: BusConfig, client_bus: Bus) -> None:
    # An agent's clock a minute behind made every heartbeat of its look a minute old:
    # its node was lost at once, and stayed lost while it beat.
    async with leading_two_beating_nodes(config, client_bus, "clocks", clock_off={
            "node-0": -60.0, "node-1": 45.0}) as (leader, silent, seen):
        ids = await admit_one_slot_jobs(client_bus, "clocks", 4)
        await asyncio.sleep(3 * SHORT_LOST_AFTER_S)
        admitted = stayed_admitted(leader, seen, ids)
        silent.add("node-1")  # its clock runs ahead: silence counts from its last arrival
        await requeued_off_node_1(client_bus, admitted)


async def test_a_record_left_on_other_nodes_than_the_ledger_is_rewritten_by_the_restore(
        config: BusConfig, client_bus: Bus) -> None:
    # Seen after a 12,000-job burst on a loaded machine: a pass moved thousands of jobs off
    # a node judged lost, wrote the ledger, and its term ended before every record was
    # written; the next term's restore compared only states (admitted, admitted), so 5,932
    # records named a node the ledger no longer gave them, for good.
    nodes = [NodeInfo(node_id=f"node-{i}", host="h", slots=2, failure_domain=f"d{i}")
             for i in range(2)]
    timings = AdmissionConfig(lease_s=1.0, lost_after_s=30.0, tick_s=0.1)
    first = AdmissionService(timings, config, instance="first")
    second = None
    jobs = await TypedKV.open(client_bus.js, subjects.JOBS_BUCKET, JobRecord)
    with heartbeats_elsewhere(config, nodes):
        try:
            await first.start()
            (job,) = await admit_one_slot_jobs(client_bus, "moved", 1)
            await first.stop()  # hands over at once
            record, _ = await jobs.current(job)
            assert record is not None and len(record.nodes) == 1
            placed = record.nodes[0]
            elsewhere = next(n.node_id for n in nodes if n.node_id != placed)
            await jobs.modify(job, lambda r: msgspec.structs.replace(r, nodes=[elsewhere]))

            async def rewritten() -> JobRecord:
                async for change in jobs.watch():
                    if change is not None and change.key == job and change.value is not None \
                            and change.value.nodes != [elsewhere]:
                        return change.value
                raise AssertionError("watch ended")

            watching = asyncio.create_task(rewritten())
            second = AdmissionService(timings, config, instance="second")
            await second.start()
            record = await asyncio.wait_for(watching, 30)
            assert (record.state, record.nodes) == (JobState.ADMITTED, [placed])
            ledger = await stored_ledger(client_bus)
            assert ledger.stored[job].nodes == [placed]
        finally:
            for service in (first, second):
                if service is not None:
                    await service.stop()
