"""20 % packet loss on every link of one node (issue 53): the job trains on, or drops the
node and trains without it; it never hangs.

Before, 60 s of it deadlocked the job: every rank aborted its all-reduce on gloo's
timeout and waited for a generation that nobody decided, still hung 123 s after the
loss ended. Here the loss lasts ``LOSS_S`` (a paced job would finish within a longer
window), enough for gloo's connections to stall past ``unreachable_after_s`` (a segment
lost three times in a row waits 1.4 s for TCP, four 3 s) and for the node's agent to
miss round trips with the bus: whatever follows (a slow step, the node's members
dropped as unreachable, its ranks fenced), the job finishes bitwise, with no step the
job keeps committed twice, admitted once, and it commits steps again while the loss lasts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest
from cuts import check_cut_off, job_states
from test_elastic import Watch, check_run, progressed, run_job

from phalanx.bench.partition_harness import NamespacedCluster
from phalanx.bus.client import Bus
from phalanx.runtime import record
from phalanx.runtime.reach import PROBE_S, UNREACHABLE_AFTER_S

LOSSY = "local-1"
PERCENT = 20
LOSS_S = 10.0
#: How long the job should go without committing while the loss lasts, on an idle machine:
#: a stall until the lossy node's members are found unreachable (or the node is fenced),
#: their drop, and the rebuild.
PAUSE_S = UNREACHABLE_AFTER_S + 0.5 + PROBE_S + 3.0


def during_loss(steps: list[record.StepRecord], lossy_at: float) -> list[float]:
    return [s.committed_at for s in steps if lossy_at <= s.committed_at <= lossy_at + LOSS_S]


#: A loaded machine's late timers (7.64 s at load 10; the fence's 0.6 s at 15).
SLACK_S = 2.0


@pytest.mark.timeout(150)
async def test_a_lossy_node_never_hangs_the_job(
        partitioned: tuple[NamespacedCluster, Bus, Watch], data_dir: Path, reference: dict,
        tmp_path: Path) -> None:
    cluster, bus, watch = partitioned
    name = "lossy"
    states = await job_states(bus, f"{name}-1")
    lossy_at = 0.0

    async def lose(job_id: str, watch: Watch) -> None:
        nonlocal lossy_at
        await progressed(watch, job_id, 40)
        lossy_at = time.time()
        cluster.net.isolate(LOSSY, PERCENT)
        try:
            await asyncio.sleep(LOSS_S)  # the loss is a duration, not an event
        finally:
            cluster.net.heal()

    rec, generations = await run_job((cluster.data_dir, bus, watch), data_dir, tmp_path,
                                     name, lose)
    steps = check_run(rec, tmp_path / "final.pt", reference)
    # The stalls within the window, its edges included: a job that stopped committing at
    # any point of it shows.
    gaps = [b - a for a, b in
            itertools.pairwise([lossy_at, *during_loss(steps, lossy_at), lossy_at + LOSS_S])]
    pause = max(gaps)
    _, usual = record.downtime(steps, lossy_at)
    print(f"{len(gaps) - 1} steps committed in the {LOSS_S:g} s of loss, the longest pause "
          f"{pause:.2f} s (usually {usual:.3f}; {PAUSE_S:g} s expected on an idle machine); "
          f"generations {[(g.generation, g.world_size, g.cause) for g in generations]}")
    # Never hung: the longest stall within the window, its edges included, is the
    # detection and rebuild's (PAUSE_S on an idle machine), not the window's length (the
    # deadlock this test was written for stalled through the whole loss).
    assert pause <= PAUSE_S + SLACK_S, (len(gaps) - 1, pause)
    kept = {m.replica_id for m in generations[-1].members}
    dropped = {m.replica_id for m in generations[0].members} - kept
    check_cut_off(rec, steps, generations, dropped, states)
