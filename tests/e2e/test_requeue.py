"""A rigid job preempted by a higher-priority one and admitted again as soon as that one
ends. Replica ids and generation numbers start over with the new admission, so its
replicas' events must not share a stream id with the first admission's (the stream drops
such a repeat for its two-minute duplicate window: the re-admitted job sat idle on its
slots until then). It resumes from its nodes' memory, ends with the run alone's model,
and ``phalanx job`` shows both admissions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from e2e_cli import next_of, phalanx
from test_elastic import ORDER, Watch, progressed, run_job, watched_cluster

from phalanx.runtime import record
from phalanx.schemas.messages import (
    CheckpointPolicy,
    GenerationReason,
    JobSpec,
    JobState,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient

pytestmark = pytest.mark.timeout(300)
#: The stream's duplicate window (nats-server's default), from the first admission's
#: readiness: a second admission's generation 0 must form well inside it.
DUPLICATE_WINDOW_S = 120.0


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple]:
    """2 nodes x 2 slots: the preemptor takes all four."""
    async with watched_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


async def test_a_preempted_job_admitted_again_resumes_at_once_from_memory(
        cluster, data_dir: Path, reference: dict, tmp_path: Path) -> None:
    data, bus, _ = cluster
    seen: dict[str, object] = {}

    async def preempt(job_id: str, watch: Watch) -> None:
        first_ready = time.monotonic()  # about when the first admission's replicas were
        await progressed(watch, job_id, 10)
        await AdmissionClient(bus).submit(JobSpec(
            name="preemptor", team="t", priority_class="high",
            replicas=ReplicaRange(min=4, max=4), command=["sleep", "1"]), "preemptor-1")
        await next_of(watch.states, lambda r: r.job_id == job_id
                      and r.state is JobState.PENDING, 60)
        again = await next_of(watch.generations, lambda g: g.job_id == job_id, 90)
        assert again.generation == 0 and again.reason is GenerationReason.START, again
        assert time.monotonic() - first_ready < DUPLICATE_WINDOW_S / 2
        seen["again"] = again

    rec, generations = await run_job(
        cluster, data_dir, tmp_path, "preempted", preempt,
        spec={"replicas": ReplicaRange(min=4, max=4), "priority_class": "low",
              "checkpoint": CheckpointPolicy(memory_every_steps=1)})
    # Every sample once across both admissions (each names its generations from 0; the
    # records tell them apart by the admission their lines carry), and the model the run
    # alone makes.
    assert record.verify(record.read(rec), ORDER, reference["steps"]) == []
    params = torch.load(tmp_path / "final.pt")
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7)
    assert [s.step for s in record.timeline(record.read(rec))] == list(
        range(reference["steps"]))
    assert seen["again"] not in generations  # taken by preempt: the second admission's g0
    job = json.loads(phalanx("job", "preempted-1", "--json", "--data-dir", str(data)).stdout)
    assert job["admission"] == 2  # what the second admission's ranks' events carry
    assert [(g["generation"], g["reason"]) for g in job["earlier_history"]] == [(0, "start")]
    assert job["history"][0]["generation"] == 0
    assert job["history"][0]["restored_from"] in ("memory", "buddy"), job["history"][0]
