"""The FSDP2 GPT end to end: 3 replica groups of 2 ranks, a rank killed mid-step, its group
replaced.

``examples/chargpt_hsdp.py`` (the port of the plain FSDP2 HSDP script) at test size runs
as a job of ``ranks_per_replica: 2`` on a local cluster of 3 agents of 2 slots
(``phalanx up``): admission places each group on one node, each agent starts its group's
two processes with torchrun's variables for the group. Replica ``r1-0`` SIGKILLs itself
inside its all-reduce (both its ranks: its agent would stop the other); the two other
groups run the step again and go on; elasticity starts a replacement group, which joins
with the state of a live group's ranks, shard by shard. Deterministic mode: the gathered
state must be bitwise the port's under ``torchrun --nproc-per-node 2`` with no phalanx,
and every window used once an epoch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from e2e_cli import next_of
from test_elastic import drain, watched_cluster

from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas.messages import (
    GenerationReason,
    JobSpec,
    JobState,
    Placement,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient

pytestmark = pytest.mark.timeout(600)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPT = EXAMPLES / "chargpt_hsdp.py"
EPOCHS, BLOCK, GLOBAL_BATCH, BYTES = 4, 16, 16, 5120
ARGS = ["--layers", "2", "--heads", "2", "--embd", "32", "--block-size", str(BLOCK),
        "--global-batch", str(GLOBAL_BATCH), "--warmup", "10", "--log-every", "100",
        "--epochs", str(EPOCHS)]
ORDER = ElasticOrder((BYTES - 1) // BLOCK, GLOBAL_BATCH, seed=0)
STEPS = EPOCHS * ORDER.steps_per_epoch
KILL_STEP = 15
PACE_S = 0.5  # until the replacement group has joined: STEPS * PACE_S = 40 s
RUN_ENV = {"PHALANX_DETERMINISTIC": "1", "PHALANX_STATE_CHECKSUM": "1",
           "PHALANX_MICRO_BATCH_SIZE": "2"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hsdp-data") / "tokens"
    subprocess.run([sys.executable, str(EXAMPLES / "chargpt_model.py"), "--data-dir",
                    str(path), "--max-bytes", str(BYTES)], check=True, timeout=120)
    return path


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple]:
    async with watched_cluster(tmp_path_factory.mktemp("hsdp-cluster"), agents=3) as running:
        yield running


def alone(data_dir: Path, save: Path) -> dict:
    """The port as one group of 2 with no phalanx (torchrun)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(SCRIPT), "--data-dir", str(data_dir), *ARGS,
                    "--save", str(save)], check=True, timeout=300, env={**clean, **RUN_ENV},
                   capture_output=True)
    return torch.load(save)


async def test_hsdp_trains_through_a_rank_killed_mid_step_and_a_group_replaced(
        cluster, data_dir: Path, tmp_path: Path) -> None:
    reference = alone(data_dir, tmp_path / "alone.pt")
    _, bus, watch = cluster
    for queue in (watch.generations, watch.progress, watch.states):
        drain(queue)
    rec, release = tmp_path / "rec", tmp_path / "release"
    spec = JobSpec(name="hsdp", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=3), placement=Placement(),
                   ranks_per_replica=2, session=True,
                   command=[sys.executable, str(SCRIPT), "--data-dir", str(data_dir), *ARGS,
                            "--save", str(tmp_path / "final.pt")],
                   env={"PHALANX_RECORD_DIR": str(rec), **RUN_ENV,
                        "PHALANX_CHAOS_KILL": f"r1-0:{KILL_STEP}:allreduce",
                        "PHALANX_CHAOS_PACE": f"{PACE_S}:{release}"},
                   hang_timeout_s=10.0, grace_period_s=3.0)
    job = await AdmissionClient(bus).submit(spec, "hsdp-1")
    generations = [await next_of(watch.generations, lambda g: g.job_id == job.job_id, 180)]
    while generations[-1].reason is not GenerationReason.JOIN:  # the kill, the replacement
        generations.append(await next_of(watch.generations,
                                         lambda g: g.job_id == job.job_id, 300))
    release.touch()
    finished = await next_of(watch.states,
                             lambda r: r.job_id == job.job_id and r.state.terminal, 600)
    assert finished.state is JobState.FINISHED, finished.reason
    assert [(g.reason, g.world_size) for g in generations[:3]] == [
        (GenerationReason.START, 3), (GenerationReason.FAULT, 2), (GenerationReason.JOIN, 3)]

    records = record.read(rec)
    assert any(line["kind"] == "chaos" for line in records["r1-0"])
    joined = [m.replica_id for m in generations[2].members
              if m.replica_id not in {m.replica_id for m in generations[1].members}]
    for name in (joined[0], f"{joined[0]}.g1"):  # both ranks of the new group copied
        adopt = next(line for line in records[name] if line["kind"] == "adopt")
        assert KILL_STEP < adopt["step"] < STEPS and adopt["state_bytes"] > 0
    assert record.verify(records, ORDER, STEPS) == []  # every window once an epoch
    final = torch.load(tmp_path / "final.pt")
    for part in ("model", "optimizer"):
        assert final[part].keys() == reference[part].keys()
    for name, value in reference["model"].items():
        assert torch.equal(final["model"][name], value), name
    for name, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(final["optimizer"]["state"][name][key], value), (name, key)
    assert final["scheduler"] == reference["scheduler"]
