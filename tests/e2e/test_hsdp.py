"""The FSDP2 GPT end to end: a cluster restarted under 2 replica groups of 2 ranks, the job
resumed from its durable step; 3 groups, a rank killed mid-step, its group replaced;
scaled by groups, 3 to 2 to 3; and every rank of 2 groups killed, the job restored from
the nodes' memory shard by shard; and, on a node of 6 slots, a killed rank's group
replaced by the job's warm spare group.

The module's cluster is first stopped (``phalanx down``) under a job of 2 groups that
persists a durable step every ``EVERY`` steps, its nodes' memory wiped (a reboot), and
started again (``phalanx up``): the job comes back by itself, each rank of its new groups
reading its part of the durable step (DCP's sharded format, one commit over the 4
files), and ends bitwise the port alone, every window once an epoch. Its last step loads
in a plain torch process, and in a group of 4 ranks (``reshard_worker.py``, resharded by
DCP on load), which trains on.

``examples/chargpt_hsdp.py`` (the port of the plain FSDP2 HSDP script) at test size runs
as a job of ``ranks_per_replica: 2`` on a local cluster of 3 agents of 2 slots
(``phalanx up``): admission places each group on one node, each agent starts its group's
two processes with torchrun's variables for the group. Rank 1 of replica ``r1-0`` SIGKILLs
itself inside its all-reduce and its agent stops the other (or both its ranks die); the
two other groups run the step again and go on; elasticity starts a replacement group, which joins
with the state of a live group's ranks, shard by shard. Deterministic mode: the gathered
state must be bitwise the port's under ``torchrun --nproc-per-node 2`` with no phalanx,
and every window used once an epoch. Scaled with ``phalanx scale``, one group leaves
after a step all groups agreed on (both its ranks end with status 0) and a new one joins.
With every rank of the job SIGKILLed (frozen first, pids from the agents' manifests), the
replacement groups restore the newest step the memory tier holds: rank s of each from
column s's snapshots (the model's shard s), on its node, a buddy's, or fetched.
On one agent of 6 slots, 2 groups leave room for a spare group (``spares: 1``): two
processes of the port run up to ``from_env`` as a group of their own (process group,
mesh and sharded model built) and wait; the killed rank's group is replaced by it,
rank s of it receiving shard s, and the job ends bitwise the port alone.
On one agent of 4 slots, a job of one group of 2 commits its durable steps and ends;
the port resubmitted as one group of 4 (``ranks_per_replica: 4``) with
``checkpoint.resume_from`` naming it (``phalanx submit --resume``) restores its last
step, each of the 4 ranks reading its quarter of every tensor (DCP reshards), and trains
on: every window once an epoch over both jobs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import chargpt_data
import msgspec
import pytest
import torch
from e2e_cli import next_of, phalanx
from test_elastic import Watch, drain, kill_every_rank, watched_cluster, without_lost_work

from phalanx.bus.client import Delivery
from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    CheckpointPolicy,
    Generation,
    GenerationReason,
    JobHistory,
    JobRecord,
    JobSpec,
    JobState,
    Placement,
    RankStarted,
    ReplicaRange,
    SnapshotRecord,
    SnapshotTier,
    StateSource,
)
from phalanx.services.agent.snapshots import default_root
from phalanx.services.client import AdmissionClient
from phalanx.services.ports import free_port

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
RESTART_JOB = "hsdp-restart-1"
EVERY = 20  # durable_every_steps of the restarted job
RESTART_PACE_S = 0.1  # until a durable step is committed: far from the end at phalanx down
RESHARD = Path(__file__).resolve().parent / "reshard_worker.py"
# The durable step as one torch.save file, by plain torch: nothing of phalanx imported.
PLAIN_EXPORT = """
import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
assert not [m for m in sys.modules if m == "phalanx" or m.startswith("phalanx.")]
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chargpt_data.tokens(tmp_path_factory, "hsdp-data", BYTES)


def clean_env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")},
            **RUN_ENV}


@pytest.fixture(scope="module")
def reference(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The port as one group of 2 with no phalanx (torchrun): what it saved."""
    save = tmp_path_factory.mktemp("hsdp-alone") / "alone.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(SCRIPT), "--data-dir", str(data_dir), *ARGS,
                    "--save", str(save)], check=True, timeout=300, env=clean_env(),
                   capture_output=True)
    return torch.load(save)


def spec_of(name: str, data_dir: Path, tmp_path: Path, replicas: int = 3, fewest: int = 2,
            **env: str) -> JobSpec:
    """The port as a job of ``fewest`` to ``replicas`` groups of 2 ranks, deterministic,
    paced until ``tmp_path/release`` exists."""
    return JobSpec(name=name, team="t", priority_class="normal",
                   replicas=ReplicaRange(min=fewest, max=replicas), placement=Placement(),
                   ranks_per_replica=2, session=True,
                   command=[sys.executable, str(SCRIPT), "--data-dir", str(data_dir), *ARGS,
                            "--save", str(tmp_path / "final.pt")],
                   env={"PHALANX_RECORD_DIR": str(tmp_path / "rec"), **RUN_ENV,
                        "PHALANX_CHAOS_PACE": f"{PACE_S}:{tmp_path / 'release'}", **env},
                   hang_timeout_s=10.0, grace_period_s=3.0)


def check_run(tmp_path: Path, reference: dict, records: dict[str, list[dict]] | None = None,
              steps: int | None = STEPS) -> dict[str, list[dict]]:
    """Every window once an epoch over ``steps`` (in ``records``, default the run's; None:
    not checked), and the saved state bitwise the reference's."""
    records = record.read(tmp_path / "rec") if records is None else records
    if steps is not None:
        assert record.verify(records, ORDER, steps) == []
    final = torch.load(tmp_path / "final.pt")
    for part in ("model", "optimizer"):
        assert final[part].keys() == reference[part].keys()
    for name, value in reference["model"].items():
        assert torch.equal(final["model"][name], value), name
    for name, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(final["optimizer"]["state"][name][key], value), (name, key)
    assert final["scheduler"] == reference["scheduler"]
    return records


@dataclasses.dataclass(frozen=True)
class Restarted:
    """The module's cluster (3 agents of 2 slots), restarted under a job of 2 groups of 2
    that had committed a durable step: what came of the job."""

    cluster: tuple  # watched_cluster's (data dir, bus, watch), running again
    out: Path  # the job's records and final state (spec_of's tmp_path)
    durable: Path  # its durable steps
    persisted: int  # the durable step committed before the cluster stopped
    ended: JobRecord
    history: JobHistory


@pytest.fixture(scope="module")
async def restarted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> AsyncIterator[Restarted]:
    """The cluster starts, a job of 2 groups trains (paced) until a durable step is
    committed, the cluster stops (``phalanx down``), its nodes' memory is wiped (a reboot)
    and it starts again (``phalanx up``, the same data dir): the job resumes by itself,
    and ends before the cluster is the module's."""
    data, out = tmp_path_factory.mktemp("hsdp-cluster"), tmp_path_factory.mktemp("hsdp-restart")
    spec = spec_of("hsdp-restart", data_dir, out, replicas=2,
                   PHALANX_CHAOS_PACE=f"{RESTART_PACE_S}:{out / 'release'}")
    spec = msgspec.structs.replace(spec, checkpoint=CheckpointPolicy(
        memory_every_steps=EVERY, durable_every_steps=EVERY))
    async with watched_cluster(data, agents=3) as (_, bus, _watch):
        persisted: asyncio.Queue[int] = asyncio.Queue()

        async def on_snapshot(announced: SnapshotRecord, _: object) -> None:
            if announced.tier is SnapshotTier.DURABLE:
                persisted.put_nowait(announced.step)

        await bus.subscribe(subjects.ckpt_snapshot(RESTART_JOB), SnapshotRecord, on_snapshot)
        await AdmissionClient(bus).submit(spec, RESTART_JOB)
        # The files of a step are announced once it is committed.
        step = await asyncio.wait_for(persisted.get(), 180)
    for agent in (data / "agents").iterdir():  # rebooted: the memory tier is gone
        shutil.rmtree(default_root(agent.name, agent), ignore_errors=True)
    (out / "release").touch()
    async with watched_cluster(data, agents=3) as running:
        ended = await next_of(running[2].states,
                              lambda r: r.job_id == RESTART_JOB and r.state.terminal, 180)
        histories = await TypedKV.open(running[1].js, subjects.HISTORY_BUCKET, JobHistory)
        history = (await histories.get(RESTART_JOB)).value
        yield Restarted(running, out, data / "checkpoints" / RESTART_JOB, step, ended, history)


@pytest.fixture(scope="module")
def cluster(restarted: Restarted) -> tuple:
    return restarted.cluster


async def test_hsdp_resumes_from_its_durable_step_after_the_cluster_restarts(
        restarted: Restarted, reference: dict) -> None:
    assert restarted.ended.state is JobState.FINISHED, restarted.ended.reason
    records = record.read(restarted.out / "rec")
    restores = [(name, line["step"]) for name, lines in records.items() for line in lines
                if line["kind"] == "restore"]
    # Every rank of both replacement groups restored one step, from durable storage.
    groups = {name.removesuffix(".g1") for name, _ in restores}
    assert {name for name, _ in restores} == groups | {f"{g}.g1" for g in groups}, restores
    assert len(groups) == 2 and not groups & {"r0-0", "r1-0"}, restores
    assert all(line["tier"] == "durable" for lines in records.values() for line in lines
               if line["kind"] == "restore")
    assert len({step for _, step in restores}) == 1
    assert restores[0][1] >= restarted.persisted
    # The job's history says so: the generation the new groups joined restored it.
    assert [g.restored_from for g in restarted.history.generations
            if g.restored_from is StateSource.DURABLE], restarted.history
    # Bitwise the port alone, every window once an epoch (what the stopped ranks
    # committed after the step restored trained again).
    check_run(restarted.out, reference, without_lost_work(records, STEPS))


async def test_hsdp_durable_step_loads_in_plain_dcp_and_reshards_from_2_to_4_ranks(
        restarted: Restarted, data_dir: Path, reference: dict, tmp_path: Path) -> None:
    """The job's last step, written by 2 groups of 2 (4 DCP files, one commit), is the
    port's final state: exported whole by plain torch (nothing of phalanx imported), and
    restored by a group of 4 ranks, each reading its quarter, which then trains on."""
    [last] = [d for d in restarted.durable.glob(f"step-{STEPS:010d}-*-w2-c2")
              if (d / ".phalanx-commit").exists()]
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{i}_0.distcp"
                                                             for i in range(4)]
    whole = tmp_path / "whole.pt"
    subprocess.run([sys.executable, "-c", PLAIN_EXPORT, str(last), str(whole)], check=True,
                   timeout=120, env=clean_env())
    exported = torch.load(whole)
    assert exported["phalanx"]["step"] == STEPS
    for name, value in reference["model"].items():
        assert torch.equal(exported["model"][name], value), name
    assert exported["extra"]["lr_scheduler"]["last_epoch"] \
        == reference["scheduler"]["last_epoch"]

    out, port = tmp_path / "resharded.pt", free_port()
    # torchrun's variables for a group of 4, set here: no launcher process to start.
    ranks = [subprocess.Popen(
        [sys.executable, str(RESHARD), "--data-dir", str(data_dir), *ARGS,
         "--durable", str(restarted.durable), "--save", str(out)],
        env={**clean_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for rank in range(4)]
    assert [rank.wait(timeout=300) for rank in ranks] == [0] * 4
    resharded = torch.load(out)
    for name, value in reference["model"].items():  # each rank's quarter, gathered
        assert torch.equal(resharded["restored"]["model"][name], value), name
    for name, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resharded["restored"]["optimizer"]["state"][name][key],
                               value), (name, key)
    assert resharded["restored"]["scheduler"] == reference["scheduler"]
    losses = resharded["losses"]  # it trains on at S = 4: finite, the model moving
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert any(not torch.equal(resharded["trained"][name], value)
               for name, value in reference["model"].items())


@pytest.mark.parametrize("killed", ["r1-0.g1", "r1-0"], ids=["one-rank", "whole-group"])
async def test_hsdp_trains_through_a_rank_killed_mid_step_and_a_group_replaced(
        cluster, data_dir: Path, reference: dict, tmp_path: Path, killed: str) -> None:
    _, bus, watch = cluster
    for queue in (watch.generations, watch.progress, watch.states):
        drain(queue)
    spec = spec_of("hsdp", data_dir, tmp_path,
                   PHALANX_CHAOS_KILL=f"{killed}:{KILL_STEP}:allreduce")
    job = await AdmissionClient(bus).submit(spec, f"hsdp-{killed.replace('.', '-')}")
    generations = await replaced(watch, job.job_id, tmp_path)
    assert [(g.reason, g.world_size) for g in generations] == [
        (GenerationReason.START, 3), (GenerationReason.FAULT, 2), (GenerationReason.JOIN, 3)]

    records = check_run(tmp_path, reference)
    assert any(line["kind"] == "chaos" for line in records[killed])
    check_joined(records, generations)


async def replaced(watch: Watch, job_id: str, tmp_path: Path) -> list[Generation]:
    """The job's generations up to the replacement group's join (released then), once the
    job has finished."""
    generations = [await next_of(watch.generations, lambda g: g.job_id == job_id, 180)]
    while generations[-1].reason is not GenerationReason.JOIN:  # the kill, the replacement
        generations.append(await next_of(watch.generations,
                                         lambda g: g.job_id == job_id, 300))
    (tmp_path / "release").touch()
    finished = await next_of(watch.states,
                             lambda r: r.job_id == job_id and r.state.terminal, 600)
    assert finished.state is JobState.FINISHED, finished.reason
    return generations


def check_joined(records: dict[str, list[dict]], generations: list[Generation]) -> str:
    """Both ranks of the group that joined in ``generations[2]`` received their shard from
    a live group after the kill; the group's replica id."""
    joined = next(m.replica_id for m in generations[2].members
                  if generations[1].member(m.replica_id) is None)
    for name in (joined, f"{joined}.g1"):
        adopt = next(line for line in records[name] if line["kind"] == "adopt")
        assert KILL_STEP < adopt["step"] < STEPS and adopt["state_bytes"] > 0
    return joined


async def test_hsdp_scales_by_whole_groups_3_2_3_as_it_trains_alone(
        cluster, data_dir: Path, reference: dict, tmp_path: Path) -> None:
    data, bus, watch = cluster
    for queue in (watch.generations, watch.progress, watch.states):
        drain(queue)
    job = await AdmissionClient(bus).submit(spec_of("hsdp-scale", data_dir, tmp_path),
                                            "hsdp-scale-1")

    async def generation(reason: GenerationReason) -> Generation:
        return await next_of(watch.generations,
                             lambda g: g.job_id == job.job_id and g.reason is reason, 300)

    start = await generation(GenerationReason.START)
    assert start.world_size == 3
    await next_of(watch.progress, lambda p: p.job_id == job.job_id and p.step >= 5, 120)
    phalanx("scale", job.job_id, "--replicas", "2", "--data-dir", str(data))
    leave = await generation(GenerationReason.LEAVE)
    await next_of(watch.progress,
                  lambda p: p.job_id == job.job_id and p.step >= leave.resume_step + 3, 120)
    phalanx("scale", job.job_id, "--replicas", "3", "--data-dir", str(data))
    join = await generation(GenerationReason.JOIN)
    (tmp_path / "release").touch()
    finished = await next_of(watch.states,
                             lambda r: r.job_id == job.job_id and r.state.terminal, 600)
    assert finished.state is JobState.FINISHED, finished.reason
    assert (leave.world_size, join.world_size) == (2, 3)
    records = check_run(tmp_path, reference)
    left = next(m.replica_id for m in start.members if leave.member(m.replica_id) is None)
    for name in (left, f"{left}.g1"):  # both ranks of the group left after an agreed step
        assert records[name][-1]["kind"] == "left" and records[name][-1]["planned"]


async def test_hsdp_restores_every_groups_shards_from_memory_after_every_rank_is_killed(
        cluster, data_dir: Path, reference: dict, tmp_path: Path) -> None:
    data, bus, watch = cluster
    for queue in (watch.generations, watch.progress, watch.states):
        drain(queue)
    spec = spec_of("hsdp-lost", data_dir, tmp_path, replicas=2)
    spec = msgspec.structs.replace(spec, checkpoint=CheckpointPolicy(memory_every_steps=1))
    job = await AdmissionClient(bus).submit(spec, "hsdp-lost-1")
    reached = await next_of(watch.progress, lambda p: p.job_id == job.job_id
                            and p.step >= KILL_STEP, 180)
    killed = kill_every_rank(data, job.job_id)
    assert len(killed) == 4, killed  # 2 groups of 2
    # Trains again: a rank of a later generation reports steps past the kill.
    await next_of(watch.progress, lambda p: p.job_id == job.job_id
                  and p.generation > reached.generation and p.step > reached.step, 300)
    (tmp_path / "release").touch()
    finished = await next_of(watch.states,
                             lambda r: r.job_id == job.job_id and r.state.terminal, 600)
    assert finished.state is JobState.FINISHED, finished.reason

    records = record.read(tmp_path / "rec")
    restores = [(name, line["step"]) for name, lines in records.items() for line in lines
                if line["kind"] == "restore" and line["tier"] == "memory"]
    # Both ranks of both replacement groups restored, their columns at one step: at least
    # the one before the step reported (a rank a step behind was frozen before its
    # snapshot).
    groups = {name.removesuffix(".g1") for name, _ in restores}
    assert len(groups) == 2 and {f"{g}.g1" for g in groups} <= {n for n, _ in restores}
    assert len({step for _, step in restores}) == 1, restores
    assert restores[0][1] >= reached.step - 1, (restores, reached.step)
    # What the dead ranks committed after the step restored from is trained again.
    check_run(tmp_path, reference, without_lost_work(records, STEPS))


async def test_hsdp_a_killed_ranks_group_is_replaced_by_a_warm_spare_group(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    data = tmp_path_factory.mktemp("hsdp-spares")
    spec = msgspec.structs.replace(
        spec_of("hsdp-spares", data_dir, tmp_path, replicas=2, fewest=1,
                PHALANX_CHAOS_KILL=f"r1-0.g1:{KILL_STEP}:allreduce"), spares=1)
    async with watched_cluster(data, "--slots-per-agent", "6", agents=1) as (_, bus, watch):
        started: asyncio.Queue[RankStarted] = asyncio.Queue()

        async def on_start(message: RankStarted, _: Delivery) -> None:
            await started.put(message)

        await bus.subscribe(subjects.rank_started("hsdp-spares-1"), RankStarted, on_start)
        job = await AdmissionClient(bus).submit(spec, "hsdp-spares-1")
        generations = await replaced(watch, job.job_id, tmp_path)
    assert [(g.reason, g.world_size) for g in generations] == [
        (GenerationReason.START, 2), (GenerationReason.FAULT, 1), (GenerationReason.JOIN, 2)]
    joined = check_joined(check_run(tmp_path, reference), generations)
    starts = {m.replica_id: m for m in [started.get_nowait() for _ in range(started.qsize())]}
    assert starts[joined].from_spare, starts  # the spare group, not a cold start


def with_epochs(spec: JobSpec, epochs: int) -> JobSpec:
    """``spec`` with the port's ``--epochs`` set to ``epochs``."""
    command = list(spec.command)
    command[command.index("--epochs") + 1] = str(epochs)
    return msgspec.structs.replace(spec, command=command)


async def test_hsdp_a_durable_step_written_at_s2_resumes_as_a_job_at_s4_and_trains_on(
        data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    data = tmp_path_factory.mktemp("hsdp-reshard")
    first, second, restored = (tmp_path_factory.mktemp(name) for name in ("s2", "s4", "r4"))
    for out in (first, second, restored):
        (out / "release").touch()  # unpaced

    def job_of(name: str, out: Path, ranks: int, epochs: int,
               checkpoint: CheckpointPolicy) -> JobSpec:
        spec = spec_of(name, data_dir, out, replicas=1, fewest=1)
        return msgspec.structs.replace(with_epochs(spec, epochs), ranks_per_replica=ranks,
                                       spares=0, checkpoint=checkpoint)

    async with watched_cluster(data, "--slots-per-agent", "4", agents=1) as (_, bus, watch):
        async def run(spec: JobSpec, job_id: str) -> None:
            await AdmissionClient(bus).submit(spec, job_id)
            ended = await next_of(watch.states,
                                  lambda r: r.job_id == job_id and r.state.terminal, 300)
            assert ended.state is JobState.FINISHED, ended.reason

        written = ORDER.steps_per_epoch  # one epoch, a durable step every half
        await run(job_of("hsdp-s2", first, 2, 1, CheckpointPolicy(
            memory_every_steps=written // 2, durable_every_steps=written // 2)), "hsdp-s2-1")
        resumed = CheckpointPolicy(memory_every_steps=written // 2, resume_from="hsdp-s2-1")
        await run(job_of("hsdp-s4", second, 4, 2, resumed), "hsdp-s4-1")
        # The same step restored at S = 4 with nothing left to train: saved as restored.
        await run(job_of("hsdp-r4", restored, 4, 1, resumed), "hsdp-r4-1")
    assert [d.name for d in (data / "checkpoints" / "hsdp-s2-1").glob(
        f"step-{written:010d}-*-w1-c2")]

    records = record.read(second / "rec")
    restores = {name: line for name, lines in records.items() for line in lines
                if line["kind"] == "restore"}
    # Every rank of the group of 4 restored the last step the group of 2 wrote, from storage.
    assert sorted(restores) == ["r0-0", "r0-0.g1", "r0-0.g2", "r0-0.g3"], restores
    assert {(line["tier"], line["step"]) for line in restores.values()} == {
        ("durable", written)}, restores
    # The two jobs together trained every window once an epoch, the second on from the first.
    both = {f"{job}/{name}": lines for job, out in (("s2", first), ("s4", second))
            for name, lines in record.read(out / "rec").items()}
    assert record.verify(both, ORDER, 2 * written) == []
    # Restored at S = 4, the step is bitwise what the group of 2 ended with.
    trained_from = torch.load(first / "final.pt")
    assert trained_from["scheduler"]["last_epoch"] == written
    check_run(restored, trained_from, steps=None)  # it trained no step
    final = torch.load(second / "final.pt")
    assert final["scheduler"]["last_epoch"] == 2 * written
    assert any(not torch.equal(final["model"][name], value)
               for name, value in trained_from["model"].items())
    assert all(torch.isfinite(value).all() for value in final["model"].values())
