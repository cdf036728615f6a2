"""A runtime that loses the bus keeps training in its current generation.

Two real rank processes of ``examples/train_mlp.py`` on a real nats-server of
their own; the test plays elasticity (it answers their ready reports with
generation 0), then stops the server mid-run. Training must go on to the last
step, every sample exactly once, and the ranks must exit 0.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from test_runtime_training import clean_env, kill, start

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
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
STEPS = 400
# The ranks train at most 50 steps/s all through (the pace's release file is never made):
# the bus stops at step 40, so they train on without it for 7 s at least, however fast
# the machine, instead of for as many full-speed steps as a slow machine needs.
PACE_S = 0.02


async def test_training_goes_on_through_a_bus_outage(tmp_path: Path, uid: str,
                                                     launcher: Launcher) -> None:
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(SCRIPT), "--prepare", "--data-dir", str(data), *ARGS],
                   check=True, timeout=120)
    server = NatsServer(tmp_path / "js", port=0, log_path=tmp_path / "nats.log").start()
    ranks: list[ChildProcess] = []
    try:
        async with await Bus.connect(BusConfig.load(env={}, servers=[server.url])) as bus:
            ready: dict[str, ReplicaReady] = {}
            all_ready, far_enough = asyncio.Event(), asyncio.Event()

            async def on_ready(msg: ReplicaReady, _: Delivery) -> None:
                ready[msg.replica_id] = msg
                if len(ready) == 2:
                    all_ready.set()

            async def on_progress(msg: RankProgress, _: Delivery) -> None:
                if msg.step >= 40:
                    far_enough.set()

            await bus.subscribe(subjects.replica_ready(uid), ReplicaReady, on_ready)
            await bus.subscribe(subjects.health_ranks(), RankProgress, on_progress)
            for slot in range(2):
                env = {**clean_env(),
                       "PHALANX_NATS_URL": server.url, "PHALANX_JOB_ID": uid,
                       "PHALANX_RANK": str(slot), "PHALANX_REPLICA_ID": f"r{slot}-0",
                       "PHALANX_NODE_ID": "n", "PHALANX_RECORD_DIR": str(tmp_path / "rec"),
                       "PHALANX_CHAOS_PACE": f"{PACE_S}:{tmp_path / 'never'}"}
                ranks.append(await start(
                    launcher, [sys.executable, str(SCRIPT), "--data-dir", str(data), *ARGS,
                               "--steps", str(STEPS)], env, tmp_path / f"r{slot}-0.out"))
            await asyncio.wait_for(all_ready.wait(), 120)
            members = [Member(replica_id=r.replica_id, rank=i, node_id="n", endpoint=r.endpoint)
                       for i, r in enumerate(sorted(ready.values(), key=lambda r: r.slot))]
            await bus.publish(subjects.job_generation(uid), Generation(
                job_id=uid, generation=0, members=members, world_size=2,
                rendezvous=f"{uid}-g0", resume_step=0, reason=GenerationReason.START))
            await asyncio.wait_for(far_enough.wait(), 120)
        server.stop()  # the bus is gone for the rest of the run
        stopped_at = time.time()
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in ranks)), 180)
    finally:
        server.stop()
        for process in ranks:
            kill(process)
    assert codes == [0, 0]
    records = record.read(tmp_path / "rec")
    assert record.verify(records, ElasticOrder(256, 64), STEPS) == []
    after = [line["step"] for line in records["r0-0"]
             if line["kind"] == "commit" and line["t"] > stopped_at]
    assert after and after[-1] == STEPS - 1  # trained on without the bus, to the end
