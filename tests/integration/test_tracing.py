"""Trace context crosses processes: a request and its handling are one trace; traffic
sent outside any trace (heartbeats) records nothing.

Both sides are separate processes configured only through the standard
``OTEL_*`` variables (console exporter), exactly as a user would run them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    JobSpec,
    NodeHeartbeat,
    ReplicaRange,
    ScalingEvent,
    ScalingEventKind,
)
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.client import AdmissionClient
from phalanx.services.natsd import NatsServer

REQUESTER = textwrap.dedent("""
    import asyncio, sys
    from phalanx.bus import telemetry
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import NodeRecord, NodeStatusRequest

    async def main(url, node):
        telemetry.setup_tracing("requester")
        async with await Bus.connect(BusConfig.load(servers=[url])) as bus:
            with telemetry.tracer().start_as_current_span("operator asks for status"):
                await bus.request(subjects.agent_status(node), NodeStatusRequest(), NodeRecord)
        telemetry.shutdown_tracing()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


def _spans(text: str) -> list[dict]:
    decoder, spans, i = json.JSONDecoder(), [], 0
    while (start := text.find("{", i)) != -1:
        obj, i = decoder.raw_decode(text, start)
        spans.append(obj)
    return spans


async def test_request_and_handling_share_one_trace_across_processes(bus: Bus, nats_server,
                                                                     uid: str) -> None:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console"}
    beats: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

    async def on_beat(beat: NodeHeartbeat, _: Delivery) -> None:
        await beats.put(beat)

    await bus.subscribe(subjects.node_heartbeat(uid), NodeHeartbeat, on_beat)
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.agent", "--node-id", uid,
        "--heartbeat-interval", "0.1", "--nats", nats_server.url, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        await asyncio.wait_for(beats.get(), 30)
        requester = await asyncio.create_subprocess_exec(
            sys.executable, "-c", REQUESTER, nats_server.url, uid, env=env,
            stdout=asyncio.subprocess.PIPE)
        req_out, _ = await asyncio.wait_for(requester.communicate(), 30)
        assert requester.returncode == 0
    finally:
        agent.send_signal(signal.SIGTERM)
        agent_out, _ = await asyncio.wait_for(agent.communicate(), 15)

    sent = {s["name"]: s for s in _spans(req_out.decode())}
    status_subject = subjects.agent_status(uid)
    # Named by the subject's template, ids in attributes: few names, however many nodes.
    send = sent["send phalanx.agent.{node}.status"]
    root = sent["operator asks for status"]
    assert send["parent_id"] == root["context"]["span_id"]
    assert send["kind"] == "SpanKind.CLIENT"
    assert send["attributes"]["messaging.system"] == "nats"
    assert send["attributes"]["messaging.destination.name"] == status_subject
    assert send["attributes"]["messaging.destination.template"] == "phalanx.agent.{node}.status"

    agent_spans = _spans(agent_out.decode())
    # The agent beat every 0.1 s all along; no beat started a trace, only the request's
    # handling was recorded.
    assert [s["name"] for s in agent_spans] == ["process phalanx.agent.{node}.status"]
    handled = agent_spans
    process = handled[0]
    assert process["context"]["trace_id"] == send["context"]["trace_id"]
    assert process["parent_id"] == send["context"]["span_id"]
    assert process["kind"] == "SpanKind.CONSUMER"
    assert process["attributes"]["messaging.operation.type"] == "process"


async def test_every_scaling_event_is_a_span_in_the_jobs_trace_naming_the_job(
        own_nats: NatsServer, uid: str) -> None:
    """A pin, and the shrink it makes, are each a ``scaling <kind>`` span with the job's
    attributes, children of the job's submission (the job record's trace) as the admission
    of the job is, and the ScalingEvent published inside it carries its trace (its own
    server: the admission process must be the only one leading)."""
    config = BusConfig.load(env={}, servers=[own_nats.url])
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "PHALANX_ADMISSION_LEASE_S": "1.0"}
    agent = AgentService(AgentConfig(node_id=f"n-{uid}", slots=4, heartbeat_interval_s=0.2,
                                     launch=False), config)
    await agent.start()
    admission = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "phalanx.services.admission", "--nats", own_nats.url,
        "--instance", f"a-{uid}", env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    job_id = f"el-{uid}"
    events: asyncio.Queue[ScalingEvent] = asyncio.Queue()

    async def on_event(event: ScalingEvent, _: Delivery) -> None:
        await events.put(event)

    try:
        async with await Bus.connect(config) as bus:
            await bus.subscribe(subjects.job_scaling(job_id), ScalingEvent, on_event)
            client = AdmissionClient(bus)
            await client.submit(JobSpec(name="el", team="t", priority_class="normal",
                                        replicas=ReplicaRange(min=1, max=4),
                                        command=["true"]), job_id)
            await client.scale(job_id, 2)
            record = await client.job(job_id)
            pin = await asyncio.wait_for(events.get(), 30)
            shrink = await asyncio.wait_for(events.get(), 30)
            assert (pin.kind, shrink.kind) == (ScalingEventKind.PIN, ScalingEventKind.SHRINK)
    finally:
        admission.send_signal(signal.SIGTERM)
        admission_out, _ = await asyncio.wait_for(admission.communicate(), 30)
        await agent.stop()

    spans = _spans(admission_out.decode())
    scaling = {s["name"]: s for s in spans if s["name"].startswith("scaling ")}
    assert set(scaling) >= {"scaling pin", "scaling shrink"}, [s["name"] for s in spans]
    shrunk = scaling["scaling shrink"]["attributes"]
    assert (shrunk["phalanx.job"], shrunk["phalanx.scaling.from"],
            shrunk["phalanx.scaling.to"]) == (job_id, 4, 2)
    assert "pinned to 2" in shrunk["phalanx.scaling.reason"]
    # The job's trace: the record names the span that took its submission.
    assert record is not None and record.trace, record
    _, trace_id, submit_span, _ = record.trace.split("-")
    [submitted] = [s for s in spans if s["context"]["span_id"] == f"0x{submit_span}"]
    # The client does not trace: admission's own span of the submission starts the trace.
    assert submitted["name"] == "job submitted" and submitted["parent_id"] is None, submitted
    assert submitted["attributes"]["phalanx.job"] == job_id
    admitted = [s for s in spans if s["name"] == "admission admit"
                and s["attributes"]["phalanx.job"] == job_id]
    for span in [*scaling.values(), *admitted]:
        assert span["context"]["trace_id"] == f"0x{trace_id}", span
        assert span["parent_id"] == f"0x{submit_span}", span
    assert admitted, [s["name"] for s in spans]
    published = [s for s in spans if s["name"] == "publish phalanx.job.{job}.scaling"
                 and s["attributes"]["messaging.destination.name"]
                 == subjects.job_scaling(job_id)]
    assert {s["parent_id"] for s in published} == {
        s["context"]["span_id"] for s in scaling.values()}
