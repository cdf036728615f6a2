"""Bad input on every subject and KV record the services listen on, and what it found.

``test_barrage`` is the reduced form of ``bench/fuzz.py`` (which sends 10,000 inputs
per target): the same seeded generator and mutator (``bench/fuzzing.py``) sends a few
hundred inputs to each target at admission, health, elasticity and an agent running on
a private nats-server (garbage in shared buckets would reach other tests), then checks
that every bad input was counted and every bad request answered 400, that nothing
stopped or logged an ERROR, and that the services still admit a job and register
heartbeats. The tests after it are the minimal regressions of what the fuzzer found.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from phalanx.bench.fuzzing import Barrage, World
from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    Lease,
    NodeInfo,
    NodeRecord,
    ReasonCode,
    ReplicaRange,
    StreamCursor,
)
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.ledger import job_key, node_key
from phalanx.services.admission.service import LEADER_KEY, AdmissionService
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.jobstate import JobStateStore
from phalanx.services.lease import Leadership
from phalanx.services.natsd import NatsServer

PER_TARGET = 200
GARBAGE = b"\x93\x01\x02\x03"  # MessagePack, but a list: no message at all


@pytest.fixture
async def bus(own_nats: NatsServer) -> AsyncIterator[Bus]:
    async with await Bus.connect(BusConfig.load(env={}, servers=[own_nats.url])) as b:
        yield b


@pytest.mark.timeout(240)
async def test_barrage(own_nats: NatsServer, tmp_path: Path) -> None:
    async with Barrage(own_nats.url, tmp_path, seed=10, per_target=PER_TARGET) as barrage:
        results = await barrage.fire()
        alive = await barrage.still_works("fz-probe")
        assert alive["probe_nodes"] == [World.node]
        report = barrage.report()
    assert report["errors_logged"] == []
    assert {name: r.findings for name, r in results.items() if r.findings} == {}
    for name, result in results.items():
        assert result.inputs + result.skipped == PER_TARGET, name
        assert result.bad >= PER_TARGET // 4, f"{name}: too few bad inputs to mean anything"
        assert result.inputs > result.bad, f"{name}: no valid input reached the service"
        if name.startswith(("admission.", "agent.")):  # requests: every bad one answered 400
            assert result.replies.get("400", 0) >= result.bad, name
    # Subjects: each counter counted each bad input exactly once; KV followers at least once.
    exact = {n: r for n, r in results.items() if not n.startswith("kv.")}
    assert all(set(r.counted.values()) == {r.bad} for r in exact.values()), \
        {n: (r.bad, r.counted) for n, r in exact.items()}
    assert min(results["kv.jobs"].counted.values()) >= results["kv.jobs"].bad


# --- regressions -------------------------------------------------------------------------


async def _put_raw(bus: Bus, bucket: str, key: str, payload: bytes) -> None:
    kv = await TypedKV.open(bus.js, bucket, Lease)  # any type: the bucket is what matters
    await kv.kv.put(key, payload)


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_admission_leads_despite_an_undecodable_ledger_and_lease(
        own_nats: NatsServer, bus: Bus) -> None:
    """Found by the fuzzer: a garbage ledger failed every term of leadership at its first
    read (no leader, ever: every request answered 503); a garbage lease was never taken."""
    await _put_raw(bus, subjects.ADMISSION_BUCKET, job_key("fz-job"), GARBAGE)
    await _put_raw(bus, subjects.ADMISSION_BUCKET, node_key("fz-node"), GARBAGE)
    await _put_raw(bus, subjects.ADMISSION_BUCKET, LEADER_KEY, GARBAGE)
    admission = AdmissionService(AdmissionConfig(lease_s=1.0),
                                 BusConfig.load(env={}, servers=[own_nats.url]),
                                 instance="adm-garbage")
    await admission.start()
    try:
        await _until(lambda: admission.term is not None and admission.term.serving)
        assert admission.leases.counters.bad_messages >= 1
        store = admission.term.store
        assert store.placements.counters.bad_messages >= 1
        assert store.nodes.counters.bad_messages >= 1
        assert store.unreadable == {"fz-job"} and store.claims["fz-node"] == {}
    finally:
        await admission.stop()


async def test_admission_rebuilds_an_undecodable_ledger_from_admitted_records(
        own_nats: NatsServer, bus: Bus) -> None:
    """The placement of an admitted job survives garbage under its ledger key: it comes from
    the record, and the first ledger write replaces the garbage (and claims its slots)."""
    spec = JobSpec(name="kept", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), command=["true"])
    record = JobRecord(job_id="kept", spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                       updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=["n-a", "n-a"])
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put("kept", record)
    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    await nodes.put("n-a", NodeRecord(node=NodeInfo(node_id="n-a", host="h", slots=2,
                                                    failure_domain="d"),
                                      heartbeat_at=time.time(), slots_used=2))
    await _put_raw(bus, subjects.ADMISSION_BUCKET, job_key("kept"), GARBAGE)
    admission = AdmissionService(AdmissionConfig(lease_s=1.0),
                                 BusConfig.load(env={}, servers=[own_nats.url]),
                                 instance="adm-rebuild")
    await admission.start()
    try:
        await _until(lambda: admission.term is not None and admission.term.serving)
        assert admission.term.core.gangs["kept"].nodes == ["n-a", "n-a"]
        store = admission.term.store
        await _until(lambda: "kept" in store.stored)
        assert store.stored["kept"].nodes == ["n-a", "n-a"] and not store.unreadable
        assert store.claims["n-a"] == {"kept": 2}
    finally:
        await admission.stop()


async def test_leadership_takes_an_undecodable_lease(bus: Bus) -> None:
    """Found by the fuzzer: health's and elasticity's lease, once garbage, was never taken
    again (every check failed decoding it): neither service ever led."""
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    await leases.kv.put("fz-service", GARBAGE)
    led = asyncio.Event()

    async def lead() -> None:
        led.set()
        await asyncio.Event().wait()

    stop = asyncio.Event()

    async def sleep_or_stop(seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        return stop.is_set()

    leadership = Leadership(leases, "fz-service", "me", 1.0, lead, bus_config=bus.config)
    running = asyncio.create_task(leadership.run(sleep_or_stop))
    try:
        await asyncio.wait_for(led.wait(), 10)
        assert leases.counters.bad_messages == 1
        assert (await leases.get("fz-service")).value.holder == "me"
    finally:
        stop.set()
        await running


async def test_job_state_store_replaces_an_undecodable_cursor(bus: Bus) -> None:
    """Found by the fuzzer: a garbage stream cursor failed every term of health and
    elasticity at load (they never led again). It now reads as 0 (the whole stream is read
    again, which the cores make harmless) and the next advance replaces it."""
    cursors = await TypedKV.open(bus.js, subjects.CURSORS_BUCKET, StreamCursor)
    snapshots = await TypedKV.open(bus.js, subjects.HEALTH_BUCKET, NodeRecord)
    await cursors.kv.put("fz-service", GARBAGE)
    store = JobStateStore(snapshots, cursors, "fz-service")
    await store.load()
    assert store.cursor == 0 and cursors.counters.bad_messages == 1
    await store.advance(7)
    assert (await cursors.get("fz-service")).value.seq == 7


async def test_agent_heartbeats_over_an_undecodable_registry_entry(own_nats: NatsServer,
                                                                   bus: Bus,
                                                                   tmp_path: Path) -> None:
    """Found by the fuzzer: garbage under an agent's own node key failed every heartbeat
    (its read-modify-write could not read), so the node stayed unregistered for good."""
    agent = AgentService(AgentConfig(node_id="fz-beat", slots=1, heartbeat_interval_s=0.1,
                                     launch=False, work_dir=str(tmp_path / "agent")),
                         BusConfig.load(env={}, servers=[own_nats.url]))
    await agent.start()
    try:
        assert agent.nodes is not None
        await agent.nodes.kv.put("fz-beat", GARBAGE)
        await _until(lambda: agent.nodes.counters.bad_messages >= 1)
        nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        deadline = time.monotonic() + 10
        while (record := (await nodes.current("fz-beat"))[0]) is None:  # garbage until then
            assert time.monotonic() < deadline, "the agent never re-registered"
            await asyncio.sleep(0.05)
        assert record.node.agent_pid == agent.info.agent_pid
        assert not agent.stopping
    finally:
        await agent.stop()
