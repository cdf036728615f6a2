"""How an agent launches a replica: its CPU priority and its environment.

A replacement (or a replica in a slot a running job grew into) starts at a lower
CPU priority and returns to normal when ready; every replica learns the host its
peers reach it at.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.agent import priority
from phalanx.services.agent.ranks import RankSet

may_restore = pytest.mark.skipif(not priority.can_restore(priority.current()),
                                 reason="needs CAP_SYS_NICE or RLIMIT_NICE to restore priority")

# Reports its start nice and its env, restores it as the runtime does when ready (from a
# thread started before, which inherits the low priority), then reports every thread's.
CHILD = """
import os, sys, threading, time
from phalanx.runtime import priority
start = os.getpriority(os.PRIO_PROCESS, 0)
stop = threading.Event()
worker = threading.Thread(target=stop.wait); worker.start()
restore_to = os.environ.get(priority.ENV)
if restore_to is not None:
    priority.restore(int(restore_to))
after = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')})
print(start, restore_to, after, flush=True)
stop.set(); worker.join()
"""


async def run_in_slot(tmp_path: Path, how: str, nice: int = 0, child: str = CHILD,
                      env: dict[str, str] | None = None,
                      advertise_host: str | None = None) -> str:
    """Start slot 0's replica as the first launch, a slot a running job grew into, or a
    replacement; returns what it printed."""
    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    async def report(message: RankStarted | RankExited) -> None:
        if isinstance(message, RankExited):
            await exited.put(message)

    async def host_of(_: str) -> str:
        return "127.0.0.1"

    ranks = RankSet("n1", tmp_path, "nats://127.0.0.1:1", host_of, report,
                    replacement_nice=nice, advertise_host=advertise_host)
    spec = JobSpec(name="p", team="t", priority_class="normal", env=env or {},
                   replicas=ReplicaRange(min=1, max=1), command=[sys.executable, "-c", child])
    record = JobRecord(job_id="p1", spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                       updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=["n1"])
    replica = "r0-1" if how == "replacement" else "r0-0"
    if how == "replacement":
        await ranks.replace(record, 0, replica)
    else:  # a job with a generation is elastic: its new slots join running survivors
        await ranks.reconcile(record, elastic=how == "grown")
    try:
        end = await asyncio.wait_for(exited.get(), 60)
    finally:
        await ranks.stop_all()  # a child that hangs is not left behind
    assert end.exit_code == 0
    output = (tmp_path / "jobs" / "p1" / f"{replica}.log").read_text().splitlines()
    return "\n".join(line for line in output if not line.startswith("=== phalanx:")).strip()


@may_restore
@pytest.mark.parametrize("how", ["replacement", "grown"])
async def test_a_joiner_starts_nicer_and_every_thread_returns_when_ready(
        tmp_path: Path, how: str) -> None:
    base = priority.current()
    start, restore_to, after = (await run_in_slot(tmp_path, how, 7)).split(" ", 2)
    assert int(start) == min(19, base + 7)
    assert int(restore_to) == base and after == f"[{base}]"


@may_restore
@pytest.mark.parametrize(("how", "nice"), [("first", 7), ("replacement", 0), ("grown", 0)])
async def test_first_replicas_and_a_nice_of_0_start_at_the_agents_priority(
        tmp_path: Path, how: str, nice: int) -> None:
    base = priority.current()
    assert await run_in_slot(tmp_path, how, nice) == f"{base} None [{base}]"


ADVERTISED = "import os; print(os.environ.get('PHALANX_ADVERTISE_HOST'), flush=True)"


@pytest.mark.parametrize(("host", "env", "expected"), [
    ("localhost", None, "localhost"),  # the node's host, as registered
    ("no-such-host.invalid", None, "None"),  # does not resolve: the runtime's default
    (None, None, "None"),
    ("localhost", {"PHALANX_ADVERTISE_HOST": "10.1.2.3"}, "10.1.2.3"),  # the job's own
])
async def test_a_replica_is_told_the_host_its_peers_reach_it_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str | None,
        env: dict[str, str] | None, expected: str) -> None:
    monkeypatch.delenv("PHALANX_ADVERTISE_HOST", raising=False)
    output = await run_in_slot(tmp_path, "first", child=ADVERTISED, env=env,
                               advertise_host=host)
    assert output == expected


async def test_a_placement_larger_than_the_node_is_refused_and_nothing_starts(
        tmp_path: Path) -> None:
    """A record placing 3 replicas of 2 slots on a 4-slot node (never admission's: the
    fuzzer's) launches nothing, and the node still runs a record that fits."""
    started: list[RankStarted] = []

    async def report(message: RankStarted | RankExited) -> None:
        if isinstance(message, RankStarted):
            started.append(message)

    async def host_of(_: str) -> str:
        return "127.0.0.1"

    ranks = RankSet("n1", tmp_path, "nats://127.0.0.1:1", host_of, report, capacity=4)

    def record(job_id: str, replicas: int) -> JobRecord:
        spec = JobSpec(name="big", team="t", priority_class="normal", slots_per_replica=2,
                       replicas=ReplicaRange(min=1, max=4), command=["sleep", "600"])
        return JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                         updated_at=1.0, reason_code=ReasonCode.ADMITTED,
                         nodes=["n1"] * replicas)

    try:
        await ranks.reconcile(record("too-big", 3))
        assert started == [] and ranks.ranks == {} and ranks.launched == {}
        await ranks.reconcile(record("fits", 2))
        assert sorted((s.job_id, s.rank) for s in started) == [("fits", 0), ("fits", 1)]
    finally:
        await ranks.stop_all()
