"""Observability end to end: one recovery seen as Jaeger and Prometheus would see it.

A local cluster (2 agents x 2 slots) exports its spans over OTLP/HTTP to a receiver the
test starts (:mod:`otlp_sink`, decoding the real protobuf exports) and serves
Prometheus metrics from every process on the ports ``up.json`` lists. A 4-rank elastic
job trains; rank 1 is SIGKILLed; once the three survivors have applied the generation
that drops it, the test finds

* one trace holding the killed rank's exit (its root), health's fault, elasticity's
  generation decision and each survivor's recovery phases (abort, apply, rebuild,
  state copy), each linked to its parent;
* on every process's ``/metrics``: the fault counted by kind with its detection time,
  the generation by reason, the survivors' recovery pauses and phases, the rank exit on
  the killed rank's node, the admission, and the bus metrics everywhere.

The same cluster idle records (next to) no spans, heartbeats notwithstanding, and each
process's page holds its own metric families and no other's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
from e2e_cli import next_of, phalanx
from metrics_page import scrape as scrape_page
from metrics_page import value
from otlp_sink import OtlpSink, SpanRecord
from prometheus_client.parser import text_string_to_metric_families
from test_elastic import ARGS, SCRIPT  # the workload of the session's data_dir

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobProgress,
    JobSpec,
    NodeHeartbeat,
    Placement,
    RankProgress,
    RankStarted,
    ReplicaRange,
)
from phalanx.services import control_plane, metrics
from phalanx.services.client import AdmissionClient

SURVIVORS = {"r0-0", "r2-0", "r3-0"}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of one process's ``/metrics`` page: (name, sorted labels) -> value."""
    return scrape_page(f"http://127.0.0.1:{port}/metrics")


def trace_of(spans: list[SpanRecord], leaf: SpanRecord) -> list[SpanRecord]:
    """``leaf`` and its ancestors up to the root, as the receiver got them."""
    by_id = {s.span_id: s for s in spans}
    chain = [leaf]
    while chain[-1].parent_id:
        parent = by_id.get(chain[-1].parent_id)
        assert parent is not None, f"{chain[-1].name}'s parent never arrived: " \
                                   f"{[s.name for s in chain]}"
        chain.append(parent)
    return chain


@pytest.mark.timeout(300)
async def test_one_recovery_is_one_trace_and_moves_every_services_counters(
        data_dir: Path, tmp_path: Path) -> None:
    cluster = tmp_path / "cluster"
    with OtlpSink() as jaeger:
        phalanx("up", "--agents", "2", "--slots-per-agent", "2", "--detach", "--data-dir",
                str(cluster), "--nats-port", "0", "--heartbeat-interval", "0.2",
                env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{jaeger.port}",
                     "OTEL_BSP_SCHEDULE_DELAY": "200", "PHALANX_HEALTH_CORDON_FAULTS": "1000"})
        try:
            state = json.loads((cluster / "up.json").read_text())
            ports = state["metrics"]
            assert set(ports) == {*control_plane.SERVICES, "agent-local-0",
                                  "agent-local-1"}, ports
            async with await Bus.connect(BusConfig.load(env={}, servers=state["nats_url"])) \
                    as bus:
                generations: asyncio.Queue[Generation] = asyncio.Queue()
                started: asyncio.Queue[RankStarted] = asyncio.Queue()
                progress: asyncio.Queue[RankProgress] = asyncio.Queue()
                await bus.subscribe(subjects.job_events("generation"), Generation,
                                    lambda m, _: generations.put(m))
                await bus.subscribe(subjects.job_events("started"), RankStarted,
                                    lambda m, _: started.put(m))
                await bus.subscribe(subjects.health_ranks(), RankProgress,
                                    lambda m, _: progress.put(m))
                spec = JobSpec(name="traced", team="t", priority_class="normal",
                               replicas=ReplicaRange(min=2, max=4), placement=Placement(),
                               command=[sys.executable, str(SCRIPT), "--data-dir",
                                        str(data_dir), *ARGS, "--steps", "100000"],
                               hang_timeout_s=5.0, grace_period_s=3.0)
                job = await AdmissionClient(bus).submit(spec, "traced-1")
                first = await next_of(generations, lambda g: g.job_id == job.job_id, 120)
                assert first.world_size == 4
                await next_of(progress, lambda p: p.job_id == job.job_id and p.step >= 20, 120)
                before = {name: scrape(port) for name, port in ports.items()}

                phalanx("chaos", "kill-rank", job.job_id, "1", "--data-dir", str(cluster))
                fault = await next_of(generations, lambda g: g.job_id == job.job_id
                                      and g.reason is GenerationReason.FAULT, 60)
                assert {m.replica_id for m in fault.members} == SURVIVORS
                # Elasticity launches the replacement once every survivor has applied the
                # generation (committed a step in it), so all three reports were handled.
                await next_of(started, lambda s: s.job_id == job.job_id
                              and s.replica_id == "r1-1", 60)
                after = {name: scrape(port) for name, port in ports.items()}

                # phalanx top's frame: the nodes, the job at its size, the recovery's events.
                frame = phalanx("top", "--once", "--data-dir", str(cluster),
                                env={**os.environ, "COLUMNS": "200"}).stdout
                assert "local-0" in frame and "local-1" in frame, frame
                row = next(line for line in frame.splitlines() if job.job_id in line
                           and "admitted" in line)
                assert "(2..4)" in row, frame
                assert "fault crash: r1-0" in frame and "r1-1 started in slot 1" in frame, frame

                # Health sets its step gauge as it stores the job's progress record (once a
                # second): once the record says 20, so does the gauge.
                records = await TypedKV.open(bus.js, subjects.PROGRESS_BUCKET, JobProgress)
                async with asyncio.timeout(30):
                    async for change in records.watch():
                        if change is not None and change.key == job.job_id \
                                and change.value is not None and change.value.step >= 20:
                            break
                after["health"] = scrape(ports["health"])

                # Metrics: what moved where, read as Prometheus would.
                health, elasticity = after["health"], after["elasticity"]
                assert value(health, "phalanx_faults_total", kind="crash") \
                    == value(before["health"], "phalanx_faults_total", kind="crash") + 1
                assert value(health, "phalanx_fault_detection_seconds_count", kind="crash") \
                    == value(before["health"], "phalanx_fault_detection_seconds_count",
                             kind="crash") + 1
                assert value(elasticity, "phalanx_generations_total", reason="fault") == 1
                assert value(elasticity, "phalanx_recovery_seconds_count", reason="fault") == 3
                assert value(elasticity, "phalanx_recovery_phase_seconds_count",
                             phase="rebuild") >= 4 + 3  # generation 0 and 1's members
                # The replacement may have joined by now (generation 2, size 4).
                assert (value(elasticity, "phalanx_job_generation", phalanx_job=job.job_id),
                        value(elasticity, "phalanx_job_world_size", phalanx_job=job.job_id)) in (
                    (fault.generation, 3), (fault.generation + 1, 4))
                assert value(health, "phalanx_job_step", phalanx_job=job.job_id) >= 20
                assert sum(value(after[a], "phalanx_agent_rank_exits_total", cause="exited")
                           for a in after if a.startswith("agent-")) == 1  # the killed rank
                admission = after["admission"]
                assert value(admission, "phalanx_admission_admitted_total") == 1
                assert value(admission, "phalanx_admission_latency_seconds_count") == 1
                assert value(admission, "phalanx_admission_queue_depth") == 0
                for name, samples in after.items():
                    assert ("phalanx_bus_reconnects_total", ()) in samples, name

                # Traces: wait until every survivor's recovery phases have been exported.
                def recovered() -> list[SpanRecord]:
                    return [s for s in jaeger.received()
                            if s.name == f"apply generation {fault.generation}"
                            and s.attributes.get("phalanx.job") == job.job_id]

                await asyncio.to_thread(jaeger.wait_for, lambda: len(recovered()) == 3, 60)
                await AdmissionClient(bus).cancel(job.job_id)
        finally:
            phalanx("down", "--data-dir", str(cluster))
        spans = jaeger.received()
    applies = recovered()
    assert {s.attributes["phalanx.replica"] for s in applies} == SURVIVORS
    assert {s.service for s in applies} == {"phalanx-rank"}
    exit_span = trace_of(spans, applies[0])[-1]
    assert exit_span.name == "rank 1 exited" and exit_span.service == "phalanx-agent"
    assert exit_span.attributes["phalanx.exit.signal"] == "SIGKILL"
    trace_id = exit_span.trace_id
    for apply in applies:
        chain = trace_of(spans, apply)
        names = [(s.service, s.name) for s in chain]
        assert {s.trace_id for s in chain} == {trace_id}, names
        assert chain[-1] == exit_span, names  # the exit is the root of the recovery's trace
        # child -> parent: the rank's apply, elasticity's decision, health's fault, the exit
        decision = names.index(("phalanx-elasticity", f"generation {fault.generation}"))
        raised = names.index(("phalanx-health", "fault crash"))
        assert 0 < decision < raised < len(names) - 1, names
        assert chain[decision].attributes["phalanx.reason"] == "fault"
        assert chain[raised].attributes["phalanx.replica"] == "r1-0"
        assert chain[raised].attributes["phalanx.fault.detection_s"] >= 0
        phases = {s.name for s in spans if s.parent_id == apply.span_id}
        assert {"rebuild process group", "copy state"} <= phases, phases
        assert apply.attributes["phalanx.world_size"] == 3
    # Each survivor's aborted step is the phase before, a sibling of its apply.
    aborts = {s.attributes["phalanx.replica"]: s for s in spans if s.name == "abort step"
              and s.trace_id == trace_id}
    assert set(aborts) == SURVIVORS
    for apply in applies:
        assert aborts[apply.attributes["phalanx.replica"]].parent_id == apply.parent_id
    # The admission decision that started the job is a trace of its own.
    admitted = [s for s in spans if s.name == "admission admit"
                and s.attributes.get("phalanx.job") == job.job_id]
    assert len(admitted) == 1 and admitted[0].service == "phalanx-admission"
    assert not jaeger.bad_requests


def families(port: int) -> set[str]:
    """The phalanx metric families one process's ``/metrics`` page declares (with or
    without samples yet; a counter's ``_created`` series, which the parser reads as a
    family of its own, is its counter's)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {f.name.removesuffix("_created") for f in text_string_to_metric_families(text)
            if f.name.startswith("phalanx_")}


def names(*groups: metrics.Families) -> set[str]:
    return {m.name for group in groups for family in group for m in family.collect()}


@pytest.mark.timeout(180)
async def test_an_idle_cluster_records_no_spans_and_each_process_exports_its_own_families(
        tmp_path: Path) -> None:
    """Two agents beating every 0.2 s for 10 s (50 beats each, all heard by health) start no
    trace: the heartbeats publish and are handled outside any trace. Spans are exported
    within 200 ms and flushed at ``phalanx down``, so the receiver has all there were."""
    cluster = tmp_path / "cluster"
    with OtlpSink() as jaeger:
        phalanx("up", "--agents", "2", "--slots-per-agent", "2", "--detach", "--data-dir",
                str(cluster), "--nats-port", "0", "--heartbeat-interval", "0.2",
                env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{jaeger.port}",
                     "OTEL_BSP_SCHEDULE_DELAY": "200"})
        try:
            state = json.loads((cluster / "up.json").read_text())
            ports = state["metrics"]
            pages = {name: families(port) for name, port in ports.items()}
            async with await Bus.connect(BusConfig.load(env={}, servers=state["nats_url"])) \
                    as bus:
                beats: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()
                await bus.subscribe(subjects.node_heartbeats(), NodeHeartbeat,
                                    lambda m, _: beats.put(m))
                counted = {"local-0": 0, "local-1": 0}
                async with asyncio.timeout(60):
                    while min(counted.values()) < 50:
                        counted[(await beats.get()).node_id] += 1
        finally:
            phalanx("down", "--data-dir", str(cluster))
        spans = jaeger.received()
    assert len(spans) <= 5, [(s.service, s.name) for s in spans]
    assert not [s for s in spans if "heartbeat" in s.name], [s.name for s in spans]

    # Each process exports its own families: no agent shows admission's queue, no
    # service shows an agent's ranks.
    own = {"admission": names(metrics.LEADERSHIP, metrics.ADMISSION),
           "health": names(metrics.LEADERSHIP, metrics.HEALTH),
           "elasticity": names(metrics.LEADERSHIP, metrics.ELASTICITY),
           "checkpoint": names(metrics.LEADERSHIP),
           "agent-local-0": names(metrics.AGENT), "agent-local-1": names(metrics.AGENT)}
    assert set(own) == set(pages)
    for process, declared in pages.items():
        assert declared == names(metrics.BUS) | own[process], process
    assert "phalanx_admission_queue_depth" not in pages["agent-local-0"]
    assert "phalanx_agent_ranks" not in pages["admission"]
