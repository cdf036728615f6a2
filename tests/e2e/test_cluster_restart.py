"""A cluster restart under a running job: the same job comes back by itself.

A 2-replica job of ``examples/train_mlp.py`` (2 agents x 1 slot: one rank per node, each
node holding its own rank's snapshots and its buddy's replicas; more ranks per node would
hold more shards of the same kind, each rank a torch process of seconds of CPU, and prove
nothing more) snapshots into its nodes' memory every step and persists every ``EVERY``
steps. Once a durable step is
committed, ``phalanx down`` stops everything (services first, then the agents, which
stop the ranks and report them lost), and ``phalanx up`` (same data dir) starts it
again. Nothing is resubmitted: health faults the lost ranks from the job-events
stream, elasticity launches one replacement per slot (asking the agents until they
are up), and the replacements restore the newest complete step their nodes' memory
kept — or, when the machines rebooted meanwhile (their shared memory wiped), the
newest durable step. The script steps a warmup + cosine schedule, an EMA and a counter
after each commit and clips. The job ends ``finished`` with parameters (EMA, schedule
and counter included) and every step's loss equal to the script run alone
(deterministic mode), every step after the restored one trained once, every replica
launched once, and its history saying that every old member was dropped, the
replacements joined, and where their state came from.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from e2e_cli import next_of, phalanx
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    ARGS,
    PACE_S,
    RUN_ENV,
    SCRIPT,
    FaultFreeRuns,
    check_run,
    watched_cluster,
    without_lost_work,
    write_records,
)

from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobHistory,
    JobState,
    SnapshotRecord,
    SnapshotTier,
    StateSource,
)
from phalanx.services.agent.snapshots import default_root

pytestmark = pytest.mark.timeout(300)  # two clusters, one after the other
STEPS = 200
EVERY = 20  # durable_every_steps
JOB = "restart-1"
SCHEDULE = ["--schedule"]
REPLICAS = 2  # on 2 agents x 1 slot
ONE_SLOT = ("--slots-per-agent", "1")


@pytest.fixture(scope="module")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    """The fault-free run both restarts are compared with (the same job)."""
    return fault_free_runs(STEPS, SCHEDULE)


def spec_file(path: Path, data: Path, out: Path, release: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "restart", "team": "t", "priority_class": "normal",
        "replicas": {"min": 2, "max": 4},
        "command": [sys.executable, str(SCRIPT), "--data-dir", str(data), *ARGS, *SCHEDULE,
                    "--steps", str(STEPS), "--save", str(out / "final.pt")],
        # Paced until the release file exists, so the job is mid-run when the cluster stops.
        "env": {"PHALANX_RECORD_DIR": str(out / "rec"), **RUN_ENV,
                "PHALANX_CHAOS_PACE": f"{PACE_S}:{release}"},
        "hang_timeout_s": 2.0, "grace_period_s": 3.0,
        "checkpoint": {"memory_every_steps": 1, "durable_every_steps": EVERY}}))
    return path


def launch_headers(cluster: Path) -> dict[str, int]:
    """How many times each replica of the job was started (the agent's header lines)."""
    counts: dict[str, int] = {}
    for log in cluster.glob(f"agents/*/jobs/{JOB}/*.log"):
        starts = log.read_text().count(f" of {JOB} starting on ")
        counts[log.stem] = counts.get(log.stem, 0) + starts
    return counts


@pytest.mark.parametrize("reboot", [False, True], ids=["memory", "durable"])
async def test_a_job_running_when_the_cluster_restarts_resumes_by_itself(
        data_dir: Path, reference: dict, tmp_path: Path, reboot: bool) -> None:
    cluster = tmp_path / "cluster"
    out, release = tmp_path / "out", tmp_path / "release"

    # 1. The job trains and persists a step; then the whole cluster stops under it.
    async with watched_cluster(cluster, *ONE_SLOT) as (_, bus, watch):
        persisted = asyncio.Event()

        async def on_snapshot(announced: SnapshotRecord, _) -> None:
            if announced.tier is SnapshotTier.DURABLE:
                persisted.set()

        await bus.subscribe(subjects.ckpt_snapshot(JOB), SnapshotRecord, on_snapshot)
        phalanx("submit", str(spec_file(tmp_path / "job.yaml", data_dir, out, release)),
                "--job-id", JOB, "--data-dir", str(cluster))
        await asyncio.wait_for(persisted.wait(), 180)
    trained = max(s.step for s in record.timeline(record.read(out / "rec")))
    assert trained < STEPS - 1, "the job finished before the cluster stopped"

    if reboot:  # the machines rebooted: their shared memory is gone, storage is not
        for agent in (cluster / "agents").iterdir():
            shutil.rmtree(default_root(agent.name, agent), ignore_errors=True)

    # 2. The cluster comes back; the same job goes on by itself, at full speed now.
    release.touch()
    async with watched_cluster(cluster, *ONE_SLOT) as (_, bus, watch):
        ended = await next_of(watch.states, lambda r: r.job_id == JOB and r.state.terminal,
                              180)
        assert ended.state is JobState.FINISHED, ended.reason
        histories = await TypedKV.open(bus.js, subjects.HISTORY_BUCKET, JobHistory)
        history = (await histories.get(JOB)).value

    records = record.read(out / "rec")
    # What the stopped ranks committed after the restored step is trained again.
    check_run(write_records(without_lost_work(records, STEPS), tmp_path / "rec-kept"),
              out / "final.pt", reference)
    restores = [line for lines in records.values() for line in lines
                if line["kind"] == "restore"]
    # From the nodes' own memory (or durable storage after a reboot), at a step no older
    # than the last persisted one.
    tier = "durable" if reboot else "memory"
    assert restores and all(r["tier"] == tier for r in restores), restores
    assert min(r["step"] for r in restores) >= EVERY, restores
    # Every replica launched once: the first ones, then one replacement per slot.
    assert launch_headers(cluster) == {f"r{s}-{i}": 1 for s in range(REPLICAS)
                                       for i in (0, 1)}
    # The history: every old member dropped at once, the replacements joined.
    replacements = {f"r{s}-1" for s in range(REPLICAS)}
    after = [g for g in history.generations if set(g.members) & replacements]
    assert after, history
    # ... and says where the state came from: the nodes' memory (own snapshots, with the
    # buddies' replicas where a node's own copy of a shard was older), or durable storage.
    assert after[0].restored_from in ((StateSource.DURABLE,) if reboot else (
        StateSource.MEMORY, StateSource.BUDDY)), history
    dropped = " ".join(g.cause for g in history.generations)
    assert all(f"r{s}-0" in dropped for s in range(REPLICAS)), history
