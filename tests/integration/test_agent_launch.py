"""How an agent launches a replica: its CPU priority and its environment.

A replacement (or a replica in a slot a running job grew into) starts at a lower
CPU priority and returns to normal when ready; every replica learns the host its
peers reach it at.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Collection
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
from phalanx.services.agent import ranks as ranks_module
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


def node(tmp_path: Path, capacity: int, cordoned: Collection[int] | None = None
         ) -> tuple[RankSet, list[RankStarted | RankExited]]:
    """Node n1's ranks, on ``capacity`` slots (``cordoned`` out of use), and what they
    reported, in order."""
    reports: list[RankStarted | RankExited] = []

    async def report(message: RankStarted | RankExited) -> None:
        reports.append(message)

    async def host_of(_: str) -> str:
        return "127.0.0.1"

    async def cordons() -> Collection[int]:
        return cordoned or ()

    return RankSet("n1", tmp_path, "nats://127.0.0.1:1", host_of, report, capacity=capacity,
                   cordoned=cordons), reports


def on_n1(job_id: str, replicas: int = 1, slots_per_replica: int = 1,
          grace_period_s: float = 30.0) -> JobRecord:
    """Job ``job_id`` admitted with ``replicas`` replicas on n1, each sleeping."""
    spec = JobSpec(name=job_id, team="t", priority_class="normal",
                   slots_per_replica=slots_per_replica, grace_period_s=grace_period_s,
                   replicas=ReplicaRange(min=1, max=4), command=["sleep", "600"])
    return JobRecord(job_id=job_id, spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                     updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=["n1"] * replicas)


def story(reports: list[RankStarted | RankExited]) -> list[tuple[str, str]]:
    return [("started" if isinstance(m, RankStarted) else "exited", m.job_id) for m in reports]


async def test_a_placement_larger_than_the_node_is_refused_and_nothing_starts(
        tmp_path: Path) -> None:
    """A record placing 3 replicas of 2 slots on a 4-slot node (never admission's: the
    fuzzer's) launches nothing, and the node still runs a record that fits."""
    ranks, reports = node(tmp_path, capacity=4)
    try:
        await ranks.reconcile(on_n1("too-big", 3, slots_per_replica=2))
        assert reports == [] and ranks.ranks == {} and ranks.launched == {}
        await ranks.reconcile(on_n1("fits", 2, slots_per_replica=2))
        assert sorted((s.job_id, s.rank) for s in reports) == [("fits", 0), ("fits", 1)]
    finally:
        await ranks.stop_all()


@pytest.mark.parametrize("stopping", ["before the launch", "while the launch waits"])
async def test_a_launch_waits_for_a_rank_that_is_stopping_however_long_it_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopping: str) -> None:
    """A node's one slot held by a rank of a job admission moved off: a launch there waits
    for that rank to be stopped, and once it is stopping, for its exit, past SLOT_WAIT_S
    (its grace period may be longer)."""
    monkeypatch.setattr(ranks_module, "SLOT_WAIT_S", 0.2)
    ranks, reports = node(tmp_path, capacity=1)
    # Born ignoring SIGTERM (no window before a trap): it exits at the SIGKILL, 1 s on.
    ignored = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        await ranks.reconcile(on_n1("old", grace_period_s=1.0))
    finally:
        signal.signal(signal.SIGTERM, ignored)
    (old,) = ranks.ranks.values()
    try:
        if stopping == "before the launch":
            drop = asyncio.create_task(ranks.drop("old"))
            await asyncio.sleep(0)  # the drop runs up to its wait for the exit
            assert old.stopping
            launch = asyncio.create_task(ranks.reconcile(on_n1("new")))
        else:
            launch = asyncio.create_task(ranks.reconcile(on_n1("new")))
            await asyncio.sleep(0)  # the launch runs up to its wait for a slot
            assert not launch.done() and not old.stopping
            drop = asyncio.create_task(ranks.drop("old"))
        await asyncio.wait_for(asyncio.gather(drop, launch), 30)
        assert story(reports) == [("started", "old"), ("exited", "old"), ("started", "new")]
        exited = reports[1]
        assert isinstance(exited, RankExited) and exited.signal == "SIGKILL"
    finally:
        await ranks.stop_all()


@pytest.mark.parametrize(("cordoned", "warning"), [
    ((), "no free slot for a replica: the node's ranks did not make way within 0.2 s"),
    ((0,), "no usable slot for a replica: the node's free slots are cordoned"),
])
async def test_a_launch_gives_up_on_ranks_that_do_not_make_way_and_at_once_on_cordons(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        cordoned: tuple[int, ...], warning: str) -> None:
    """A full node's ranks that are not stopping get SLOT_WAIT_S to make way; free slots
    that are all cordoned are no reason to wait (admission places the replica elsewhere
    once it hears of the cordon). Either way nothing starts, and the launch is not
    recorded: the slot's next record launches it."""
    monkeypatch.setattr(ranks_module, "SLOT_WAIT_S", 0.2)
    ranks, reports = node(tmp_path, capacity=2, cordoned=cordoned)
    try:
        await ranks.reconcile(on_n1("old"))  # in slot 1 when slot 0 is cordoned
        if not cordoned:
            await ranks.reconcile(on_n1("older"))
        await ranks.reconcile(on_n1("new"))
        assert ("new", 0) not in ranks.launched and ("started", "new") not in story(reports)
        assert warning in caplog.messages
    finally:
        await ranks.stop_all()


# What the agent's manifest says as the replica's command begins.
ON_RECORD = """
import json, os
manifest = json.load(open(os.path.join(os.environ["WORK_DIR"], "ranks.json")))
print(sorted(r["replica_id"] for r in manifest["ranks"]), flush=True)
"""


@pytest.mark.parametrize("how", ["first", "replacement"])
async def test_a_replica_is_on_the_agents_record_before_its_command_runs(
        tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A restarted agent adopts what its manifest lists: a rank that ran before it was
    # listed would train on with no agent to report its exit. The agent is made slow
    # between the process's start and its record (its CPU pinning blocks for 0.5 s),
    # time enough for a process that did not wait to read the manifest without itself.
    pin = RankSet.pin

    def slow_pin(self: RankSet, pid: int, slots: tuple[int, ...]) -> None:
        time.sleep(0.5)
        pin(self, pid, slots)

    monkeypatch.setattr(RankSet, "pin", slow_pin)
    replica = "r0-1" if how == "replacement" else "r0-0"
    assert ranks_module.MANIFEST == "ranks.json"
    assert await run_in_slot(tmp_path, how, child=ON_RECORD,
                             env={"WORK_DIR": str(tmp_path)}) == f"['{replica}']"
