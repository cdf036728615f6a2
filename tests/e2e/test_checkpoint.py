"""The in-memory checkpoint tier end to end: a job whose ranks ALL die resumes from memory.

A 2-replica job of ``examples/train_mlp.py`` on a local cluster (2 agents x 1 slot: one
rank per node; more ranks per node would snapshot more shards of the same kind, each
rank a torch process of seconds of CPU, and prove nothing more) snapshots committed
steps into its agents' shared memory at the interval the ranks agree on
(``checkpoint.memory_every_steps: auto``, the default). Once step 60 is reported, every
rank is frozen at once (SIGSTOP, pids from the agents' manifests) and then SIGKILLed, so
no process holds the job's state any more; the agents live. (Ranks that killed
themselves before a step, as this test once did, did not all die: a rank already past
that step when the first died trained on, and its replacement peers adopted its state
instead of restoring.) Elasticity starts replacements; they must restore the newest step
from the nodes' memory and train to the end: parameters and every step's loss equal to
the fault-free run (deterministic mode), every step after the restored one trained
exactly once by the replacements (what the dead ranks committed after it died with them:
up to one snapshot interval is retrained), every sample once per epoch. Every rank
snapshotted the same steps, and the restore is from the newest of them at least (nothing
older is lost).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    FaultFreeRuns,
    Watch,
    check_run,
    progressed,
    run_job,
    watched_cluster,
)

from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import GenerationReason, NodeRecord, ReplicaRange
from phalanx.services.manifest import running_in_manifest

# The replacements must find steps left when they are ready: every rank dies at step 60
# (paced until then, run_job), so none trains before they are; more steps after the
# restore would prove nothing more.
STEPS = 200
KILL_AFTER = 60
# An LR schedule, an EMA and a counter stepped after each commit: a restore that missed
# what the script did after commit() (the snapshot taken at commit) differs from the run.
SCHEDULE = ["--schedule"]
REPLICAS = 2  # on 2 agents x 1 slot


@pytest.fixture(scope="module")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    return fault_free_runs(STEPS, SCHEDULE)


async def test_every_rank_killed_the_job_resumes_from_the_nodes_memory(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    async with watched_cluster(tmp_path_factory.mktemp("cluster"), "--slots-per-agent", "1") \
            as cluster:
        cluster_dir, bus, _ = cluster

        async def kill_all(job_id: str, watch: Watch) -> None:
            await progressed(watch, job_id, KILL_AFTER)
            ranks = [rank["pid"] for manifest in cluster_dir.glob("agents/*/ranks.json")
                     for rank in running_in_manifest(manifest)]  # the agents' own list
            assert len(ranks) == REPLICAS, ranks
            for pid in ranks:  # frozen first: none trains on while the others die
                os.kill(pid, signal.SIGSTOP)
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)

        rec, generations = await run_job(cluster, data_dir, tmp_path, "allkilled",
                                         kill_all, steps=STEPS, args=SCHEDULE,
                                         spec={"replicas": ReplicaRange(min=2, max=REPLICAS)})
        nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        entries, _ = await nodes.entries()
        limits = {e.value.node.node_id: e.value.snapshot_limit_bytes for e in entries}
        assert all(limit > 0 for limit in limits.values()), limits
    records = record.read(rec)
    restores = [line for lines in records.values() for line in lines
                if line["kind"] == "restore"]
    # The adaptive interval is agreed: every rank that died snapshotted the same steps (up
    # to where each was frozen: one may have recorded a snapshot another had not yet).
    snapshotted = {replica: {line["step"] + 1 for line in lines
                             if line["kind"] == "commit" and "snapshot_s" in line}
                   for replica, lines in records.items() if replica.endswith("-0")}
    assert len(snapshotted) == REPLICAS, snapshotted
    newest = min(max(steps) for steps in snapshotted.values())
    assert len({frozenset(s for s in steps if s <= newest)
                for steps in snapshotted.values()}) == 1, snapshotted
    # The first replacements restored one step, at least the newest every rank recorded
    # (a rank frozen between its snapshot and its record line holds one newer).
    restored = {line["step"] for line in restores}
    assert len(restored) == 1 and min(restored) >= newest, (restores, newest)
    assert all(line["corrupt"] == [] for line in restores)
    restorers = {r for r, lines in records.items() if any(
        line["kind"] == "restore" for line in lines)}
    assert restorers <= {f"r{s}-1" for s in range(REPLICAS)} and len(restorers) >= 2, restorers
    assert generations[0].reason is GenerationReason.START
    # What the dead ranks committed after the restored step died with them: under the
    # adaptive interval a whole-job loss retrains up to one interval (docs/runtime.md).
    # Without those commits, every step must have been trained exactly once.
    (step,) = restored
    lost = max(line["step"] for replica, lines in records.items() if replica.endswith("-0")
               for line in lines if line["kind"] == "commit")
    assert lost - step < 100, (lost, step)  # checkpoint.memory_max_every_steps
    kept = tmp_path / "rec-kept"
    kept.mkdir()
    for replica, lines in records.items():
        (kept / f"{replica}.jsonl").write_text("".join(
            json.dumps(line) + "\n" for line in lines
            if not (replica.endswith("-0") and line["kind"] in ("commit", "batch")
                    and line["step"] >= step)))
    check_run(kept, tmp_path / "final.pt", reference)
