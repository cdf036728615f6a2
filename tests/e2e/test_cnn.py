"""The image classifier's port end to end, through every kind of membership change.

``examples/cnn.py`` — the port of a torchvision-style DDP script: a CNN with
BatchNorm, an ``AveragedModel`` EMA of the weights and the statistics (not
registered with the session), gradient accumulation (the session's: 8 images a
forward, 64 a step), ``drop_last=True`` (1,550 images: 24 steps an epoch, 14
images dropped), bf16 autocast, clipping, AdamW with per-group decay and a
one-cycle schedule sized by the loader, which raises if stepped once more —
runs as a 4-replica job on a local cluster in deterministic mode. In one run:
replica ``r1-0`` is killed inside its all-reduce, rank 0 (``r0-0``) at a step's
start, each replaced; the job is scaled to 2 and back to 4; then every rank is
killed and the job resumes from its nodes' memory. It must end bitwise equal to
the script run alone: every tensor of the model (BatchNorm's buffers included,
moved once per micro-batch as alone), the EMA, the optimizer and the schedule,
and every step's loss; every image of an epoch's full batches once. Its last
durable checkpoint, exported and loaded with plain ``torch.distributed.checkpoint``,
holds that same model and EMA: one consistent copy of the buffers, not each rank's
share of its own.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from e2e_cli import next_of, phalanx
from test_elastic import drain, watched_cluster, without_lost_work, write_records
from test_gpt import run_alone
from test_whole_job_loss import kill_every_rank
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from phalanx.runtime import averaged, record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas.messages import (
    CheckpointPolicy,
    Generation,
    GenerationReason,
    JobSpec,
    JobState,
    Placement,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient

pytestmark = pytest.mark.timeout(600)
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "cnn.py"
EPOCHS, SAMPLES, GLOBAL_BATCH = 6, 1550, 64
ARGS = ["--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--global-batch",
        str(GLOBAL_BATCH), "--micro-batch", "8"]
ORDER = ElasticOrder(SAMPLES, GLOBAL_BATCH, seed=0, drop_last=True)
STEPS = EPOCHS * ORDER.steps_per_epoch  # 144
RUN_ENV = {"PHALANX_DETERMINISTIC": "1", "PHALANX_STATE_CHECKSUM": "1"}
# Paced until the last fault's generation trains: 0.4 s a step leaves about a minute for
# the five changes, which take a few seconds each here.
PACE_S = 0.4
KILLS = "r1-0:6:allreduce,r0-0:16:boundary"


def assert_bitwise(got: object, want: object, where: str) -> None:
    """Every tensor of ``want`` equal in ``got``, bitwise; everything else equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key, value in want.items():
            assert_bitwise(got[key], value, f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    else:
        assert got == want, where


async def test_the_cnn_port_ends_bitwise_as_alone_through_kills_scaling_and_a_whole_job_loss(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = run_alone(SCRIPT, ARGS, tmp_path / "alone", RUN_ENV)
    # BatchNorm's statistics moved once per micro-batch of 8 images, as the plain script
    # alone moves them (deterministic mode), not once a step.
    assert int(reference["model"]["features.1.num_batches_tracked"]) \
        == STEPS * GLOBAL_BATCH // 8
    rec, release = tmp_path / "rec", tmp_path / "release"
    async with watched_cluster(tmp_path_factory.mktemp("cnn-cluster")) as cluster:
        cluster_dir, bus, watch = cluster
        for queue in (watch.generations, watch.progress, watch.states):
            drain(queue)
        spec = JobSpec(name="cnn", team="t", priority_class="normal",
                       replicas=ReplicaRange(min=2, max=4), placement=Placement(),
                       command=[sys.executable, str(SCRIPT), *ARGS,
                                "--save", str(tmp_path / "final.pt")],
                       env={"PHALANX_RECORD_DIR": str(rec), **RUN_ENV,
                            "PHALANX_CHAOS_KILL": KILLS,
                            "PHALANX_CHAOS_PACE": f"{PACE_S}:{release}"},
                       checkpoint=CheckpointPolicy(memory_every_steps=1,
                                                   durable_every_steps=STEPS // 2),
                       hang_timeout_s=5.0, grace_period_s=3.0, session=True)
        client = AdmissionClient(bus)
        job = await client.submit(spec, "cnn-1")
        seen: list[Generation] = []

        async def until(done, timeout_s: float = 120) -> Generation:
            while True:
                generation = await next_of(watch.generations,
                                           lambda g: g.job_id == job.job_id, timeout_s)
                seen.append(generation)
                if done(generation):
                    return generation

        try:
            await until(lambda g: g.reason is GenerationReason.START and g.world_size == 4)
            # The two kills (a member, then rank 0), each replaced: 4 -> 3 -> 4, twice.
            for _ in range(2):
                await until(lambda g: g.reason is GenerationReason.FAULT)
                await until(lambda g: g.world_size == 4)
            await client.scale(job.job_id, 2)
            await until(lambda g: g.world_size == 2)
            await client.scale(job.job_id, 4)
            grown = await until(lambda g: g.world_size == 4)
            await next_of(watch.progress, lambda p: p.job_id == job.job_id
                          and p.generation == grown.generation, 120)
            killed = kill_every_rank(cluster_dir)
            assert len(killed) == 4, killed
            # Trains again, from the nodes' memory, at its full size.
            again = await until(lambda g: g.world_size == 4, 180)
            await next_of(watch.progress, lambda p: p.job_id == job.job_id
                          and p.generation == again.generation, 180)
            release.touch()
            finished = await next_of(
                watch.states, lambda r: r.job_id == job.job_id and r.state.terminal, 300)
            assert finished.state is JobState.FINISHED, finished.reason
            exported = tmp_path / "export"
            phalanx("ckpt", "export", job.job_id, str(STEPS), str(exported),
                    "--data-dir", str(cluster_dir))
        except BaseException:
            with contextlib.suppress(Exception):  # the cluster goes down with the test
                await client.cancel(job.job_id, retry_s=5.0)
            raise
    records = record.read(rec)
    restores = {line["tier"] for lines in records.values() for line in lines
                if line["kind"] == "restore"}
    assert restores == {"memory"}, restores
    kept = record.read(write_records(without_lost_work(records, STEPS), tmp_path / "kept"))
    # Every step once on exactly its batch: each epoch's 1,536 images of full batches once.
    assert record.verify(kept, ORDER, STEPS) == []
    steps = record.timeline(kept)
    assert [s.step for s in steps] == list(range(STEPS))
    assert [s.loss for s in steps] == reference["loss"]
    final = torch.load(tmp_path / "final.pt")
    assert final["ema"]["n_averaged"] == reference["ema"]["n_averaged"] == STEPS
    for part in ("model", "ema", "optimizer", "scheduler"):
        assert_bitwise(final[part], reference[part], part)
    # The last durable step is the final state: the model's buffers and the EMA's each
    # the one copy every rank held, as the script alone has them.
    meta = dcp.FileSystemReader(str(exported)).read_metadata()
    stored = {key: torch.empty(value.size, dtype=value.properties.dtype)
              for key, value in meta.state_dict_metadata.items()
              if isinstance(value, TensorStorageMetadata)}
    dcp.load(stored, checkpoint_id=str(exported), no_dist=True)
    for name, value in reference["model"].items():
        assert torch.equal(stored[f"model.{name}"], value), name
    for name, value in reference["ema"].items():
        assert torch.equal(stored[f"extra.{averaged.NAME}.{name}"], value), name
