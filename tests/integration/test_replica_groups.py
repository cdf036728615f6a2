"""Replica groups over real ranks: the FSDP2 GPT port trains as R groups of S ranks, through a
group lost mid-step and a group joining, bitwise as one group alone.

``examples/chargpt_hsdp.py`` at test size — 2 layers, 16-token windows of the first 5 kB
of the corpus, 20 steps an epoch — runs as groups of two processes on the session's
nats-server, each group's processes with the variables its agent gives them (torchrun's
for the group, ``PHALANX_RANKS_PER_REPLICA`` and ``PHALANX_GROUP_RANK``); the test plays
elasticity (it publishes the generations), as ``test_runtime_training.py`` does.
Deterministic mode: the gathered model, optimizer and scheduler state must be bitwise
the script's under ``torchrun --nproc-per-node 2`` with no phalanx (one group, R = 1),
and every window used once an epoch.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import chargpt_data
import pytest
import torch
from test_runtime_training import RUN_ENV, Job, clean_env

from phalanx.bus.client import Bus
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import environment
from phalanx.schemas.messages import GenerationReason
from phalanx.services.agent.zygote import Launcher
from phalanx.services.natsd import NatsServer
from phalanx.services.ports import group_master_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BLOCK, GLOBAL_BATCH, BYTES, EPOCHS = 16, 16, 5120, 2
ARGS = ["--layers", "2", "--heads", "2", "--embd", "32", "--block-size", str(BLOCK),
        "--global-batch", str(GLOBAL_BATCH), "--warmup", "10", "--log-every", "10",
        "--epochs", str(EPOCHS)]
PORT_ENV = {**RUN_ENV, "PHALANX_MICRO_BATCH_SIZE": "2"}
ORDER = ElasticOrder((BYTES - 1) // BLOCK, GLOBAL_BATCH, seed=0)
STEPS = EPOCHS * ORDER.steps_per_epoch
KILL_STEP = 13
RANKS = 2  # per group
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chargpt_data.tokens(tmp_path_factory, "hsdp", BYTES)


def group_env(replica: str, rank: int, port: int) -> dict[str, str]:
    """What an agent gives rank ``rank`` of replica ``replica``'s group."""
    return {environment.REPLICA_ID: replica, environment.RANKS_PER_REPLICA: str(RANKS),
            environment.GROUP_RANK: str(rank), environment.WORLD_OF_ONE_MARK: "",
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(RANKS),
            "LOCAL_WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


async def start_group(job: Job, replica: str, slot: int, env: dict[str, str]) -> None:
    port = group_master_port(f"{job.uid}/{replica}")  # as an agent picks it
    for rank in range(RANKS):
        await job.start(f"{replica}.g{rank}", slot, {**env, **group_env(replica, rank, port)})


def alone(data: Path, save: Path) -> None:
    """The port as one group with no phalanx: ``torchrun --nproc-per-node 2``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(RANKS), str(EXAMPLES / "chargpt_hsdp.py"),
               "--data-dir", str(data), *ARGS, "--save", str(save)]
    run = subprocess.run(command, timeout=300, env={**clean_env(), **PORT_ENV},
                         capture_output=True, text=True)
    assert run.returncode == 0, f"torchrun exited {run.returncode}:\n{run.stderr[-3000:]}"


def assert_bitwise(got: dict[str, object], want: dict[str, object],
                   parts: tuple[str, ...] = ("model", "optimizer", "scheduler")) -> None:
    for part in parts:
        flat_got, flat_want = _flatten(got[part]), _flatten(want[part])
        assert flat_got.keys() == flat_want.keys(), part
        for name, value in flat_want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(flat_got[name], value), f"{part}: {name}"
            else:
                assert flat_got[name] == value, f"{part}: {name}"


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a nested state dict, by its path."""
    if isinstance(tree, dict):
        items = [(f"{prefix}{key}/", sub) for key, sub in tree.items()]
    elif isinstance(tree, list | tuple):
        items = [(f"{prefix}{i}/", sub) for i, sub in enumerate(tree)]
    else:
        return {prefix: tree}
    return {path: leaf for name, sub in items for path, leaf in _flatten(sub, name).items()}


async def test_groups_train_through_a_lost_group_and_a_join_as_one_group_alone(
        tmp_path: Path, data: Path, nats_server: NatsServer, bus: Bus, uid: str,
        launcher: Launcher) -> None:
    alone(data, tmp_path / "alone.pt")
    release = tmp_path / "release"
    async with Job(bus, nats_server, uid, tmp_path, data, launcher=launcher) as job:
        job.command = [sys.executable, str(EXAMPLES / "chargpt_hsdp.py"), "--data-dir",
                       str(data), *ARGS, "--save", str(tmp_path / "final.pt")]
        env = {**PORT_ENV, "PHALANX_CHAOS_KILL": f"r2-0:{KILL_STEP}:allreduce",
               "PHALANX_CHAOS_PACE": f"0.1:{release}"}  # the joiner is in before the end
        for slot, replica in enumerate(["r0-0", "r1-0", "r2-0", "r3-0"]):
            await start_group(job, replica, slot, env)
        await job.publish(["r0-0", "r1-0", "r2-0"], GenerationReason.START)
        for rank in range(RANKS):  # the whole group dies (its agent stops the rest)
            assert await asyncio.wait_for(job.processes[f"r2-0.g{rank}"].wait(), 120) == -9
        await job.publish(["r0-0", "r1-0"], GenerationReason.FAULT)
        await job.until_applied(1, "r0-0")
        await job.publish(["r0-0", "r1-0", "r3-0"], GenerationReason.JOIN)
        await job.until_applied(2, "r3-0")
        release.touch()
        codes = await job.exit_codes()
        assert codes == {f"{r}.g{s}": -9 if r == "r2-0" else 0
                         for r in ("r0-0", "r1-0", "r2-0", "r3-0") for s in range(RANKS)}

    records = record.read(tmp_path / "rec")
    for rank in range(1, RANKS):  # each rank of a group keeps its own record
        assert f"r3-0.g{rank}" in records
    adopted = [line for name in ("r3-0", "r3-0.g1") for line in records[name]
               if line["kind"] == "adopt"]
    assert len(adopted) == RANKS and len({line["step"] for line in adopted}) == 1
    assert KILL_STEP < adopted[0]["step"] < STEPS
    assert record.verify(records, ORDER, STEPS) == []  # every window once an epoch
    assert_bitwise(torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "alone.pt"))


TP_WORKER = Path(__file__).resolve().parent / "tp_group_worker.py"


async def test_tensor_parallel_groups_train_through_a_lost_group_and_a_join_as_one_alone(
        tmp_path: Path, nats_server: NatsServer, bus: Bus, uid: str, data: Path,
        launcher: Launcher) -> None:
    """The group is opaque: groups split over ``("dp", "tp")`` inside (its two ranks take
    the same batch) recover a lost group and take a joiner, shard by shard, bitwise."""
    steps, kill = 30, 11
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(RANKS), str(TP_WORKER), "--steps", str(steps),
                          "--out", str(tmp_path / "alone.pt")], timeout=300,
                         env={**clean_env(), **PORT_ENV}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    release = tmp_path / "release"
    async with Job(bus, nats_server, uid, tmp_path, data, launcher=launcher) as job:
        job.command = [sys.executable, str(TP_WORKER), "--steps", str(steps),
                       "--out", str(tmp_path / "final.pt")]
        env = {**PORT_ENV, "PHALANX_CHAOS_KILL": f"r2-0:{kill}:allreduce",
               "PHALANX_CHAOS_PACE": f"0.2:{release}"}
        for slot, replica in enumerate(["r0-0", "r1-0", "r2-0", "r3-0"]):
            await start_group(job, replica, slot, env)
        await job.publish(["r0-0", "r1-0", "r2-0"], GenerationReason.START)
        for rank in range(RANKS):
            assert await asyncio.wait_for(job.processes[f"r2-0.g{rank}"].wait(), 120) == -9
        await job.publish(["r0-0", "r1-0"], GenerationReason.FAULT)
        await job.until(lambda: job.step > kill)
        await job.publish(["r0-0", "r1-0", "r3-0"], GenerationReason.JOIN)
        await job.until(lambda: job.step > kill + 3)
        release.touch()
        assert all(code in (0, -9) for code in (await job.exit_codes()).values())
    records = record.read(tmp_path / "rec")
    assert any(line["kind"] == "adopt" for line in records["r3-0.g1"])
    assert record.verify(records, ElasticOrder(96, 16, seed=0), steps) == []
    assert_bitwise(torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "alone.pt"),
                   ("model", "optimizer"))
