"""SyncBatchNorm under the session end to end, as under DDP, through a kill and scaling.

``sync_batchnorm_cnn.py`` (examples/cnn_model.py's CNN converted with
``convert_sync_batchnorm``, the port's DDP-shaped loop) runs as a 4-replica job
on a local cluster, not in deterministic mode, each member one micro-batch a
step. ``r1-0`` dies before its forward at step 8, so its peers wait for it in
their first statistics all-reduce: the step is poisoned there, given up, and run
again whole by the three left (shares of 22, 21 and 21 images); a replacement
joins; the job is scaled to 2 and back to 4. It must finish with every step's
BatchNorm statistics the same on every rank (the digest each rank records at
each commit), every image of an epoch once, no kept gradient ever reused (a
SyncBatchNorm step is never repaired), and a loss curve that of the script
alone, where plain BatchNorm over the one micro-batch of the whole global batch
computes what SyncBatchNorm computes over the members' shares (and what DDP
with SyncBatchNorm computes with a batch a rank; torch's own refuses the CPU, so
it cannot be run beside this one here): equal up to the order of the sums,
which differs at each world size (BatchNorm over each rank's quarter differs by
1.7e-3 at the first step already).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from e2e_cli import next_of
from test_elastic import drain, watched_cluster, without_lost_work, write_records
from test_gpt import run_alone

from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobSpec,
    JobState,
    Placement,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient

pytestmark = pytest.mark.timeout(420)
SCRIPT = Path(__file__).with_name("sync_batchnorm_cnn.py")
EPOCHS, SAMPLES, GLOBAL_BATCH = 3, 1280, 64
ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--global-batch",
        str(GLOBAL_BATCH), "--micro-batch", str(GLOBAL_BATCH)]
ORDER = ElasticOrder(SAMPLES, GLOBAL_BATCH, seed=0, drop_last=True)
STEPS = EPOCHS * ORDER.steps_per_epoch  # 60
KILL_STEP = 8
# Paced until the scaling's last generation trains: 0.8 s a step leaves 48 s for the
# three changes (they took about 10 steps in a run on the 2-core VM).
PACE_S = 0.8


async def test_sync_batchnorm_trains_as_alone_through_a_kill_in_its_rounds_and_scaling(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = run_alone(SCRIPT, ARGS, tmp_path / "alone", {})
    rec, release = tmp_path / "rec", tmp_path / "release"
    spec = JobSpec(name="syncbn", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=4), placement=Placement(),
                   command=[sys.executable, str(SCRIPT), *ARGS],
                   env={"PHALANX_RECORD_DIR": str(rec),
                        "PHALANX_CHAOS_KILL": f"r1-0:{KILL_STEP}:forward",
                        "PHALANX_CHAOS_PACE": f"{PACE_S}:{release}"},
                   hang_timeout_s=5.0, grace_period_s=3.0, session=True)
    cluster_dir = tmp_path_factory.mktemp("syncbn-cluster")
    async with watched_cluster(cluster_dir) as (_, bus, watch):
        for queue in (watch.generations, watch.progress, watch.states):
            drain(queue)
        client = AdmissionClient(bus)
        job = await client.submit(spec, "syncbn-1")

        async def reaches(size: int, reason: GenerationReason | None = None) -> Generation:
            return await next_of(watch.generations, lambda g: g.job_id == job.job_id
                                 and g.world_size == size
                                 and reason in (None, g.reason), 120)

        try:
            await reaches(4, GenerationReason.START)
            await reaches(3, GenerationReason.FAULT)  # r1-0, dead in the step's rounds
            await reaches(4)  # its replacement
            await client.scale(job.job_id, 2)
            await reaches(2)
            await client.scale(job.job_id, 4)
            grown = await reaches(4)
            await next_of(watch.progress, lambda p: p.job_id == job.job_id
                          and p.generation == grown.generation, 120)
            release.touch()
            end = await next_of(watch.states,
                                lambda r: r.job_id == job.job_id and r.state.terminal, 240)
            assert end.state is JobState.FINISHED, end.reason
        except BaseException:
            with contextlib.suppress(Exception):  # the cluster goes down with the test
                await client.cancel(job.job_id, retry_s=5.0)
            raise
    records = record.read(rec)
    died = [line["step"] for line in records["r1-0"] if line["kind"] == "chaos"]
    assert died == [KILL_STEP], died
    # Its peers were waiting for it in their first statistics all-reduce: each gave the
    # step up there, and went on without an exception through the script's loop.
    poisoned = {log.stem for log in cluster_dir.glob("agents/*/jobs/*/r*-0.log")
                if f"step {KILL_STEP} aborted in a SyncBatchNorm all-reduce"
                in log.read_text()}
    assert poisoned == {"r0-0", "r2-0", "r3-0"}, poisoned
    # Never repaired: an aborted SyncBatchNorm step runs again whole.
    assert not any(line.get("kept") for lines in records.values() for line in lines
                   if line["kind"] == "batch")
    kept = record.read(write_records(without_lost_work(records, STEPS), tmp_path / "kept"))
    assert record.verify(kept, ORDER, STEPS) == []  # every image of an epoch once
    # The statistics every rank holds after each step: one copy per step, on every rank.
    digests: dict[tuple[int, int], set[str]] = {}
    ranks: dict[tuple[int, int], int] = {}
    for lines in kept.values():
        for line in lines:
            if line["kind"] == "commit":
                key = (line["step"], line["generation"])
                digests.setdefault(key, set()).add(line["buffers"])
                ranks[key] = ranks.get(key, 0) + 1
    assert sorted({step for step, _ in digests}) == list(range(STEPS))
    assert {key: d for key, d in digests.items() if len(d) != 1} == {}
    assert {ranks[key] for key in ranks} >= {2, 3, 4}  # checked at every world size
    steps = record.timeline(kept)
    worlds = {s.world_size for s in steps}
    assert worlds >= {2, 3, 4}, worlds
    torch.testing.assert_close(torch.tensor([s.loss for s in steps], dtype=torch.float64),
                               torch.tensor(reference["loss"], dtype=torch.float64),
                               rtol=1e-5, atol=0)
