"""Simulated node agents and ranks that speak phalanx's real wire, many per process.

``python -m phalanx.bench.loadgen --url URL --first 0 --nodes 100 --out FILE`` runs
simulated nodes ``sim-0`` … ``sim-99`` against a real bus until SIGTERM, then writes
what it saw to ``FILE`` (JSON) for :mod:`bench.scale` to judge.

A simulated **node agent** does what :mod:`phalanx.services.agent.service` does on the
wire, with the agent's own pure rules (:mod:`phalanx.services.agent.core`): registers
in the ``phalanx_nodes`` bucket (:func:`~phalanx.services.agent.core.register`),
refreshes its record and publishes a :class:`NodeHeartbeat` every interval, follows
``phalanx.job.*.state`` and starts a rank for every slot an admitted record places on
it (``r<slot>-0``; a rank of a record no longer admitted is stopped, cause
``stopped``), answers ``phalanx.agent.<node>.launch`` / ``.stop`` with the
:class:`ReplicaReply` the real agent gives (launch verdicts included: a replica is
launched at most once), and stores every rank start and exit in the job-events
stream with the real agent's event ids.

A simulated **rank** does what :mod:`phalanx.runtime.elastic` does: reports ready
(stored, id ``<job>-<replica>-ready``), and once a generation names it a member,
steps every ``step_s`` with a :class:`RankProgress` on
``phalanx.health.rank.<job>.<rank>``; after its first step in a new generation it
stores :class:`GenerationApplied`. At ``total_steps`` it reports its final step and
exits 0. A crash (``--crashes`` of them, on SIGUSR1) is a :class:`RankExited` with ``SIGKILL``, as
``phalanx chaos kill-rank`` produces. It has no process: pids are counters, and
faults on the bus are not followed (a real rank aborts its step; a simulated one has
none to abort and simply waits for the next generation).

**Connections.** A process shares ``--connections`` NATS connections (default 4)
among all its nodes and ranks, one wildcard subscription per kind
(``phalanx.job.*.state``, ``phalanx.job.*.generation``, ``phalanx.agent.*.launch``…)
dispatched in-process. One connection per simulated node would measure the
generator, not phalanx: thousands of sockets, each with its own read task, ping
timer and subscription interest, cost the 2-core machine more CPU than the services
under test, and the server's per-connection overhead would be charged to phalanx's
message rate. What the services see is the same: the same subjects, payloads, ids
and timing per node; only the TCP multiplexing differs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RequestRefused
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import ensure_job_events
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    ExitCause,
    Generation,
    GenerationApplied,
    JobRecord,
    JobState,
    LaunchReplica,
    NodeHeartbeat,
    NodeInfo,
    NodeRecord,
    RankExited,
    RankProgress,
    RankStarted,
    ReplicaReady,
    ReplicaReply,
    StopReplica,
)
from phalanx.services.agent import core


def wildcard(subject_of: Callable[[str], str]) -> str:
    """The subject ``subject_of`` builds, with its one id token as ``*``."""
    return subject_of("WILDCARD").replace(".WILDCARD.", ".*.")


@dataclasses.dataclass(eq=False)  # one per process: hashed by identity
class SimRank:
    """One simulated rank process (a replica in one slot of a job)."""

    job_id: str
    slot: int
    replica_id: str
    node: SimNode
    pid: int
    step: int = 0
    generation: Generation | None = None
    applied_pending: bool = False
    generation_received_at: float = 0.0
    last_commit: float | None = None
    running: bool = True
    task: asyncio.Task[None] | None = None


class SimNode:
    """One simulated node agent: its registry record and the ranks it runs."""

    def __init__(self, gen: Generator, node_id: str, slots: int, domain: str) -> None:
        self.gen = gen
        self.node_id = node_id
        self.info = NodeInfo(node_id=node_id, host=f"sim-host-{node_id}", slots=slots,
                             failure_domain=domain, agent_pid=gen.next_pid(),
                             agent_version="loadgen", started_at=time.time())
        self.ranks: dict[tuple[str, int], SimRank] = {}
        self.launched: dict[tuple[str, int], str] = {}  # (job, slot) -> last replica
        self.bus = gen.bus_for(node_id)
        self.beats = 0  # heartbeats published
        self.refresh: asyncio.Task[None] | None = None  # the registry write under way

    async def register(self) -> None:
        nodes = self.gen.nodes_kv
        assert nodes is not None
        await nodes.modify(self.node_id, lambda existing: core.register(
            existing, self.info, time.time()))

    async def heartbeat(self) -> None:
        """As the agent does: the heartbeat goes out now, and the registry entry is
        refreshed beside it, one refresh at a time."""
        now = time.time()
        used = min(len(self.ranks), self.info.slots)
        if self.refresh is None or self.refresh.done():
            self.refresh = asyncio.create_task(self._refresh(now, used))
        self.beats += 1
        await self.bus.publish(subjects.node_heartbeat(self.node_id), NodeHeartbeat(
            node_id=self.node_id, seq=self.beats, sent_at=now, slots_used=used))

    async def _refresh(self, now: float, used: int) -> None:
        nodes = self.gen.nodes_kv
        assert nodes is not None
        try:
            await nodes.modify(self.node_id,
                               lambda record: core.heartbeat(record, self.info, now, used))
        except Exception as exc:  # as the agent: logged, retried at the next beat
            print(f"registry refresh of {self.node_id} failed: {exc!r}", file=sys.stderr)

    async def report(self, event: RankStarted | RankExited) -> None:
        """Store a rank's start or exit in the job-events stream, with the agent's id."""
        kind = "started" if isinstance(event, RankStarted) else "exited"
        subject = subjects.rank_started(event.job_id) if kind == "started" \
            else subjects.rank_exited(event.job_id)
        await self.bus.publish_event(
            subject, event, event_id=f"{event.job_id}-{self.node_id}-{event.pid}-{kind}")

    async def reconcile(self, record: JobRecord, wanted: set[int]) -> None:
        """Run exactly the ranks ``record`` places here, in slots ``wanted`` (the agent's
        elastic case)."""
        for (job_id, slot), rank in list(self.ranks.items()):
            if job_id == record.job_id and slot not in wanted:
                await self.end(rank, ExitCause.STOPPED, exit_code=None, signame="SIGTERM")
        for key in [k for k in self.launched if k[0] == record.job_id and k[1] not in wanted]:
            del self.launched[key]
        for slot in sorted(wanted):
            if (record.job_id, slot) not in self.launched:
                await self.launch(record, slot, core.first_replica(slot))

    async def launch(self, record: JobRecord, slot: int, replica_id: str) -> SimRank:
        self.launched[(record.job_id, slot)] = replica_id
        rank = SimRank(record.job_id, slot, replica_id, self, self.gen.next_pid())
        self.ranks[(record.job_id, slot)] = rank
        self.gen.by_job[record.job_id].add(rank)
        await self.report(RankStarted(job_id=record.job_id, rank=slot,
                                      world_size=len(record.nodes), node_id=self.node_id,
                                      pid=rank.pid, started_at=time.time(),
                                      replica_id=replica_id))
        rank.task = asyncio.create_task(self.gen.run_rank(rank))
        return rank

    async def end(self, rank: SimRank, cause: ExitCause, *, exit_code: int | None,
                  signame: str | None) -> RankExited:
        """The rank's process ends: forget it and report its exit at once."""
        rank.running = False
        if rank.task is not None and rank.task is not asyncio.current_task():
            rank.task.cancel()
        if self.ranks.get((rank.job_id, rank.slot)) is rank:
            del self.ranks[(rank.job_id, rank.slot)]
        self.gen.by_job[rank.job_id].discard(rank)
        exited = RankExited(job_id=rank.job_id, rank=rank.slot, node_id=self.node_id,
                            pid=rank.pid, cause=cause, exited_at=time.time(),
                            exit_code=exit_code, signal=signame, replica_id=rank.replica_id)
        await self.report(exited)
        return exited

    async def on_launch(self, request: LaunchReplica) -> ReplicaReply:
        record = self.gen.records.get(request.job_id)
        if record is None:
            raise RequestRefused("404", f"no job {request.job_id!r}")
        if record.placement().get(request.slot) != self.node_id:
            raise RequestRefused("409", f"slot {request.slot} of {request.job_id} is not "
                                        f"placed on {self.node_id}")
        key = (request.job_id, request.slot)
        where = f"{request.replica_id} in slot {request.slot}"
        match core.launch_verdict(self.launched.get(key), request.replica_id):
            case core.LaunchVerdict.ALREADY_LAUNCHED:
                running = self.ranks.get(key)
                pid = running.pid if running is not None \
                    and running.replica_id == request.replica_id else None
                return ReplicaReply(node_id=self.node_id, replica_id=request.replica_id,
                                    pid=pid, detail=f"already launched {where}"
                                    + ("" if pid else " (it has exited)"))
            case core.LaunchVerdict.OUTDATED:
                raise RequestRefused("409", f"{request.replica_id} is older than "
                                            f"{self.launched[key]}")
        if (old := self.ranks.get(key)) is not None:
            await self.end(old, ExitCause.STOPPED, exit_code=None, signame="SIGTERM")
        rank = await self.launch(record, request.slot, request.replica_id)
        return ReplicaReply(node_id=self.node_id, replica_id=request.replica_id, pid=rank.pid,
                            detail=f"started {where}")

    async def on_stop(self, request: StopReplica) -> ReplicaReply:
        running = self.ranks.get((request.job_id, request.slot))
        pid = None
        if running is not None and running.replica_id == request.replica_id:
            pid = running.pid
            await self.end(running, ExitCause.STOPPED, exit_code=None, signame="SIGTERM")
        detail = f"stopped {request.replica_id}" if pid else f"{request.replica_id} not running"
        return ReplicaReply(node_id=self.node_id, replica_id=request.replica_id, pid=pid,
                            detail=detail)


class Generator:
    """All simulated nodes of this process, over a few shared connections."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.buses: list[Bus] = []
        self.nodes: dict[str, SimNode] = {}
        self.nodes_kv: TypedKV[NodeRecord] | None = None
        self.records: dict[str, JobRecord] = {}
        self.by_job: dict[str, set[SimRank]] = defaultdict(set)
        self._pids: itertools.count[int] = itertools.count(args.first * 1000 + 100_000)
        self.rng = random.Random(args.seed + args.first)
        self.crashes: list[dict[str, Any]] = []
        self.received: list[tuple[str, int, str, float]] = []  # job, generation, replica, at
        self.sent = 0
        self.lag_max_s = 0.0
        self.stopping = asyncio.Event()
        self._beats: set[asyncio.Task[None]] = set()

    def next_pid(self) -> int:
        return next(self._pids)

    def bus_for(self, key: str) -> Bus:
        return self.buses[hash(key) % len(self.buses)]

    async def start(self) -> None:
        config = BusConfig.load(env={}, servers=[self.args.url])
        self.buses = [await Bus.connect(config, name=f"loadgen-{self.args.first}-{i}")
                      for i in range(self.args.connections)]
        bus = self.buses[0]
        await ensure_job_events(bus)
        self.nodes_kv = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        for i in range(self.args.first, self.args.first + self.args.nodes):
            node = SimNode(self, f"sim-{i}", self.args.slots, f"rack-{i // 64}")
            self.nodes[node.node_id] = node
        await asyncio.gather(*(n.register() for n in self.nodes.values()))
        await bus.subscribe(subjects.job_states(), JobRecord, self.on_state)
        await bus.subscribe(wildcard(subjects.job_generation), Generation, self.on_generation)
        await bus.subscribe(wildcard(subjects.agent_launch), LaunchReplica, self.on_launch,
                            concurrent=True)
        await bus.subscribe(wildcard(subjects.agent_stop), StopReplica, self.on_stop,
                            concurrent=True)

    def _node_of(self, delivery: Delivery) -> SimNode:
        node = self.nodes.get(delivery.subject.split(".")[2])
        if node is None:  # another generator process's node: not ours to answer
            raise _NotMine
        return node

    async def on_launch(self, request: LaunchReplica, delivery: Delivery) -> ReplicaReply | None:
        try:
            node = self._node_of(delivery)
        except _NotMine:
            return None
        return await node.on_launch(request)

    async def on_stop(self, request: StopReplica, delivery: Delivery) -> ReplicaReply | None:
        try:
            node = self._node_of(delivery)
        except _NotMine:
            return None
        return await node.on_stop(request)

    async def on_state(self, record: JobRecord, _: Delivery) -> None:
        self.records[record.job_id] = record
        wanted: dict[str, set[int]] = defaultdict(set)  # node -> its slots (one pass)
        if record.state is JobState.ADMITTED:
            for slot, node_id in record.placement().items():
                if node_id in self.nodes:
                    wanted[node_id].add(slot)
        mine = {*wanted, *(r.node.node_id for r in list(self.by_job.get(record.job_id, ())))}
        for node_id in sorted(mine):
            await self.nodes[node_id].reconcile(record, wanted.get(node_id, set()))

    async def on_generation(self, generation: Generation, _: Delivery) -> None:
        now = time.time()
        members = {m.replica_id for m in generation.members}  # once: 16,384 of them
        for rank in list(self.by_job.get(generation.job_id, ())):
            if rank.replica_id not in members:
                continue
            if rank.generation is None or generation.generation > rank.generation.generation:
                rank.generation = generation
                rank.applied_pending = True
                rank.generation_received_at = now
                self.received.append((generation.job_id, generation.generation,
                                      rank.replica_id, now))

    async def run_rank(self, rank: SimRank) -> None:
        """Ready, then step every ``step_s`` while a member; final step: exit 0."""
        bus = self.bus_for(rank.job_id)
        step_s, total = self.args.step_s, self.args.total_steps
        await bus.publish_event(subjects.replica_ready(rank.job_id), ReplicaReady(
            job_id=rank.job_id, replica_id=rank.replica_id, slot=rank.slot,
            node_id=rank.node.node_id, endpoint=f"127.0.0.1:{20000 + rank.pid % 40000}",
            committed_step=rank.step, sent_at=time.time()),
            event_id=f"{rank.job_id}-{rank.replica_id}-ready")
        subject = subjects.health_rank(rank.job_id, rank.slot)
        due = time.monotonic() + self.rng.uniform(0, step_s)  # ranks out of phase
        while rank.running:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self.lag_max_s = max(self.lag_max_s, time.monotonic() - due)
            due += step_s
            generation = rank.generation
            if generation is None:
                continue  # not a member yet: no step to take
            if rank.applied_pending:
                rank.step = max(rank.step, generation.resume_step)
            rank.step += 1
            now = time.time()
            final = rank.step >= total
            await bus.publish(subject, RankProgress(
                job_id=rank.job_id, rank=rank.slot, replica_id=rank.replica_id,
                generation=generation.generation, step=rank.step, step_time_s=step_s,
                sent_at=now, final=final, total_steps=total))
            self.sent += 1
            if rank.applied_pending:
                rank.applied_pending = False
                pause = None if rank.last_commit is None \
                    else max(0.0, now - rank.last_commit - step_s)
                await bus.publish_event(subjects.generation_applied(rank.job_id),
                                        GenerationApplied(
                    job_id=rank.job_id, generation=generation.generation,
                    replica_id=rank.replica_id, committed_step=rank.step,
                    resume_step=generation.resume_step,
                    rebuild_s=now - rank.generation_received_at, pause_s=pause),
                    event_id=f"{rank.job_id}-{rank.replica_id}-g{generation.generation}-applied")
            rank.last_commit = now
            if final:
                await rank.node.end(rank, ExitCause.EXITED, exit_code=0, signame=None)
                return

    async def heartbeats(self) -> None:
        interval = self.args.heartbeat_s
        nodes = list(self.nodes.values())
        while not self.stopping.is_set():
            started = time.monotonic()
            # Spread over the interval, as independent agents would be.
            for i, node in enumerate(nodes):
                target = started + interval * i / len(nodes)
                await asyncio.sleep(max(0.0, target - time.monotonic()))
                task = asyncio.create_task(self._beat(node))
                self._beats.add(task)
                task.add_done_callback(self._beats.discard)
            await asyncio.sleep(max(0.0, started + interval - time.monotonic()))

    async def _beat(self, node: SimNode) -> None:
        try:
            await node.heartbeat()
        except Exception as exc:  # as the agent: logged, retried at the next beat
            print(f"heartbeat of {node.node_id} failed: {exc!r}", file=sys.stderr)

    async def crash_storm(self) -> None:
        """Crash ``crashes`` member ranks of distinct jobs within one second, each
        SIGKILLed (on SIGUSR1)."""
        jobs = sorted(j for j, ranks in self.by_job.items()
                      if any(r.generation is not None and r.running for r in ranks))
        self.rng.shuffle(jobs)
        victims = []
        for job_id in jobs[:self.args.crashes]:
            members = sorted((r for r in self.by_job[job_id]
                              if r.generation is not None and r.running),
                             key=lambda r: r.slot)
            victims.append(self.rng.choice(members))
        start = time.time()
        for i, rank in enumerate(victims):
            await asyncio.sleep(max(0.0, start + i / max(1, len(victims)) - time.time()))
            exited = await rank.node.end(rank, ExitCause.EXITED, exit_code=None,
                                         signame="SIGKILL")
            self.crashes.append({"job_id": rank.job_id, "replica_id": rank.replica_id,
                                 "rank": rank.slot, "at": exited.exited_at})

    def result(self) -> dict[str, Any]:
        return {"first": self.args.first, "nodes": len(self.nodes), "crashes": self.crashes,
                "received": self.received, "progress_sent": self.sent,
                "ranks": sum(len(n.ranks) for n in self.nodes.values()),
                "step_lag_max_s": round(self.lag_max_s, 3)}


class _NotMine(Exception):
    """A request for a node another generator process simulates."""


async def run(args: argparse.Namespace) -> None:
    gen = Generator(args)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, gen.stopping.set)
    loop.add_signal_handler(signal.SIGINT, gen.stopping.set)
    await gen.start()
    await asyncio.to_thread(Path(args.out).with_suffix(".ready").write_text, "ready\n")
    tasks = [asyncio.create_task(gen.heartbeats())]
    loop.add_signal_handler(signal.SIGUSR1,
                            lambda: tasks.append(asyncio.create_task(gen.crash_storm())))
    await gen.stopping.wait()
    for task in tasks:
        task.cancel()
    await asyncio.to_thread(Path(args.out).write_text, json.dumps(gen.result()))
    # What it saw is written, and nothing is left to flush: end now. After scale.py's bus
    # restart, connections still reconnecting held a close, or the loop's teardown, long
    # enough that scale.py killed the generator after waiting 120 s (test_scale took 160 s
    # instead of 40 in some runs; a close bounded to 5 s was not enough).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first node")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--heartbeat-s", type=float, default=0.5,
                        help="the agent's default heartbeat_interval_s")
    parser.add_argument("--step-s", type=float, default=0.5)
    parser.add_argument("--total-steps", type=int, default=1_000_000)
    parser.add_argument("--crashes", type=int, default=0,
                        help="ranks (of distinct jobs) to crash within one second on SIGUSR1")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
