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


async def preempted(bus, watch: Watch, job_id: str, preemptor_id: str,
                    seconds: float = 1.0) -> None:
    """Once ``job_id`` trains, a 4-replica high-priority job (running ``seconds``)
    preempts it; returns once it is pending."""
    await progressed(watch, job_id, 10)
    await AdmissionClient(bus).submit(JobSpec(
        name="preemptor", team="t", priority_class="high",
        replicas=ReplicaRange(min=4, max=4), command=["sleep", f"{seconds:g}"]), preemptor_id)
    await next_of(watch.states, lambda r: r.job_id == job_id
                  and r.state is JobState.PENDING, 60)


async def test_a_preempted_job_admitted_again_resumes_at_once_from_memory(
        cluster, data_dir: Path, reference: dict, tmp_path: Path) -> None:
    data, bus, _ = cluster
    seen: dict[str, object] = {}

    async def preempt(job_id: str, watch: Watch) -> None:
        first_ready = time.monotonic()  # about when the first admission's replicas were
        await preempted(bus, watch, job_id, "preemptor-1")
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


async def test_a_preempted_job_admitted_on_another_node_fetches_its_memory_there(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three nodes: the job runs on A alone (B and C cordoned), is preempted by a job
    taking A and C, and is admitted again on C alone (A cordoned meanwhile). Its
    snapshots are in A's memory and A's buddy B's, neither of which runs a member: the
    members fetch them onto C and resume from memory, not from the start."""
    a, b, c = "local-0", "local-1", "local-2"
    async with watched_cluster(tmp_path_factory.mktemp("cluster"), agents=3) as cluster:
        data, bus, _ = cluster
        for node in (b, c):
            phalanx("node", "cordon", node, "--data-dir", str(data))
        seen: dict[str, object] = {}

        async def preempt(job_id: str, watch: Watch) -> None:
            await progressed(watch, job_id, 10)
            phalanx("node", "uncordon", c, "--data-dir", str(data))
            await preempted(bus, watch, job_id, "preemptor-1", seconds=5)
            phalanx("node", "cordon", a, "--data-dir", str(data))
            seen["again"] = await next_of(watch.generations, lambda g: g.job_id == job_id, 90)

        rec, _ = await run_job(
            cluster, data_dir, tmp_path, "moved", preempt,
            spec={"replicas": ReplicaRange(min=2, max=2), "priority_class": "low",
                  "checkpoint": CheckpointPolicy(memory_every_steps=1)})
    again = seen["again"]
    assert {m.node_id for m in again.members} == {c}, again  # type: ignore[attr-defined]
    lines = [line for replica in record.read(rec).values() for line in replica
             if line.get("admission") == 2]
    restores = [line for line in lines if line["kind"] == "restore"]
    fetches = [line for line in lines if line["kind"] == "fetch"]
    assert restores and all(line["tier"] == "memory" for line in restores), restores
    [step] = {line["step"] for line in restores}
    # Not from the start: at least where the first admission had got (as health stored
    # it, up to a second behind), the newest snapshot.
    assert all(10 <= line["reached"] <= step for line in restores), restores
    # Both of A's shards came onto C, one per member, of the step restored.
    assert {line["step"] for line in fetches} == {step}, fetches
    assert sorted(s for line in fetches for s in line["shards"]) == [0, 1], fetches
    assert record.verify(record.read(rec), ORDER, reference["steps"]) == []
    params = torch.load(tmp_path / "final.pt")
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7)


async def test_a_job_admitted_again_with_no_state_left_says_it_starts_over(
        cluster, data_dir: Path, reference: dict, tmp_path: Path) -> None:
    """Without snapshots nothing holds a preempted job's state: admitted again, it trains
    from step 0 (to the run alone's model), and its history says so (``start``) where
    it said nothing before."""
    data, bus, _ = cluster

    async def preempt(job_id: str, watch: Watch) -> None:
        await preempted(bus, watch, job_id, "preemptor-2")

    rec, _ = await run_job(
        cluster, data_dir, tmp_path, "lost", preempt,
        spec={"replicas": ReplicaRange(min=4, max=4), "priority_class": "low",
              "checkpoint": CheckpointPolicy(memory_every_steps=0)})
    params = torch.load(tmp_path / "final.pt")
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7)
    restores = [line for replica in record.read(rec).values() for line in replica
                if line["kind"] == "restore"]
    assert restores and {(line["admission"], line["step"], line["tier"])
                         for line in restores} == {(2, 0, "start")}, restores
    # What the first admission had reached, as health stored it: trained again.
    assert all(line["reached"] >= 10 for line in restores), restores
    job = json.loads(phalanx("job", "lost-1", "--json", "--data-dir", str(data)).stdout)
    assert job["admission"] == 2
    assert job["history"][0]["restored_from"] == "start", job["history"][0]
