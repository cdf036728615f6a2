"""The node agent over a real server: registry entry, heartbeats, status, deregistration."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time

import pytest
from test_agent_replicas import SLEEPS, admitted

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import NodeHeartbeat, NodeRecord, NodeStatusRequest
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.core import NodeIdTaken
from phalanx.services.agent.service import AgentService
from phalanx.services.natsd import NatsServer


async def _heartbeats(bus: Bus, node_id: str) -> asyncio.Queue[NodeHeartbeat]:
    beats: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

    async def on_beat(beat: NodeHeartbeat, _: Delivery) -> None:
        await beats.put(beat)

    await bus.subscribe(subjects.node_heartbeat(node_id), NodeHeartbeat, on_beat)
    return beats


async def test_agent_registers_heartbeats_and_deregisters(bus: Bus, bus_config: BusConfig,
                                                          uid: str) -> None:
    config = AgentConfig(node_id=uid, slots=3, failure_domain="rack-a", labels={"cpu": "x86"},
                         heartbeat_interval_s=0.05, lost_after_s=1.0)
    beats = await _heartbeats(bus, uid)
    agent = AgentService(config, bus_config)
    await agent.start()
    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    try:
        entry = await nodes.get(uid)
        assert entry is not None
        assert (entry.value.node.slots, entry.value.node.failure_domain) == (3, "rack-a")
        assert entry.value.node.labels == {"cpu": "x86"}
        assert entry.value.node.agent_pid == os.getpid()

        first = await asyncio.wait_for(beats.get(), 5)
        second = await asyncio.wait_for(beats.get(), 5)
        assert second.seq == first.seq + 1 and second.sent_at >= first.sent_at

        # The registry entry is refreshed beside the heartbeats, not before each.
        status = await bus.request(subjects.agent_status(uid), NodeStatusRequest(), NodeRecord)
        while status.heartbeat_seq == 0:
            await asyncio.wait_for(beats.get(), 5)
            status = await bus.request(subjects.agent_status(uid), NodeStatusRequest(),
                                       NodeRecord)
        assert status.node.node_id == uid and status.heartbeat_at >= first.sent_at
    finally:
        await agent.stop()
    assert await nodes.get(uid) is None


async def test_heartbeats_go_on_while_the_registry_cannot_be_written(own_nats: NatsServer,
                                                                      uid: str) -> None:
    """Health judges a node by its heartbeats: a registry write that fails or takes long
    (a loaded JetStream) must not hold them back, or live nodes are judged lost. (Its own
    server: the registry bucket is deleted under the agent.)"""
    config = AgentConfig(node_id=uid, slots=1, heartbeat_interval_s=0.05, lost_after_s=1.0)
    bus_config = BusConfig.load(env={}, servers=[own_nats.url])
    bus = await Bus.connect(bus_config)
    beats = await _heartbeats(bus, uid)
    agent = AgentService(config, bus_config)
    await agent.start()
    try:
        await asyncio.wait_for(beats.get(), 5)
        await bus.js.delete_key_value(subjects.NODES_BUCKET)  # every refresh fails now
        while not beats.empty():
            beats.get_nowait()
        after = [await asyncio.wait_for(beats.get(), 5) for _ in range(5)]
        assert [b.seq for b in after] == list(range(after[0].seq, after[0].seq + 5))
        # The registry is back: the stop's deregistration does not retry for the KV's
        # failover window (15 s).
        await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    finally:
        await agent.stop()
        await bus.close()


@pytest.mark.parametrize("writer", ["this agent", "another agent"])
async def test_a_stop_deregisters_the_entry_while_it_is_this_agents(
        bus: Bus, bus_config: BusConfig, uid: str, writer: str) -> None:
    """The entry is deleted at the revision read at the stop, not the last one this agent
    saw written: a write of its own whose answer it never read (a refresh the stop
    cancelled) is deleted with the rest, and an entry another agent took is left alone."""
    config = AgentConfig(node_id=uid, slots=1, heartbeat_interval_s=60.0,  # no refresh
                         lost_after_s=120.0)
    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    agent = AgentService(config, bus_config)
    await agent.start()
    try:
        stored = agent.record  # as registered
        assert stored is not None
        pid = stored.node.agent_pid if writer == "this agent" else 1
        written = msgspec_replace(stored, node=msgspec_replace(stored.node, agent_pid=pid))
        await nodes.put(uid, written)
    finally:
        await agent.stop()
    after = await nodes.get(uid)
    if writer == "this agent":
        assert after is None
    else:
        assert after is not None and after.value == written


class FirstRetry(logging.Handler):
    """Catches the first task that retries a call to a KV key unanswered
    (:func:`phalanx.bus.failover.through_failover` logs each retry, as phalanx.bus.kv)."""

    def __init__(self, key: str) -> None:
        super().__init__(logging.DEBUG)
        self.prefix = f"{key} unanswered"
        self.task: asyncio.Task | None = None
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.task is None and record.getMessage().startswith(self.prefix):
            self.task = asyncio.current_task()
            self.seen.set()


async def test_a_stop_cancels_a_registry_refresh_retrying_through_a_failover(
        own_nats: NatsServer, uid: str, caplog: pytest.LogCaptureFixture) -> None:
    """A registry refresh retries an unanswered bucket for the KV's failover window (15 s);
    a stop cancels it rather than wait it out, and logs no error. (Its own server: the
    registry bucket is deleted under the agent. It stops as for a restart, keeping the
    entry: a plain stop deregisters, which waits for the registry to answer.)"""
    # The loop is the test session's: what earlier tests left for the collector is reported
    # now, before this test's own tasks exist, and is not this test's to judge.
    gc.collect()
    caplog.clear()
    config = AgentConfig(node_id=uid, slots=1, heartbeat_interval_s=0.05, lost_after_s=1.0,
                         stop_is_restart=True,
                         shutdown_timeout_s=60.0)  # no loop is cut short by the stop's timeout
    bus_config = BusConfig.load(env={}, servers=[own_nats.url])
    bus = await Bus.connect(bus_config)
    caplog.set_level(logging.DEBUG, logger="phalanx.bus.kv")
    retry = FirstRetry(f"{subjects.NODES_BUCKET}/{uid}")
    logging.getLogger("phalanx.bus.kv").addHandler(retry)
    agent = AgentService(config, bus_config)
    await agent.start()
    try:
        await bus.js.delete_key_value(subjects.NODES_BUCKET)  # every refresh retries now
        await asyncio.wait_for(retry.seen.wait(), 10)
        refresh = retry.task
        assert refresh is not None and not refresh.done()
        await agent.stop()
        assert refresh.cancelled()
    finally:
        logging.getLogger("phalanx.bus.kv").removeHandler(retry)
        await agent.stop()
        await bus.close()
    gc.collect()  # a task left pending would be reported as destroyed now
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_second_live_agent_cannot_take_the_node_id(bus_config: BusConfig,
                                                           uid: str) -> None:
    config = AgentConfig(node_id=uid, slots=1, heartbeat_interval_s=0.05, lost_after_s=1.0)
    first = AgentService(config, bus_config)
    await first.start()
    try:
        second = AgentService(config, bus_config)
        second.info = type(second.info)(**{**_fields(second.info), "agent_pid": 1})
        with pytest.raises(NodeIdTaken, match=f"held by a live agent \\(pid {os.getpid()}"):
            await second.start()
        await second.stop()
    finally:
        await first.stop()


async def test_an_agent_takes_an_id_whose_holder_fell_silent_whatever_its_clock_said(
        bus: Bus, bus_config: BusConfig, uid: str) -> None:
    # A holder on another host whose clock ran an hour ahead left a record stamped an
    # hour from now: judged by the stamp, it held the id for that hour after it died.
    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    config = AgentConfig(node_id=uid, slots=1, heartbeat_interval_s=0.05, lost_after_s=0.5)
    agent = AgentService(config, bus_config)
    gone = NodeRecord(node=type(agent.info)(**{**_fields(agent.info), "host": "elsewhere"}),
                      heartbeat_seq=41, heartbeat_at=time.time() + 3600.0)
    await nodes.put(uid, gone)
    await agent.start()
    try:
        entry = await nodes.get(uid)
        assert entry is not None and entry.value.node == agent.info
    finally:
        await agent.stop()


def _fields(info) -> dict:
    return {f: getattr(info, f) for f in info.__struct_fields__}


async def test_agent_process_drains_on_sigterm(bus: Bus, nats_server, uid: str) -> None:
    beats = await _heartbeats(bus, uid)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.agent", "--node-id", uid, "--slots", "2",
        "--heartbeat-interval", "0.05", "--nats", nats_server.url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    await asyncio.wait_for(beats.get(), 30)  # up and heartbeating
    proc.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0, stderr.decode()
    assert b'"msg": "deregistered"' in stderr
    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    assert await nodes.get(uid) is None


async def test_restarted_agent_adopts_its_ranks_and_stops_them_when_the_job_ends(
        bus: Bus, nats_server, uid: str, tmp_path) -> None:
    """A SIGKILLed agent leaves its ranks running; its successor finds them, no orphan stays."""
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas.messages import ExitCause, JobRecord, JobState, RankExited, RankStarted
    from phalanx.services.manifest import start_ticks

    started: asyncio.Queue[RankStarted] = asyncio.Queue()
    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    async def on_started(m: RankStarted, _: Delivery) -> None:
        await started.put(m)

    async def on_exited(m: RankExited, _: Delivery) -> None:
        await exited.put(m)

    job_id = f"adopt-{uid}"
    await bus.subscribe(subjects.rank_started(job_id), RankStarted, on_started)
    await bus.subscribe(subjects.rank_exited(job_id), RankExited, on_exited)

    def agent() -> asyncio.Future:
        return asyncio.create_subprocess_exec(
            sys.executable, "-m", "phalanx.services.agent", "--node-id", uid, "--slots", "2",
            "--heartbeat-interval", "0.1", "--nats", nats_server.url,
            "--work-dir", str(tmp_path / "agent"),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)

    record = msgspec_replace(admitted(job_id, uid, SLEEPS), admission=2)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    await jobs.put(job_id, record)
    first = await agent()
    second = None
    try:
        pids = {(await asyncio.wait_for(started.get(), 30)).pid for _ in range(2)}
        first.send_signal(signal.SIGKILL)
        await first.wait()
        assert all(start_ticks(pid) is not None for pid in pids)  # ranks outlive the agent

        second = await agent()
        beats = await _heartbeats(bus, uid)
        await asyncio.wait_for(beats.get(), 30)  # the successor is up and has adopted them
        cancelled = msgspec_replace(record, state=JobState.CANCELLED, nodes=[])
        await jobs.put(job_id, cancelled)
        await bus.publish(subjects.job_state(job_id), cancelled)
        ends = [await asyncio.wait_for(exited.get(), 30) for _ in range(2)]
        assert {e.pid for e in ends} == pids
        assert {e.cause for e in ends} == {ExitCause.STOPPED}
        assert {e.admission for e in ends} == {2}  # kept in the manifest across the restart
        assert all(start_ticks(pid) is None for pid in pids)  # no orphan keeps a slot
    finally:
        for proc in (first, second):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await proc.wait()


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)
