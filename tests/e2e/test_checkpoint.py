"""The in-memory checkpoint tier end to end: a job whose ranks ALL die resumes from memory.

A 4-replica job of ``examples/train_mlp.py`` on a local cluster (2 agents x 2
slots) snapshots every committed step into its agents' shared memory. Every
rank SIGKILLs itself before the same step (``PHALANX_CHAOS_KILL``), so no
process holds the job's state any more; the agents live. Elasticity starts
replacements; they must restore the newest step from the nodes' memory and
train to the end: parameters and every step's loss equal to the fault-free
run (deterministic mode), no step trained twice or skipped, every sample once
per epoch, and the restore from exactly the step the ranks died before.
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
    # Every replacement restored the step every rank died before: nothing lost, nothing
    # trained twice.
    assert restores and {line["step"] for line in restores} == {KILL_BEFORE}, restores
    assert all(line["corrupt"] == [] for line in restores)
    assert {r for r in records if r.endswith("-1")} == {"r0-1", "r1-1", "r2-1", "r3-1"}
    assert generations[0].reason is GenerationReason.START
    check_run(rec, tmp_path / "final.pt", reference)
