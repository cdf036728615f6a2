"""A replica that never became a member holds no trained state and never passes for rank 0.

Real rank processes of ``examples/train_mlp.py`` on the session's nats-server;
the test plays elasticity. Two replicas are taken into generation 0 and train;
two more report ready and are never taken in, as happens to a replacement
still starting or waiting to join when the job completes. Every replica runs
the script's ``--save`` (on the primary). The one the job completes without
must leave with status 0 without running the script's post-training code, the
one stopped (SIGTERM) while waiting must die of it, and the saved model must
be the trained one: the fault-free run's parameters.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from test_runtime_training import clean_env, kill, run, start

from phalanx.bus.client import Bus, Delivery
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    Member,
    RankProgress,
    ReplicaReady,
)
from phalanx.services.agent.zygote import ChildProcess, Launcher
from phalanx.services.natsd import NatsServer

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"
ARGS = ["--widths", "16,32,16", "--samples", "256", "--micro-batch", "8"]
STEPS = 200
# The members train at most 20 steps/s until the test has seen a waiting replica report
# ready again (2 s between reports) and stopped the other: 10 s, however fast the machine.
PACE_S = 0.05
RUN_ENV = {"PHALANX_DETERMINISTIC": "1"}
MEMBERS, WAITING, STOPPED = ("r0-0", "r1-0"), "r2-0", "r3-0"


async def test_replicas_the_job_completes_without_save_nothing(
        tmp_path: Path, nats_server: NatsServer, bus: Bus, uid: str,
        launcher: Launcher) -> None:
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(SCRIPT), "--prepare", "--data-dir", str(data), *ARGS],
                   check=True, timeout=120)
    command = [sys.executable, str(SCRIPT), "--data-dir", str(data), *ARGS,
               "--steps", str(STEPS)]
    await run(launcher, [*command, "--save", str(tmp_path / "reference.pt")],
              {**clean_env(), **RUN_ENV}, tmp_path / "reference.out")
    ready: dict[str, list[ReplicaReady]] = {}
    changed = asyncio.Event()
    progress: list[RankProgress] = []

    async def on_ready(message: ReplicaReady, _: Delivery) -> None:
        ready.setdefault(message.replica_id, []).append(message)
        changed.set()

    async def on_progress(message: RankProgress, _: Delivery) -> None:
        progress.append(message)
        changed.set()

    async def until(condition: Callable[[], bool]) -> None:
        async def check() -> None:
            while not condition():
                changed.clear()
                await changed.wait()
        await asyncio.wait_for(check(), 120)

    await bus.subscribe(subjects.replica_ready(uid), ReplicaReady, on_ready)
    await bus.subscribe(subjects.health_job_ranks(uid), RankProgress, on_progress)
    replicas: dict[str, ChildProcess] = {}
    release = tmp_path / "release"
    try:
        for slot, replica in enumerate([*MEMBERS, WAITING, STOPPED]):
            replicas[replica] = await start(
                launcher, [*command, "--save", str(tmp_path / "final.pt")], {
                    **clean_env(), **RUN_ENV, "PHALANX_NATS_URL": nats_server.url,
                    "PHALANX_JOB_ID": uid, "PHALANX_RANK": str(slot),
                    "PHALANX_REPLICA_ID": replica, "PHALANX_NODE_ID": "n",
                    "PHALANX_RECORD_DIR": str(tmp_path / "rec"),
                    "PHALANX_CHAOS_PACE": f"{PACE_S}:{release}"}, tmp_path / f"{replica}.out")
        await until(lambda: len(ready) == 4)
        members = [Member(replica_id=r, rank=i, node_id="n", endpoint=ready[r][0].endpoint)
                   for i, r in enumerate(MEMBERS)]
        published = time.time()
        await bus.publish(subjects.job_generation(uid), Generation(
            job_id=uid, generation=0, members=members, world_size=2,
            rendezvous=f"{uid}-g0", resume_step=0, reason=GenerationReason.START))
        # Waiting to be taken in, a replica says again that it is ready (elasticity may
        # have restarted and missed it): it waits for a newer generation, not in a spin.
        await until(lambda: any(r.sent_at > published + 1.0 for r in ready[WAITING]))
        os.kill(replicas[STOPPED].pid, signal.SIGTERM)  # as the agent stops a replica
        release.touch()  # the job may run to its end at full speed
        codes = {r: await asyncio.wait_for(p.wait(), 240) for r, p in replicas.items()}
    finally:
        for process in replicas.values():
            kill(process)
    assert codes == {**dict.fromkeys(MEMBERS, 0), WAITING: 0, STOPPED: -signal.SIGTERM}
    assert max(p.step for p in progress) == STEPS  # it left after the job's last commit
    records = record.read(tmp_path / "rec")
    assert record.verify(records, ElasticOrder(256, 64), STEPS) == []
    assert [line["kind"] for line in records[WAITING]] == ["left"]
    assert records[STOPPED] == []  # it never trained, and did not leave by itself
    saved, reference = torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "reference.pt")
    for name, value in reference.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-6, atol=1e-7)
