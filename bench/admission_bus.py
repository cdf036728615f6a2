"""End-to-end admission over the real bus: submit -> admitted, jobs per second.

Used by ``bench/admission.py`` (its "end to end" section). A real
``nats-server`` with JetStream, real node agents (in this process, each with
its own connection; ``launch=False``: they offer capacity but start no ranks,
so rank start-up does not compete for the two cores) and the admission
service as its own process, exactly as ``phalanx up`` runs it. A client
submits ``jobs`` one-replica gangs through the public
``phalanx.admission.submit`` endpoint with ``concurrency``
requests in flight, and listens to ``phalanx.job.*.state`` for each job's
*admitted* event. Throughput = jobs / (last admitted event - first submit);
latency = admitted event - that job's submit. The cluster has room for every
job, so the figure is admission's own rate, not capacity.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from typing import Any

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.schemas import settings, subjects
from phalanx.schemas.messages import JobRecord, JobSpec, JobState, ReplicaRange
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.client import AdmissionClient
from phalanx.services.natsd import NatsServer


async def _measure(nodes: int, jobs: int, concurrency: int) -> dict[str, Any]:
    slots = -(-jobs // nodes)  # room for every job
    with tempfile.TemporaryDirectory() as tmp, NatsServer(tmp, port=0) as server:
        config = BusConfig.load(env={}, servers=[server.url])
        # The agents offer capacity but launch nothing: this measures admission alone.
        agents = [AgentService(AgentConfig(node_id=f"bench-{i}", slots=slots, launch=False,
                                           heartbeat_interval_s=1.0, lost_after_s=10.0), config)
                  for i in range(nodes)]
        for agent in agents:
            await agent.start()
        env = {**os.environ, settings.NATS_URL: server.url}
        admission = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "phalanx.services.admission", "--log-level", "WARNING",
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            async with await Bus.connect(config, name="bench") as bus:
                client = AdmissionClient(bus, timeout_s=30.0)
                try:  # a leader answers: the probe job is unknown to it
                    await client.explain("probe", retry_s=30)
                except RemoteError as exc:
                    if exc.code != "404":
                        raise
                sent: dict[str, int] = {}
                admitted: dict[str, int] = {}
                all_admitted = asyncio.Event()

                async def on_state(record: JobRecord, _: Delivery) -> None:
                    if record.state is JobState.ADMITTED and record.job_id not in admitted:
                        admitted[record.job_id] = time.perf_counter_ns()
                        if len(admitted) == jobs:
                            all_admitted.set()

                await bus.subscribe(subjects.job_states(), JobRecord, on_state)
                spec = JobSpec(name="bench", team="bench", priority_class="normal",
                               replicas=ReplicaRange(min=1, max=1), command=["true"])
                gate = asyncio.Semaphore(concurrency)

                async def submit(i: int) -> None:
                    async with gate:
                        sent[f"bench-{i}"] = time.perf_counter_ns()
                        await client.submit(spec, f"bench-{i}")

                start = time.perf_counter_ns()
                await asyncio.gather(*(submit(i) for i in range(jobs)))
                replied = time.perf_counter_ns()
                await asyncio.wait_for(all_admitted.wait(), 300)
                end = max(admitted.values())
        finally:
            admission.terminate()
            await admission.wait()
            for agent in agents:
                await agent.stop()
    latencies = sorted((admitted[j] - sent[j]) / 1e6 for j in sent)
    return {
        "nodes": nodes, "jobs": jobs, "concurrency": concurrency,
        "submit_replies_per_s": round(jobs / ((replied - start) / 1e9)),
        "jobs_per_s": round(jobs / ((end - start) / 1e9)),
        "latency_p50_ms": round(latencies[len(latencies) // 2], 1),
        "latency_p99_ms": round(latencies[min(len(latencies) - 1,
                                              int(len(latencies) * 0.99))], 1),
    }


def measure(nodes: int, jobs: int, concurrency: int = 64) -> dict[str, Any]:
    """Run one end-to-end measurement (starts and stops its own server and services)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_measure(nodes, jobs, concurrency))
    return uvloop.run(_measure(nodes, jobs, concurrency))
