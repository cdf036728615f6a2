"""A minority nats-server (issue 53): one server of a three-server NATS cluster cut from
the other two while a job trains, and a rank killed during the cut so that a decision is
due while it lasts.

Each server runs on a host of the network of its own (:func:`~phalanx.bench.
partition_harness.nats_servers`), the buckets replicated on all three; the cut is
between the servers only: every client still reaches the one it is connected to. What is
connected to the minority (an agent, a service, a rank: nats-py picks a server at
random) publishes into a server the majority no longer hears, and its JetStream writes
fail, until it moves to the majority (:mod:`phalanx.bus.majority`). The job must get its
decision and train on through the majority, and end ``finished``, bitwise as alone,
every sample once, with no step the job keeps committed twice nor any by a rank it had
left, admitted once.

Seen before the move (2026-12-07): with the elasticity leader's connection on the
minority server, the leader lost its lease every 2 s and took it back at once (68 terms
in the cut; renewals through the minority and the rest through the majority do exactly
that: ``tests/integration/test_bus_majority.py``), and decided nothing: the
killed rank's peers gave the generation up at gloo's 30 s timeout and the job stood
still until the test's timeout. With elasticity on the majority (health on the
minority, flapping its lease the same way) the job got its decision 7.7 s after the cut,
and dropped the node whose agent was on the minority (its ranks healthy, and never
fenced: the minority server still answers the agent's round trips). With the move: the
minority's clients (an agent, elasticity, admission, checkpoint) left it 2.1-2.5 s after
the cut; the decision came 7.5, 20.0 and 11.1 s after the cut in three runs (first the
streams whose leaders were on the minority elect anew, 4-9 s; in the second a launch
request went unanswered for its 10 s).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from cuts import check_cut_off, job_states
from e2e_cli import next_of
from test_elastic import Watch, check_run, progressed, run_job

from phalanx.bench.partition_harness import NamespacedCluster, ranks_on
from phalanx.bus.client import Bus
from phalanx.schemas.messages import Generation

#: The module's cluster (conftest's ``partitioned``): two nodes of two slots, the bus a
#: cluster of three nats-servers, each on a host of its own.
CLUSTER = {"nats_hosts": 3}
MINORITY, MAJORITY = "nats-2", ("nats-0", "nats-1")
#: Steps the job trains in a generation without the killed rank while the cut holds.
TRAINED_CUT = 20


@pytest.mark.timeout(180)
async def test_a_job_trains_on_through_the_majority_of_a_nats_cluster(
        partitioned: tuple[NamespacedCluster, Bus, Watch], data_dir: Path, reference: dict,
        tmp_path: Path) -> None:
    cluster, bus, watch = partitioned
    name = "minority"
    states = await job_states(bus, f"{name}-1")
    during: list[Generation] = []
    timings: dict[str, float] = {}

    async def cut(job_id: str, watch: Watch) -> None:
        await progressed(watch, job_id, 40)
        victim = ranks_on(cluster, "local-1", job_id)[0]
        cut_at = time.time()
        for server in MAJORITY:
            cluster.net.cut(MINORITY, server)
        try:
            await asyncio.sleep(0.5)
            os.kill(victim["pid"], signal.SIGKILL)  # a decision due during the cut
            # Decided while the cut holds: a generation without the killed rank ...
            while not during or victim["replica_id"] in {m.replica_id
                                                         for m in during[-1].members}:
                during.append(await next_of(watch.generations,
                                            lambda g: g.job_id == job_id, 90.0))
            timings["decided_s"] = time.time() - cut_at
            # ... in which the job trains on.
            await progressed(watch, job_id, during[-1].resume_step + TRAINED_CUT)
            timings["trained_s"] = time.time() - cut_at
        finally:
            cluster.net.heal()

    rec, generations = await run_job((cluster.data_dir, bus, watch), data_dir, tmp_path,
                                     name, cut)
    generations = sorted({g.generation: g for g in [*generations, *during]}.values(),
                         key=lambda g: g.generation)
    print(f"from the cut: the decision {timings['decided_s']:.2f} s, {TRAINED_CUT} steps "
          f"trained in it {timings['trained_s']:.2f} s; generations "
          f"{[(g.world_size, g.cause) for g in generations[1:]]}")
    steps = check_run(rec, tmp_path / "final.pt", reference)
    members = [{m.replica_id for m in g.members} for g in generations]
    check_cut_off(rec, steps, generations, set().union(*members) - members[-1], states)
