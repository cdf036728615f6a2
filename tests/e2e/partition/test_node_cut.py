"""Nodes cut from each other while the bus reaches every one (issue 53): a partition the
control plane cannot see.

Both nodes stay alive to health, every rank keeps reporting progress while it waits, and
no process fails: gloo's connections between the nodes only go silent. Before the
runtime asked which peers answer, the job froze for as long as the cut lasted plus a few
seconds (26.5 s for a 20 s cut), and a cut longer than gloo's 30 s timeout was reported
only after another 30 s, to form the same members again. Now a collective that makes no
progress for ``unreachable_after_s`` probes its peers' nodes (:mod:`phalanx.runtime.reach`);
each member names those it cannot reach, elasticity drops the smaller side (on a tie,
the side without rank 0) within the documented bound, the dropped ranks exit
``Dropped``, and the job trains on without them, bitwise as it trains alone, with no
step the job keeps committed twice, admitted once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from cuts import check_cut_off, job_states
from e2e_cli import next_of
from test_elastic import Watch, check_run, progressed, run_job

from phalanx.bench.partition_harness import NamespacedCluster, exited, ranks_on
from phalanx.bus.client import Bus
from phalanx.runtime import record
from phalanx.runtime.reach import PROBE_S, UNREACHABLE_AFTER_S
from phalanx.schemas.messages import Generation

#: From the cut until the generation without the unreachable side is published: the
#: collective's wait without progress, the wake-up that finds it past (every 0.5 s), the
#: probe (docs/architecture.md, "A cut between nodes").
BOUND_S = UNREACHABLE_AFTER_S + 0.5 + PROBE_S
#: The report's and the generation's way over the bus, this test's wake-up, and a loaded
#: machine's late timers (the fence's were 0.6 s late at load 15: test_bus_cut.py).
SLACK_S = 2.0
#: Steps the survivors train while the cut still holds.
TRAINED_CUT = 20


@pytest.mark.timeout(150)
async def test_nodes_cut_from_each_other_drop_one_side_and_train_on(
        partitioned: tuple[NamespacedCluster, Bus, Watch], data_dir: Path, reference: dict,
        tmp_path: Path) -> None:
    cluster, bus, watch = partitioned
    name = "nodecut"
    states = await job_states(bus, f"{name}-1")
    cut_at = formed_s = 0.0
    during: list[Generation] = []
    stopped: dict[str, float] = {}

    async def cut(job_id: str, watch: Watch) -> None:
        nonlocal cut_at, formed_s
        await progressed(watch, job_id, 40)
        ranks = {node: ranks_on(cluster, node, job_id) for node in cluster.net.nodes}
        assert [len(r) for r in ranks.values()] == [2, 2], ranks
        cut_at = time.time()
        cluster.net.cut("local-0", "local-1")
        try:
            during.append(await next_of(watch.generations, lambda g: g.job_id == job_id,
                                        60.0))
            formed_s = time.time() - cut_at
            # One node's ranks, and they exit (Dropped) while the cut holds.
            kept = {m.replica_id for m in during[0].members}
            [gone] = [node for node, on in ranks.items()
                      if not kept & {r["replica_id"] for r in on}]
            ends = await asyncio.gather(*(exited(r["pid"], 10.0) for r in ranks[gone]))
            stopped.update({r["replica_id"]: end - cut_at
                            for r, end in zip(ranks[gone], ends, strict=True)})
            # The others train on, cut off from them.
            await progressed(watch, job_id, during[0].resume_step + TRAINED_CUT)
        finally:
            cluster.net.heal()

    rec, generations = await run_job((cluster.data_dir, bus, watch), data_dir, tmp_path,
                                     name, cut)
    generations[1:1] = during
    print(f"generation without the unreachable formed {formed_s:.2f} s after the cut "
          f"(bound {BOUND_S:g} s); dropped ranks stopped {stopped}")
    [g1] = during
    assert g1.world_size == 2 and "unreachable" in g1.cause, g1
    # Formed while the cut held (the survivors then trained TRAINED_CUT steps in it), within
    # the bound.
    assert formed_s <= BOUND_S + SLACK_S
    assert len(stopped) == 2
    # Nothing more changed: the dropped side is not replaced (its node cannot reach the
    # rest while the cut holds), and nobody else was dropped.
    assert [g.world_size for g in generations] == [4, 2], generations
    steps = check_run(rec, tmp_path / "final.pt", reference)
    pause, usual = record.downtime(steps, cut_at)
    print(f"longest pause between commits after the cut {pause:.2f} s (usually {usual:.3f})")
    check_cut_off(rec, steps, generations, set(stopped), states)
