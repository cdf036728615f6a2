"""The elasticity leader cut from the bus while it holds the lease (issue 53).

The leader runs in a network namespace of its own (:mod:`harness`, a host with no
agent), its standby on this machine beside the other services. While a job trains, the
leader's host is cut from the bus, both ways, or one way (it hears the bus, the bus does
not hear it), and a rank is killed, so that a decision must be made during the cut.

The rule (docs/architecture.md, "Fencing"): a leader stops acting ``lease_s * 2 / 3``
after sending its last renewal that the bus confirmed (:func:`~phalanx.services.lease.
acts_until`), and a standby takes over no sooner than ``lease_s`` after it. Before, a
cut leader acted on until a renewal retried through the 15 s failover gave up. The
test checks, from the instances' own logs and from watches of the lease, the job's
generation record and elasticity's stored job state (each change with its revision,
seen from this machine, which the cut never reaches):

- the cut leader stopped within the bound, and before its successor led;
- its successor made the decision the fault needed (a generation without the killed
  rank, then its replacement's), and nothing the deposed leader decided was stored
  after its successor's first write: every watched key's changes only move forward;
- once the link heals, the old leader answers on the bus again as a standby, and the
  lease is never its own again;
- the job ends finished, admitted once, bitwise as the job trains alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from cuts import job_states
from e2e_cli import next_of
from test_elastic import Watch, check_run, progressed, run_job

from phalanx.bench.partition_harness import (
    BUS,
    NamespacedCluster,
    answering,
    holder,
    lead_from,
    log_lines,
    ranks_on,
)
from phalanx.bus.client import Bus
from phalanx.bus.kv import Change, TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobSnapshot,
    JobState,
    Lease,
)
from phalanx.services.lease import ACTS_FOR

#: The namespace the leader runs in, and the instances.
HOST = "ctl"
CUT, STANDBY = "elasticity-ctl", "elasticity"
#: Elasticity's lease (its default).
LEASE_S = 3.0
#: How long the cut lasts: past the latest takeover (``lease_s * 5 / 3`` after the last
#: renewal) and the successor's decisions.
CUT_S = 6.0
#: The timer's wake-up, and reading the log's clock against this test's.
SLACK_S = 0.5
#: The module's cluster (conftest's ``partitioned``): two nodes of two slots and a host
#: with no agent, each in its namespace; no elasticity instance yet (each test starts
#: them where it wants them).
CLUSTER = {"hosts": (HOST,), "elasticity_instances": 0}


async def watched(bucket: TypedKV[Any], changes: list[tuple[float, Change[Any]]]) -> None:
    async for change in bucket.watch():
        if change is not None:
            changes.append((time.time(), change))


def forward(changes: list[tuple[float, Change[Any]]], key: str, order: Any) -> None:
    """``key``'s watched changes, in revision order, never go back by ``order``."""
    mine = sorted((c for _, c in changes if c.key == key and c.value is not None),
                  key=lambda c: c.revision)
    orders = [order(c.value) for c in mine]
    assert orders == sorted(orders), [(c.revision, o) for c, o in zip(mine, orders,
                                                                      strict=True)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("both", [True, False], ids=["both-ways", "heard-not"])
async def test_a_leader_cut_from_the_bus_stops_before_its_standby_takes_over(
        partitioned: tuple[NamespacedCluster, Bus, Watch], data_dir: Path, reference: dict,
        tmp_path: Path, both: bool) -> None:
    cluster, bus, watch = partitioned
    leases = await TypedKV.open(bus.js, subjects.LEASES_BUCKET, Lease)
    await lead_from(cluster, bus, leases, HOST, "elasticity", CUT, STANDBY)
    name = "leadcut" if both else "leaddeaf"
    job_id = f"{name}-1"
    states = await job_states(bus, job_id)
    lease_changes: list[tuple[float, Change[Lease]]] = []
    generation_changes: list[tuple[float, Change[Generation]]] = []
    snapshot_changes: list[tuple[float, Change[JobSnapshot]]] = []
    watches = [asyncio.create_task(watched(bucket, changes)) for bucket, changes in (
        (leases, lease_changes),
        (await TypedKV.open(bus.js, subjects.GENERATIONS_BUCKET, Generation),
         generation_changes),
        (await TypedKV.open(bus.js, subjects.ELASTICITY_BUCKET, JobSnapshot),
         snapshot_changes))]
    during: list[Generation] = []
    cut_at = healed_at = 0.0
    back: set[str] = set()
    victim: dict[str, Any] = {}
    back_s: list[float] = []

    async def cut(job_id: str, watch: Watch) -> None:
        nonlocal cut_at, healed_at, back
        await progressed(watch, job_id, 40)
        victim.update(ranks_on(cluster, "local-1", job_id)[0])
        cut_at = time.time()
        cluster.net.cut(HOST, BUS, both=both)  # one way: what the host sends is dropped
        try:
            await asyncio.sleep(0.3)
            os.kill(victim["pid"], signal.SIGKILL)  # a decision to make during the cut
            # (A takeover publishes the current generation again first: ranks ignore it.)
            during.append(await next_of(watch.generations, lambda g: g.job_id == job_id
                                        and g.generation > 0, CUT_S))
            await asyncio.sleep(max(0.0, cut_at + CUT_S - time.time()))
        finally:
            cluster.net.heal()
        healed_at = time.time()
        for _ in range(60):  # its connection resumes at TCP's next retransmission
            back = await answering(bus, "elasticity", 0.5)
            if CUT in back:
                back_s.append(time.time() - healed_at)
                break

    try:
        rec, generations = await run_job((cluster.data_dir, bus, watch), data_dir,
                                         tmp_path, name, cut)
    finally:
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
    generations[1:1] = during
    generations = list({g.generation: g for g in generations}.values())  # re-published

    # The cut leader stopped within the bound, before its successor led.
    cut_log, standby_log = log_lines(cluster, CUT), log_lines(cluster, STANDBY)
    [stop] = [line for line in cut_log
              if line["ts"] >= cut_at and line["msg"].startswith("deposed")]
    deposed = stop["ts"]
    took = min(line["ts"] for line in standby_log
               if line["ts"] >= cut_at and line["msg"] == "leading")
    print(f"cut leader stopped {deposed - cut_at:.2f} s after the cut (bound "
          f"{LEASE_S * ACTS_FOR:g} s), its successor led {took - cut_at:.2f} s after the cut; "
          f"the old leader answered again {back_s} s after the heal")
    assert deposed - cut_at <= LEASE_S * ACTS_FOR + SLACK_S
    # By its own clock: stopped at its deadline by the timer, not by a later check.
    assert stop["unconfirmed_s"] <= LEASE_S * ACTS_FOR + SLACK_S, stop
    assert deposed < took
    # The standby watched the last renewal for a whole lease: a third of one after the
    # old leader stopped (its renewal sent ``unconfirmed_s`` before it stopped).
    assert took - (deposed - stop["unconfirmed_s"]) >= LEASE_S - 0.05, (took, stop)
    # Nothing the deposed leader decided went out after it stopped (its log says what it
    # published), nor did it lead again.
    assert not [line for line in cut_log if line["ts"] > deposed
                and line["msg"] in ("generation", "leading")], cut_log[-5:]
    # The lease passed once, forward, and never back; the job's generation record and
    # elasticity's stored state of it only moved forward, through both leaders' writes.
    forward(lease_changes, "elasticity", lambda lease: lease.epoch)
    holders = [c.value.holder for _, c in sorted(lease_changes, key=lambda t: t[1].revision)
               if c.key == "elasticity" and c.value is not None]
    assert holders[holders.index(STANDBY):] == [STANDBY] * (len(holders)
                                                           - holders.index(STANDBY)), holders
    forward(generation_changes, job_id, lambda g: g.generation)
    forward(snapshot_changes, job_id, lambda snapshot: snapshot.seq)
    # The successor made the fault's decision: a generation without the killed rank.
    assert during and victim["replica_id"] not in {m.replica_id for m in during[0].members}
    # Healed, the old leader is on the bus again, standing by.
    assert back >= {CUT, STANDBY}, back
    assert await holder(leases, "elasticity") == STANDBY
    # The job: admitted once, finished, bitwise as alone.
    check_run(rec, tmp_path / "final.pt", reference)
    assert all(g.reason is not GenerationReason.START for g in generations[1:]), generations
    ended = next(i for i, s in enumerate(states) if s.terminal)
    assert set(states[:ended]) <= {JobState.ADMITTED}, states
    assert set(states[ended:]) == {JobState.FINISHED}, states
