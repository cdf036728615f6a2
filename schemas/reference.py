"""Generates ``docs/wire.md``, the reference of every subject and message.

The subject table is built by calling the real subject builders with
placeholder identifiers and the message sections by inspecting the real
structs, so the document cannot drift from the code; CI runs
``python -m phalanx.schemas.reference --check docs/wire.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import msgspec.inspect as mi

from phalanx.schemas import messages as m
from phalanx.schemas import subjects
from phalanx.schemas.codec import MAX_PAYLOAD_BYTES


@dataclasses.dataclass(frozen=True)
class SubjectDoc:
    build: Callable[[], str]
    pattern: str  # "event" (publish) or "request" (request/reply)
    message: type[m.Message]
    reply: type[m.Message] | None
    publisher: str
    subscribers: str
    summary: str


CATALOG: tuple[SubjectDoc, ...] = (
    SubjectDoc(lambda: subjects.node_heartbeat("NODE"), "event", m.NodeHeartbeat, None,
               "agent", "health", "sign of life every `heartbeat_interval_s`"),
    SubjectDoc(lambda: subjects.agent_status("NODE"), "request", m.NodeStatusRequest,
               m.NodeRecord, "CLI, services", "agent", "the agent's live registry record"),
    SubjectDoc(lambda: subjects.agent_launch("NODE"), "request", m.LaunchReplica, m.ReplicaReply,
               "elasticity", "agent", "run a new replica in one of the job's slots here"),
    SubjectDoc(lambda: subjects.agent_stop("NODE"), "request", m.StopReplica, m.ReplicaReply,
               "elasticity", "agent", "stop a replica the job no longer needs"),
    SubjectDoc(lambda: subjects.admission_submit(), "request", m.SubmitRequest, m.JobRecord,
               "CLI, Python client", "admission (any instance)", "submit a job (idempotent)"),
    SubjectDoc(lambda: subjects.admission_cancel(), "request", m.JobRequest, m.JobRecord,
               "CLI, Python client", "admission (any instance)", "cancel a job"),
    SubjectDoc(lambda: subjects.admission_requeue(), "request", m.RequeueRequest, m.JobRecord,
               "elasticity", "admission (any instance)",
               "a running job lost too many members for too long: queue it again"),
    SubjectDoc(lambda: subjects.admission_explain(), "request", m.JobRequest, m.Explanation,
               "CLI, Python client", "admission (any instance)",
               "why a job is pending, with its queue position"),
    SubjectDoc(lambda: subjects.admission_scale(), "request", m.ScaleRequest, m.JobRecord,
               "CLI (`phalanx scale`), Python client", "admission (any instance)",
               "pin an elastic job's size, or release the pin"),
    SubjectDoc(lambda: subjects.admission_leader("VERB"), "request", m.SubmitRequest,
               m.JobRecord, "admission instances", "admission leader",
               "requests forwarded to the leader (verb = submit, cancel, requeue, explain, "
               "scale)"),
    SubjectDoc(lambda: subjects.job_state("JOB"), "event", m.JobRecord, None,
               "admission", "agents, CLI", "the job's admission state changed"),
    SubjectDoc(lambda: subjects.job_scaling("JOB"), "event", m.ScalingEvent, None,
               "admission", "CLI, operators, benchmarks",
               "the job grew, shrank, was pinned or released; a planned change is done or "
               "abandoned"),
    SubjectDoc(lambda: subjects.job_generation("JOB"), "event", m.Generation, None,
               "elasticity", "runtime (every rank), agents", "a job's new membership"),
    SubjectDoc(lambda: subjects.replica_ready("JOB"), "event", m.ReplicaReady, None,
               "runtime", "elasticity", "a replica has torch and its model: it can join"),
    SubjectDoc(lambda: subjects.generation_applied("JOB"), "event", m.GenerationApplied, None,
               "runtime", "elasticity", "a member switched to a generation"),
    SubjectDoc(lambda: subjects.generation_given_up("JOB"), "event", m.GenerationGivenUp, None,
               "runtime", "elasticity",
               "a member could not form the newest generation: decide it again"),
    SubjectDoc(lambda: subjects.job_fault("JOB"), "event", m.Fault, None,
               "health", "elasticity, runtime", "a rank or node of the job failed"),
    SubjectDoc(lambda: subjects.rank_started("JOB"), "event", m.RankStarted, None,
               "agent", "health", "the agent started a rank process"),
    SubjectDoc(lambda: subjects.rank_exited("JOB"), "event", m.RankExited, None,
               "agent", "health", "a rank process ended (published at once)"),
    SubjectDoc(lambda: subjects.agent_chaos("NODE"), "request", m.ChaosRequest, m.ChaosReply,
               "`phalanx chaos`", "agent", "fault injection: kill a rank, kill or pause an agent"),
    SubjectDoc(lambda: subjects.agent_logs("NODE"), "request", m.LogRequest, m.LogReply,
               "`phalanx logs`", "agent", "a job's replica logs on the node: which, or a piece"),
    SubjectDoc(lambda: subjects.node_condition("NODE"), "event", m.NodeConditionChanged, None,
               "health", "CLI, operators", "a node was found lost, came back, was cordoned"),
    SubjectDoc(lambda: subjects.node_chaos("NODE"), "event", m.NodeConditionChanged, None,
               "agent (its own node only)", "health",
               "a fault is being injected on this node until `until`: not the node's failure"),
    SubjectDoc(lambda: subjects.health_rank("JOB", 0), "event", m.RankProgress, None,
               "runtime", "health", "step progress, every step"),
    SubjectDoc(lambda: subjects.ckpt_snapshot("JOB"), "event", m.SnapshotRecord, None,
               "runtime", "checkpoint", "a state shard is held at a tier (or found corrupt)"),
    SubjectDoc(lambda: subjects.agent_snapshot("NODE"), "request", m.SnapshotReserve,
               m.SnapshotReservation, "runtime", "agent",
               "snapshot buffers in the node's shared memory (refused over the node's bound)"),
    SubjectDoc(subjects.ckpt_resume, "request", m.ResumeRequest, m.ResumeAnswer,
               "runtime, CLI", "checkpoint", "from which step and sources a job can resume"),
    SubjectDoc(lambda: subjects.agent_fetch("NODE", "JOB"), "request", m.ReplicaFetch,
               m.ReplicaFetched, "runtime", "agent",
               "send a snapshot copy this node holds to a member's node, before a restore"),
)


#: What the KV buckets hold: (bucket, key, value type, what).
KV_VALUES: tuple[tuple[str, str, type[m.Message], str], ...] = (
    (subjects.NODES_BUCKET, "node id", m.NodeRecord, "the node registry"),
    (subjects.JOBS_BUCKET, "job id", m.JobRecord, "every job's admission state"),
    (subjects.ADMISSION_BUCKET, "`job.<job id>`", m.JobPlacement,
     "one job's placement in admission's ledger, compare-and-swapped"),
    (subjects.ADMISSION_BUCKET, "`node.<node id>`", m.NodeClaims,
     "the slots admission has given on one node, by job; compare-and-swapped"),
    (subjects.ADMISSION_BUCKET, "`leader`", m.Lease, "the admission leader's lease"),
    (subjects.GENERATIONS_BUCKET, "job id", m.Generation, "each running job's membership"),
    (subjects.LEASES_BUCKET, "service (`health`, `elasticity`)", m.Lease,
     "which instance of a service leads"),
    (subjects.CURSORS_BUCKET, "service", m.StreamCursor,
     "how far a service has acted on the job-events stream"),
    (subjects.ELASTICITY_BUCKET, "job id", m.JobSnapshot,
     "each running job's elasticity state, for a new leader"),
    (subjects.HEALTH_BUCKET, "job id", m.JobSnapshot,
     "each watched job's ranks (replica, exit, reporting), for a new leader"),
    (subjects.CHECKPOINTS_BUCKET, "job id", m.CheckpointCatalog,
     "each job's snapshots: steps, shards, copies, checksums"),
    (subjects.BUDDIES_BUCKET, "node id", m.BuddyPlacement,
     "which agent holds replicas of each live node's snapshots (checkpoint service)"),
    (subjects.PROGRESS_BUCKET, "job id", m.JobProgress,
     "how far each job has trained: step, rate, restarts (health; kept after it ends)"),
    (subjects.HISTORY_BUCKET, "job id", m.JobHistory,
     "each job's generations and the pause each cost (elasticity; kept after it ends)"),
    ("any of these", "the value's", m.Spilled,
     f"in place of a value past one payload (also published in its place): its encoding "
     f"is in `{subjects.CHUNKS_BUCKET}`, keys `<bucket>.<key>.<digest>.<i>`, raw slices of "
     "at most 768 KiB, written before the pointer and removed once a newer value replaced "
     "it (`phalanx.bus.spill`)"),
)


def _display(subject: str) -> str:
    """Show placeholder tokens (NODE, JOB, 0) as ``<node>``, ``<job>``, ``<rank>``."""
    subject = re.sub(r"\.0(\.|$)", r".<rank>\1", subject)
    return re.sub(r"\b([A-Z]+)\b", lambda t: f"<{t[1].lower()}>", subject)


def _type_name(t: mi.Type) -> str:
    match t:
        case mi.StructType():
            return f"[{t.cls.__name__}](#{t.cls.__name__.lower()})"
        case mi.ListType():
            return f"list[{_type_name(t.item_type)}]"
        case mi.DictType():
            return f"dict[{_type_name(t.key_type)}, {_type_name(t.value_type)}]"
        case mi.UnionType():
            return " \\| ".join(_type_name(x) for x in t.types)
        case mi.EnumType():
            return " \\| ".join(f'"{v.value}"' for v in t.cls)
        case mi.NoneType():
            return "null"
    return type(t).__name__.removesuffix("Type").lower()


def _constraints(t: mi.Type) -> str:
    parts = []
    for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"),
                      ("min_length", "min len"), ("max_length", "max len"), ("pattern", "~")):
        value = getattr(t, attr, None)
        if value is not None:
            parts.append(f"{sym} `{value}`" if attr == "pattern" else f"{sym} {value}")
    if isinstance(t, mi.UnionType):
        parts += [c for x in t.types if (c := _constraints(x))]
    return ", ".join(parts)


def _default(f: mi.Field) -> str:
    if f.required:
        return "required"
    value = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    return f"`{msgspec.json.encode(value).decode()}`"


def _struct_section(cls: type[msgspec.Struct]) -> list[str]:
    info = mi.type_info(cls)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"{cls.__name__} is not a msgspec Struct")
    doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    title = cls.__name__
    lines = [f"### {title}", ""]
    if issubclass(cls, m.Message):
        lines += [f"Wire name: `{cls.wire_name()}`", ""]
    lines += [doc, "", "| field | type | constraints | default |", "| --- | --- | --- | --- |"]
    for f in info.fields:
        lines.append(f"| `{f.encode_name}` | {_type_name(f.type)} | {_constraints(f.type)} "
                     f"| {_default(f)} |")
    return [*lines, ""]


def _parts() -> list[type[m.Part]]:
    found: list[type[m.Part]] = []

    def walk(t: mi.Type) -> None:
        match t:
            case mi.StructType() if issubclass(t.cls, m.Part) and t.cls not in found:
                found.append(t.cls)
                for f in t.fields:
                    walk(f.type)
            case mi.StructType():
                for f in t.fields:
                    walk(f.type)
            case mi.ListType():
                walk(t.item_type)
            case mi.UnionType():
                for x in t.types:
                    walk(x)

    for msg in m.ALL_MESSAGES:
        walk(mi.type_info(msg))
    return found


def render() -> str:
    """The full text of ``docs/wire.md``."""
    lines = [
        "# Wire reference",
        "",
        "Generated by `python -m phalanx.schemas.reference > docs/wire.md`; do not edit.",
        "",
        "Payloads are MessagePack maps. Every top-level message carries its versioned",
        "wire name in the `type` field; decoding rejects a missing or foreign name, an",
        "unknown version, unknown fields, wrong types and out-of-range values with one",
        f"`WireError` naming the subject and the problem. Payloads are at most {MAX_PAYLOAD_BYTES}",
        "bytes; a stored value past that (a job of thousands of replicas) is held in chunks",
        f"and travels as a [Spilled](#spilled) pointer, up to {m.MAX_SPILLED_BYTES} bytes.",
        "W3C `traceparent`/`tracestate` travel in NATS headers. Requests that fail",
        "are answered with the NATS service API error headers `Nats-Service-Error-Code`",
        "(400 bad request, 500 handler failure) and `Nats-Service-Error`.",
        "",
        "## Subjects",
        "",
        "| subject | pattern | message | reply | from | to | what |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in CATALOG:
        reply = f"[{s.reply.__name__}](#{s.reply.__name__.lower()})" if s.reply else "—"
        lines.append(
            f"| `{_display(s.build())}` | {s.pattern} "
            f"| [{s.message.__name__}](#{s.message.__name__.lower()}) | {reply} "
            f"| {s.publisher} | {s.subscribers} | {s.summary} |"
        )
    lines += [
        "",
        "## JetStream KV buckets",
        "",
        "| bucket | key | value | what |",
        "| --- | --- | --- | --- |",
        *(f"| `{bucket}` | {key} | [{value.__name__}](#{value.__name__.lower()}) | {what} |"
          for bucket, key, value, what in KV_VALUES),
        "",
        "Services also answer the NATS service API: `$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`",
        "(each endpoint's stats `data` holds its `bad_messages` count).",
        "",
        "## Messages",
        "",
    ]
    for msg in m.ALL_MESSAGES:
        lines += _struct_section(msg)
    lines += ["## Nested parts", ""]
    for part in _parts():
        lines += _struct_section(part)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="PATH", help="exit 1 if PATH is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        path = Path(args.check)
        if not path.exists() or path.read_text() != text:
            print(f"{path} is stale: run `python -m phalanx.schemas.reference > {path}`",
                  file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
