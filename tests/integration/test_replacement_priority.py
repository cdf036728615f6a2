"""A replacement replica starts at a lower CPU priority and returns to normal when ready."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from phalanx.runtime import priority
from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.agent.ranks import RankSet

pytestmark = pytest.mark.skipif(not priority.can_restore(priority.current()),
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


async def run_in_slot(tmp_path: Path, how: str, nice: int) -> str:
    """Start slot 0's replica as the first launch, a slot a running job grew into, or a
    replacement; returns what it printed."""
    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    async def report(message: RankStarted | RankExited) -> None:
        if isinstance(message, RankExited):
            await exited.put(message)

    async def host_of(_: str) -> str:
        return "127.0.0.1"

    ranks = RankSet("n1", tmp_path, "nats://127.0.0.1:1", host_of, report,
                    replacement_nice=nice)
    spec = JobSpec(name="p", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=1, max=1), command=[sys.executable, "-c", CHILD])
    record = JobRecord(job_id="p1", spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                       updated_at=1.0, reason_code=ReasonCode.ADMITTED, nodes=["n1"])
    if how == "replacement":
        await ranks.replace(record, 0, "r0-1")
    else:  # a job with a generation is elastic: its new slots join running survivors
        await ranks.reconcile(record, elastic=how == "grown")
    end = await asyncio.wait_for(exited.get(), 60)
    assert end.exit_code == 0
    return (tmp_path / "jobs" / "p1" / "rank-0.log").read_text().strip()


@pytest.mark.parametrize("how", ["replacement", "grown"])
async def test_a_joiner_starts_nicer_and_every_thread_returns_when_ready(
        tmp_path: Path, how: str) -> None:
    base = priority.current()
    start, restore_to, after = (await run_in_slot(tmp_path, how, 7)).split(" ", 2)
    assert int(start) == min(19, base + 7)
    assert int(restore_to) == base and after == f"[{base}]"


@pytest.mark.parametrize(("how", "nice"), [("first", 7), ("replacement", 0), ("grown", 0)])
async def test_first_replicas_and_a_nice_of_0_start_at_the_agents_priority(
        tmp_path: Path, how: str, nice: int) -> None:
    base = priority.current()
    assert await run_in_slot(tmp_path, how, nice) == f"{base} None [{base}]"
