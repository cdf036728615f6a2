"""The in-memory checkpoint tier end to end: a job whose ranks ALL die resumes from memory.

A 4-replica job of ``examples/train_mlp.py`` on a local cluster (2 agents x 2
slots) snapshots committed steps into its agents' shared memory at the interval
the ranks agree on (``checkpoint.memory_every_steps: auto``, the default). Every
rank SIGKILLs itself before the same step (``PHALANX_CHAOS_KILL``), so no
process holds the job's state any more; the agents live. Elasticity starts
replacements; they must restore the newest step from the nodes' memory and
train to the end: parameters and every step's loss equal to the fault-free
run (deterministic mode), every step after the restored one trained exactly
once, every sample once per epoch. Every rank snapshotted the same steps, and the
restore is from the newest of them before the kill (nothing older is lost).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    Watch,
    check_run,
    data_dir,  # noqa: F401  (a fixture)
    fault_free,
    progressed,
    run_job,
    watched_cluster,
)

from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import GenerationReason, NodeRecord

pytestmark = pytest.mark.slow
STEPS = 120
KILL_BEFORE = 60


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    return fault_free(data_dir, tmp_path_factory.mktemp("reference"), STEPS)


async def test_every_rank_killed_the_job_resumes_from_the_nodes_memory(
        data_dir: Path, reference: dict, tmp_path: Path,  # noqa: F811
        tmp_path_factory: pytest.TempPathFactory) -> None:
    kill = ",".join(f"r{slot}-0:{KILL_BEFORE}:boundary" for slot in range(4))
    async with watched_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        _, bus, _ = cluster

        async def started(job_id: str, watch: Watch) -> None:
            await progressed(watch, job_id, 5)

        rec, generations = await run_job(cluster, data_dir, tmp_path, "allkilled",
                                         started, env={"PHALANX_CHAOS_KILL": kill},
                                         steps=STEPS)
        nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        entries, _ = await nodes.entries()
        limits = {e.value.node.node_id: e.value.snapshot_limit_bytes for e in entries}
        assert all(limit > 0 for limit in limits.values()), limits
    records = record.read(rec)
    restores = [line for lines in records.values() for line in lines
                if line["kind"] == "restore"]
    # The adaptive interval is agreed: every rank that died snapshotted the same steps.
    snapshotted = {replica: {line["step"] + 1 for line in lines
                             if line["kind"] == "commit" and "snapshot_s" in line}
                   for replica, lines in records.items() if replica.endswith("-0")}
    assert len(snapshotted) == 4 and len({frozenset(s) for s in snapshotted.values()}) == 1, \
        snapshotted
    newest = max(step for step in snapshotted["r0-0"] if step <= KILL_BEFORE)
    # Every replacement restored the newest step every rank snapshotted before it died.
    assert restores and {line["step"] for line in restores} == {newest}, restores
    assert all(line["corrupt"] == [] for line in restores)
    assert {r for r in records if r.endswith("-1")} == {"r0-1", "r1-1", "r2-1", "r3-1"}
    assert generations[0].reason is GenerationReason.START
    check_run(rec, tmp_path / "final.pt", reference)
