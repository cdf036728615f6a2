"""Where an agent runs a replica: the node's slot (``LOCAL_RANK``), and on a node that
lists GPUs, that slot's GPU alone (``CUDA_VISIBLE_DEVICES``), with the job's backend; and
torchrun's variables: the gang's, or a world of one for a job that runs a session.

Real rank processes of a real agent's RankSet; each prints what it was given and holds
its slot until every replica of the job was launched.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from phalanx.schemas.messages import (
    CollectiveBackend,
    JobRecord,
    JobSpec,
    JobState,
    RankExited,
    RankStarted,
    ReasonCode,
    ReplicaRange,
)
from phalanx.services.agent.ranks import RankSet, master_port

# Prints its placement, then holds its slot until the test lets it go (a rank's stdin is
# /dev/null: a file is the signal).
CHILD = """
import os, sys, time
names = sys.argv[2].split(",")
print(" ".join(f"{n}={os.environ.get(n, '-')}" for n in names), flush=True)
release = sys.argv[1]
while not os.path.exists(release):
    time.sleep(0.01)
"""


PLACEMENT = ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "PHALANX_DEVICE", "PHALANX_BACKEND")
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")


async def placements(tmp_path: Path, gpus: tuple[int, ...], replicas: int,
                     env: dict[str, str] | None = None,
                     backend: CollectiveBackend = CollectiveBackend.AUTO,
                     names: tuple[str, ...] = PLACEMENT, session: bool = False,
                     elastic: bool = False, restarted: bool = False) -> list[str]:
    """Launch ``replicas`` ranks of one job on one node (``elastic``: it has a generation;
    ``restarted``: then the gang is restarted whole); what each printed, by slot."""
    exited: asyncio.Queue[RankExited] = asyncio.Queue()

    async def report(message: RankStarted | RankExited) -> None:
        if isinstance(message, RankExited):
            await exited.put(message)

    async def host_of(_: str) -> str:
        return "127.0.0.1"

    release = tmp_path / "release"
    ranks = RankSet("n1", tmp_path, "nats://127.0.0.1:1", host_of, report,
                    capacity=max(len(gpus), replicas), gpus=gpus)
    spec = JobSpec(name="p", team="t", priority_class="normal", env=env or {},
                   replicas=ReplicaRange(min=replicas, max=replicas), backend=backend,
                   session=session, grace_period_s=5.0,
                   command=[sys.executable, "-c", CHILD, str(release), ",".join(names)])
    record = JobRecord(job_id="p1", spec=spec, state=JobState.ADMITTED, submitted_at=1.0,
                       updated_at=1.0, reason_code=ReasonCode.ADMITTED,
                       nodes=["n1"] * replicas)
    try:
        # All launched: each holds its slot until released.
        await ranks.reconcile(record, elastic=elastic)
        incarnation = int(restarted)
        if restarted:  # as elasticity restarts a gang: every slot's next incarnation
            for slot in range(replicas):
                replaced = await ranks.replace(record, slot, f"r{slot}-1", gang=True)
                assert replaced.new and not replaced.from_spare
        release.touch()
        waiting = {f"r{slot}-{incarnation}" for slot in range(replicas)}
        while waiting:
            end = await asyncio.wait_for(exited.get(), 60)
            if end.replica_id in waiting:
                assert end.exit_code == 0
                waiting.remove(end.replica_id)
    finally:
        release.touch()
        await ranks.stop_all()
    logs = [tmp_path / "jobs" / "p1" / f"r{slot}-{incarnation}.log"
            for slot in range(replicas)]
    return [next(line for line in log.read_text().splitlines()
                 if not line.startswith("=== phalanx:")) for log in logs]


async def test_each_replica_of_a_gpu_node_sees_its_slots_gpu_alone(tmp_path: Path) -> None:
    # The job's own CUDA_VISIBLE_DEVICES does not reach a rank the agent gave a GPU.
    seen = await placements(tmp_path, gpus=(3, 1), replicas=2,
                            env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert seen == [
        "LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=3 PHALANX_DEVICE=cuda PHALANX_BACKEND=auto",
        "LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=1 PHALANX_DEVICE=cuda PHALANX_BACKEND=auto"]


async def test_a_cpu_node_leaves_the_gpus_as_they_were(tmp_path: Path) -> None:
    seen = await placements(tmp_path, gpus=(), replicas=2, env={"CUDA_VISIBLE_DEVICES": "5"},
                            backend=CollectiveBackend.GLOO)
    assert seen == [
        "LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=5 PHALANX_DEVICE=cpu PHALANX_BACKEND=gloo",
        "LOCAL_RANK=1 CUDA_VISIBLE_DEVICES=5 PHALANX_DEVICE=cpu PHALANX_BACKEND=gloo"]


async def test_torchrun_variables_describe_the_gang_until_the_job_runs_a_session(
        tmp_path: Path) -> None:
    gang = await placements(tmp_path / "gang", gpus=(), replicas=2, names=TORCHRUN)
    port = gang[0].rsplit("=", 1)[1]
    assert 29500 <= int(port) < 39500
    assert gang == [f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
                    f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" for rank in (0, 1)]
    # A job with a generation (its replacements, joiners), or one whose spec declares a
    # session from the start: each process is a world of its own, its store on a free port,
    # and on a GPU node its slot's GPU is cuda:LOCAL_RANK, the only one it sees.
    own = ["RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
           "MASTER_PORT=0"] * 2
    assert await placements(tmp_path / "elastic", gpus=(), replicas=2, names=TORCHRUN,
                            elastic=True) == own
    assert await placements(tmp_path / "declared", gpus=(), replicas=2, names=TORCHRUN,
                            session=True) == own
    assert await placements(tmp_path / "gpus", gpus=(3, 1), replicas=2, session=True,
                            names=("LOCAL_RANK", "CUDA_VISIBLE_DEVICES")) == [
        "LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=3", "LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=1"]


async def test_a_gang_restarted_whole_is_the_gang_again_on_a_rendezvous_of_its_own(
        tmp_path: Path) -> None:
    # Elasticity restarts a gang whose replica failed before any was ready: each slot's
    # next incarnation gets the gang's variables (not a world of one), and a MASTER_PORT
    # no process of the gang before can answer on.
    again = await placements(tmp_path, gpus=(), replicas=2, names=TORCHRUN, restarted=True)
    port = again[0].rsplit("=", 1)[1]
    assert int(port) == master_port("p1", 1) != master_port("p1", 0)
    assert again == [f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
                     f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" for rank in (0, 1)]
