"""Bad input for every subject phalanx listens on, and the harness that delivers it.

Shared by ``bench/fuzz.py`` (10,000 inputs per subject) and
``tests/integration/test_fuzz.py`` (a few hundred); nothing here ships in the
``phalanx`` package.

**Inputs** (:class:`Fuzzer`, seeded ``random.Random``) for one message type:

* *generated*: a message built from the type's ``msgspec.inspect`` info, every
  constraint honoured, identifiers drawn mostly from the cluster's real ones
  (:class:`World`) and otherwise random. Most decode and are *semantically* wrong:
  a fault for an unknown job, a ready for a slot that does not exist, a replica id
  of the wrong shape, a step count of 2**63, a job record whose spec does not fit;
* *mutated*: a generated message with one structural change (a field dropped or
  unknown, another schema version or type name, a value of the wrong type or out
  of range, a huge list, deep nesting, a value spliced in from another message
  type, a whole message of another type) or byte damage (flips, truncation,
  insertion, duplication, invalid UTF-8);
* *junk*: empty, random bytes, JSON, MessagePack that is not a map.

**The oracle is the codec.** Whether ``decode(payload, subject's type)`` raises
decides what the service must do: count it as a bad message (and answer a request
``400``), or act on it. A bad message that is not counted exactly once, a request
not answered ``400``, a service that stopped or whose leadership failed with an
exception, or an exception logged at ERROR, is a finding.

**The harness** (:class:`Barrage`) runs admission, health, elasticity and one agent
in this process, each with its own bus connection, so their counters
(``Service`` endpoint stats, ``Bus.counters``, ``TypedKV.counters``) can be read
exactly; they are real services on a real nats-server. Targets run one after
another: send every input, then wait until each counter that must move has moved,
then check it moved by exactly the number of bad inputs. KV targets write the
buckets services follow or read; their counts are "at least" (a follower that
starts over reads a value again), and each bad value is read before the next
write (a follower may read only a key's newest value: one overwritten at once
was never there for it to count). Targets that corrupt leadership state (leases,
cursors, the ledger) run last.

Limits: destructive but *valid* requests are not sent (a ``kill_agent`` or
``pause_agent`` chaos request does what it says; who may send it is a permissions
question, not a parsing one), nor valid leases that expire in the far future (a
lease is trusted until it expires). Job commands come from a harmless pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import os
import random
import string
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from phalanx.bus.client import ERROR_CODE_HEADER, Bus, Counters
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode, names
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import (
    ALL_MESSAGES,
    ChaosAction,
    ChaosRequest,
    Explanation,
    Fault,
    Generation,
    GenerationApplied,
    GenerationGivenUp,
    JobPlacement,
    JobRecord,
    JobRequest,
    JobSnapshot,
    JobSpec,
    JobState,
    LaunchReplica,
    Lease,
    LogRequest,
    Message,
    NodeClaims,
    NodeCondition,
    NodeConditionChanged,
    NodeHeartbeat,
    NodeRecord,
    NodeStatusRequest,
    RankExited,
    RankProgress,
    RankStarted,
    ReplicaRange,
    ReplicaReady,
    RequeueRequest,
    ScaleRequest,
    StopReplica,
    StreamCursor,
    SubmitRequest,
)
from phalanx.services.admission.config import AdmissionConfig
from phalanx.services.admission.ledger import job_key, node_key
from phalanx.services.admission.service import LEADER_KEY, AdmissionService
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService
from phalanx.services.base import Service
from phalanx.services.elasticity.core import ElasticityCore
from phalanx.services.elasticity.service import ElasticityService
from phalanx.services.health.core import HealthPolicy
from phalanx.services.health.service import HealthService

IDENT = r"^[A-Za-z0-9_\-]+\Z"
#: Bytes published to a target before waiting for its services to catch up.
KV_ACK_TIMEOUT_S = 60.0
PACE_BYTES = 4 << 20
#: Fields mostly generated small, so that generated messages often fit the cluster.
SMALL_INTS = frozenset({"slot", "rank", "min", "max", "slots_per_replica", "slots",
                        "world_size", "generation", "shard", "num_shards", "format"})
SAFE_COMMANDS = (["true"], ["false"], ["sleep", "0.2"], ["/nonexistent/fuzz-rank"])


# --- the cluster's identifiers ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class World:
    """Identifiers that exist (or nearly do), so generated messages hit real state."""

    node: str = "fz-node"
    real_job: str = "fz-real"
    jobs: tuple[str, ...] = ("fz-real", "fz-a", "fz-b", "fz-gone")
    nodes: tuple[str, ...] = ("fz-node", "fz-ghost")
    replicas: tuple[str, ...] = ("r0-0", "r1-0", "r0-1", "r7-3", "r-1", "x", "r0",
                                 "r99999999999999999999-0", "r1-x", "r1-99999999999999999999")
    teams: tuple[str, ...] = ("default", "fz-team")
    classes: tuple[str, ...] = ("normal", "high", "fz-class")


# --- inputs ----------------------------------------------------------------------------


class Kind(enum.StrEnum):
    GENERATED = "generated"
    MUTATED = "mutated"
    JUNK = "junk"


@dataclasses.dataclass(frozen=True)
class Input:
    payload: bytes
    kind: Kind
    how: str  # which generator or mutation made it


class Fuzzer:
    """Seeded inputs for one message type (see the module docstring)."""

    def __init__(self, rng: random.Random, world: World) -> None:
        self.rng = rng
        self.world = world

    # generation ----------------------------------------------------------------------

    def document(self, message_type: type[Message]) -> dict[str, Any]:
        """A valid-by-type MessagePack map of ``message_type`` (its cross-field checks may
        still fail, which makes it a bad message like any other)."""
        info = mi.type_info(message_type)
        assert isinstance(info, mi.StructType)  # every message is a struct
        doc = self._struct(info, depth=0)
        doc["type"] = message_type.wire_name()
        if self.rng.random() < 0.7:
            _cohere(doc)
        return doc

    def _struct(self, info: mi.StructType, depth: int) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for field in info.fields:
            if not field.required and self.rng.random() < 0.5:
                continue
            doc[field.encode_name] = self._value(field.type, field.name, depth + 1)
        return doc

    def _value(self, t: mi.Type, name: str, depth: int) -> Any:
        rng = self.rng
        match t:
            case mi.StrType():
                return self._str(t, name)
            case mi.BoolType():
                return rng.random() < 0.5
            case mi.IntType():
                low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -2**63)
                high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
                if name in SMALL_INTS and rng.random() < 0.8:
                    value = low + rng.randrange(4)
                else:
                    value = rng.choice([low, low + 1, low + rng.randrange(1000), 2**31,
                                        2**63 - 1, 2**64 - 1 if low >= 0 else -2**63])
                return value if high is None else min(value, high)  # its type's bounds
            case mi.FloatType():
                floor = t.ge if t.ge is not None else (t.gt if t.gt is not None else -1e308)
                ceiling = t.le if t.le is not None else (t.lt if t.lt is not None else None)
                drawn = rng.choice([floor + 1e-9, floor + rng.random() * 10, time.time(),
                                    1e308, float("inf")])
                return drawn if ceiling is None else min(drawn, ceiling)
            case mi.NoneType():
                return None
            case mi.BytesType():
                return rng.randbytes(rng.randrange(64))
            case mi.EnumType():
                return rng.choice([m.value for m in t.cls])
            case mi.LiteralType():
                return rng.choice(t.values)
            case mi.ListType():
                if name == "command":
                    return list(rng.choice(SAFE_COMMANDS))
                n = rng.randrange(t.min_length or 0, max(t.min_length or 0, 4) + 1)
                return [self._value(t.item_type, name, depth + 1) for _ in range(n)]
            case mi.DictType():
                return {(self._str(t.key_type, "label") if isinstance(t.key_type, mi.StrType)
                         else self._value(t.key_type, "key", depth + 1)):
                        self._value(t.value_type, "label", depth + 1)
                        for _ in range(rng.randrange(3))}
            case mi.StructType():
                return self._struct(t, depth)
            case mi.UnionType():
                return self._value(rng.choice(t.types), name, depth)
        raise TypeError(f"no generator for {t!r} ({name})")

    def _str(self, t: mi.StrType, name: str) -> str:
        rng, world = self.rng, self.world
        if t.pattern == IDENT:
            pool = {"job_id": world.jobs, "node_id": world.nodes, "replica_id": world.replicas,
                    "team": world.teams, "priority_class": world.classes,
                    "holder": ("fz-adm", "someone-else")}.get(name)
            if pool and rng.random() < 0.85:
                return rng.choice(pool)
            return "".join(rng.choices(string.ascii_letters + string.digits + "-_",
                                       k=rng.randrange(1, 24)))
        if t.pattern and "KILL" in t.pattern:
            return rng.choice(["KILL", "STOP", "TERM", "CONT", "INT"])
        if t.pattern and "0-9a-f" in t.pattern:
            return rng.randbytes(8).hex()
        if t.pattern:  # an endpoint
            return rng.choice(["", "127.0.0.1:29500", "[::1]:1", "fz-node:65535"])
        alphabet = string.printable + "ßé漢\u200b\U0001f600"
        return "".join(rng.choices(alphabet, k=rng.randrange(0, 40)))[:t.max_length or None]

    # mutation ------------------------------------------------------------------------

    def inputs(self, message_type: type[Message], count: int) -> Iterator[Input]:
        """``count`` inputs for a subject carrying ``message_type``: about a quarter
        generated, six in ten mutated, the rest junk."""
        for _ in range(count):
            roll = self.rng.random()
            if roll < 0.25:
                yield Input(msgspec.msgpack.encode(self.document(message_type)),
                            Kind.GENERATED, "generated")
            elif roll < 0.60:
                how, doc = self._mutate_structure(self.document(message_type))
                yield Input(_encode(doc), Kind.MUTATED, how)
            elif roll < 0.90:
                how, data = self._mutate_bytes(
                    msgspec.msgpack.encode(self.document(message_type)))
                yield Input(data, Kind.MUTATED, how)
            else:
                how, data = self._junk()
                yield Input(data, Kind.JUNK, how)

    def _mutate_structure(self, doc: dict[str, Any]) -> tuple[str, Any]:
        rng = self.rng
        how = rng.choice(["drop", "unknown", "retag", "wrong-type", "out-of-range",
                          "huge-list", "deep", "splice", "other-type"])
        paths = list(_paths(doc))
        path = rng.choice(paths) if paths else ()
        match how:
            case "drop" if len(doc) > 1:
                del doc[rng.choice([k for k in doc if k != "type"] or ["type"])]
            case "unknown":
                doc[rng.choice(["extra", "type2", "JOB_ID", ""])] = rng.choice([1, "x", None])
            case "retag":
                base = doc["type"].rsplit(".v", 1)[0]
                doc["type"] = rng.choice([f"{base}.v2", f"{base}.v0", base, "phalanx.nope.v1",
                                          "", 1, None, ["x"]])
            case "wrong-type" if path:
                _set(doc, path, rng.choice([None, True, 7, -1.5, "7", b"\x00", [1], {"a": 1}]))
            case "out-of-range" if path:
                _set(doc, path, rng.choice([-1, -2**63, 2**64 - 1, float("nan"), -0.5,
                                            float("-inf"), "", "a.b", "*", ">", "$SYS", " ",
                                            "x" * 5000, "é" * 200]))
            case "huge-list" if path:
                _set(doc, path, [rng.choice(self.world.nodes)] * rng.choice([1000, 10_000,
                                                                             100_000]))
            case "deep" if path:
                nested: Any = 0
                for _ in range(rng.choice([50, 1000, 10_000])):
                    nested = [nested]
                _set(doc, path, nested)
            case "splice" if path:
                other = self.document(rng.choice(ALL_MESSAGES))
                source = list(_paths(other))
                _set(doc, path, _get(other, rng.choice(source)) if source else other)
            case "other-type":
                return how, self.document(rng.choice(ALL_MESSAGES))
        return how, doc

    def _mutate_bytes(self, data: bytes) -> tuple[str, bytes]:
        rng = self.rng
        buf = bytearray(data)
        how = rng.choice(["flip", "truncate", "insert", "duplicate", "bad-utf8", "zero"])
        match how:
            case "flip":
                for _ in range(rng.randrange(1, 9)):
                    buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            case "truncate":
                del buf[rng.randrange(len(buf)):]
            case "insert":
                at = rng.randrange(len(buf) + 1)
                buf[at:at] = rng.randbytes(rng.randrange(1, 16))
            case "duplicate":
                start = rng.randrange(len(buf))
                buf[start:start] = buf[start:start + rng.randrange(1, 32)]
            case "bad-utf8":
                for i in range(len(buf)):
                    if 0xa1 <= buf[i] <= 0xbf and i + 1 < len(buf):  # a fixstr: damage its body
                        buf[i + 1] = rng.choice([0xff, 0xc0, 0xed])
                        break
            case "zero":
                at = rng.randrange(len(buf))
                buf[at:at + 8] = bytes(len(buf[at:at + 8]))
        return how, bytes(buf)

    def _junk(self) -> tuple[str, bytes]:
        rng = self.rng
        how = rng.choice(["empty", "random", "json", "not-a-map", "nested", "nil"])
        data = {
            "empty": b"",
            "random": rng.randbytes(rng.randrange(1, 256)),
            "json": json.dumps({"type": "phalanx.job_request.v1", "job_id": "fz-a"}).encode(),
            "not-a-map": msgspec.msgpack.encode(["phalanx.job_request.v1", "fz-a"]),
            "nested": b"\x91" * 100_000 + b"\xc0",
            "nil": b"\xc0",
        }[how]
        return how, data


def _encode(doc: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(doc)
    except (OverflowError, RecursionError, msgspec.EncodeError):
        return b"\xc1"  # not encodable by us either: send MessagePack's one invalid byte


def _cohere(doc: Any) -> None:
    """Make a generated document meet the cross-field rules a random one almost never
    meets (a generation's ranks 0..n-1 over n distinct replicas; a rank kill names a job
    and a rank; a trace is a traceparent or none; scaling and checkpoint policies within
    their rules; a placement no larger than the job), so valid messages of those types
    reach the services too, not only their rejections."""
    if isinstance(doc, list):
        for item in doc:
            _cohere(item)
    if not isinstance(doc, dict):
        return
    if isinstance(doc.get("trace"), str):
        doc["trace"] = ""  # a random string is no traceparent
    doc.pop("replica_discrete_values", None)  # sorted, within min..max, not with a step
    if "durable_every_steps" in doc:
        doc["durable_every_steps"] = 0  # else a multiple of memory_every_steps
    if isinstance(doc.get("min"), int) and isinstance(doc.get("max"), int) \
            and doc["min"] > doc["max"]:
        doc["min"], doc["max"] = doc["max"], doc["min"]
    if "from_replicas" in doc and "kind" in doc:
        doc["kind"] = "grow"  # a planned change grows or shrinks
    if doc.get("action") == ChaosAction.KILL_RANK.value:
        doc["job_id"] = doc.get("job_id") or "fuzz-job"
        doc["rank"] = doc["rank"] if isinstance(doc.get("rank"), int) else 0
    spec = doc.get("spec")
    if isinstance(doc.get("nodes"), list) and isinstance(spec, dict) \
            and isinstance(spec.get("replicas"), dict) \
            and isinstance(spec["replicas"].get("max"), int):
        del doc["nodes"][max(spec["replicas"]["max"], 1):]  # no more than the job's size
        if isinstance(doc.get("slots"), list):
            doc["slots"] = list(range(len(doc["nodes"]))) if doc["slots"] else []
    members = doc.get("members")
    if isinstance(members, list) and "world_size" in doc:
        doc["world_size"] = len(members)
        for rank, member in enumerate(members):
            if isinstance(member, dict):
                member["rank"] = rank
                member["replica_id"] = f"r{rank}-{member.get('slot', 0)}"
    for value in doc.values():
        _cohere(value)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path below ``node`` (except the ``type`` tag), containers and leaves."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else ()
    for key, value in items:
        if prefix == () and key == "type":
            continue
        yield (*prefix, key)
        if len(prefix) < 6:
            yield from _paths(value, (*prefix, key))


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(node, path[:-1])[path[-1]] = value


def decodes(payload: bytes, message_type: type[Message], subject: str) -> bool:
    """The oracle: whether a service must act on ``payload`` sent on ``subject`` rather
    than count it bad (a message about another job or node than its subject's is bad)."""
    try:
        decode(payload, message_type, subject=subject)
    except WireError:
        return False
    return True


# --- targets ---------------------------------------------------------------------------


class Via(enum.StrEnum):
    REQUEST = "request"  # a request: answered 400 when bad
    PUBLISH = "publish"  # a plain publish (stream subjects are stored first)
    KV = "kv"  # a value written into a bucket


@dataclasses.dataclass(frozen=True)
class Target:
    """One place phalanx listens, the type it carries, and the counters a bad input moves.

    ``address`` returns the subject (or ``bucket/key``) for one input; ``counters``
    the counters that must each count every bad input once (``exact``) or at least
    once (KV: a follower that starts over reads a value again).
    """

    name: str
    via: Via
    message_type: type[Message]
    address: Callable[[random.Random], str]
    counters: Callable[[Services], list[Counters]]
    exact: bool = True
    disruptive: bool = False  # corrupts leadership state: run after the others
    #: valid messages that do what they say (see the module docstring): not sent
    by_design: Callable[[Any, str], bool] = lambda _message, _address: False

    def subject(self, address: str) -> str:
        """The subject an input sent to ``address`` arrives on."""
        if self.via is Via.KV:
            return subjects.kv_subject(*address.split("/", 1))
        return address

    def sendable(self, payload: bytes, address: str) -> bool:
        try:
            message = decode(payload, self.message_type, subject=self.subject(address))
        except WireError:
            return True
        return not self.by_design(message, address)


def _stops_the_agent(request: ChaosRequest, _address: str) -> bool:
    return request.action is not ChaosAction.KILL_RANK


def _never_expires(lease: Lease, _address: str) -> bool:
    return lease.expires_at > time.time() + 60


def _takes_the_node(record: NodeRecord, address: str) -> bool:
    """Another live agent's record under the agent's key: the agent stops, as it must."""
    return address.endswith(f"/{World.node}") and record.node.agent_pid != os.getpid()


def targets(world: World) -> list[Target]:
    """Every subject and KV record the services listen on or read."""
    def job(rng: random.Random) -> str:
        return rng.choice(world.jobs)

    def node(rng: random.Random) -> str:
        return rng.choice(world.nodes)

    def fixed(address: str) -> Callable[[random.Random], str]:
        return lambda _rng: address

    adm_endpoint = {verb: (lambda s, verb=verb: [s.admission._counters[verb]])
                    for verb in ("submit", "cancel", "requeue", "explain", "scale")}
    agent_endpoint = {name: (lambda s, name=name: [s.agent._counters[name]])
                      for name in ("status", "chaos", "launch", "stop", "logs")}

    def bus_of(*names: str) -> Callable[[Services], list[Counters]]:
        return lambda s: [getattr(s, n).bus.counters for n in names]

    def kv_of(*attrs: str) -> Callable[[Services], list[Counters]]:
        return lambda s: [_attr(s, a).counters for a in attrs]

    out = [
        *(Target(f"admission.{verb}", Via.REQUEST, t, fixed(subjects.admission(verb)),
                 adm_endpoint[verb])
          for verb, t in (("submit", SubmitRequest), ("cancel", JobRequest),
                          ("requeue", RequeueRequest), ("explain", JobRequest),
                          ("scale", ScaleRequest))),
        *(Target(f"admission.leader.{verb}", Via.REQUEST, t,
                 fixed(subjects.admission_leader(verb)), bus_of("admission"))
          for verb, t in (("submit", SubmitRequest), ("cancel", JobRequest),
                          ("explain", JobRequest), ("scale", ScaleRequest))),
        Target("health.rank_progress", Via.PUBLISH, RankProgress,
               lambda rng: subjects.health_rank(job(rng), rng.randrange(4)), bus_of("health")),
        Target("health.heartbeat", Via.PUBLISH, NodeHeartbeat,
               lambda rng: subjects.node_heartbeat(node(rng)), bus_of("health")),
        Target("health.condition", Via.PUBLISH, NodeConditionChanged,
               lambda rng: subjects.node_condition(node(rng)), bus_of("health")),
        Target("job.started", Via.PUBLISH, RankStarted,
               lambda rng: subjects.rank_started(job(rng)), bus_of("health")),
        Target("job.exited", Via.PUBLISH, RankExited,
               lambda rng: subjects.rank_exited(job(rng)), bus_of("health", "elasticity")),
        Target("job.fault", Via.PUBLISH, Fault, lambda rng: subjects.job_fault(job(rng)),
               bus_of("elasticity")),
        Target("job.ready", Via.PUBLISH, ReplicaReady,
               lambda rng: subjects.replica_ready(job(rng)), bus_of("elasticity")),
        Target("job.applied", Via.PUBLISH, GenerationApplied,
               lambda rng: subjects.generation_applied(job(rng)), bus_of("elasticity")),
        Target("job.given_up", Via.PUBLISH, GenerationGivenUp,
               lambda rng: subjects.generation_given_up(job(rng)), bus_of("elasticity")),
        Target("job.state", Via.PUBLISH, JobRecord, lambda rng: subjects.job_state(job(rng)),
               bus_of("agent")),
        *(Target(f"agent.{name}", Via.REQUEST, t, fixed(build(world.node)),
                 agent_endpoint[name], by_design=_stops_the_agent if t is ChaosRequest
                 else Target.by_design)
          for name, t, build in (("status", NodeStatusRequest, subjects.agent_status),
                                 ("chaos", ChaosRequest, subjects.agent_chaos),
                                 ("launch", LaunchReplica, subjects.agent_launch),
                                 ("stop", StopReplica, subjects.agent_stop),
                                 ("logs", LogRequest, subjects.agent_logs))),
        Target("kv.jobs", Via.KV, JobRecord,
               lambda rng: f"{subjects.JOBS_BUCKET}/{job(rng)}",
               kv_of("admission.jobs", "health.jobs", "elasticity.jobs"), exact=False),
        Target("kv.nodes", Via.KV, NodeRecord,
               lambda rng: f"{subjects.NODES_BUCKET}/{node(rng)}", kv_of("admission.nodes"),
               exact=False, by_design=_takes_the_node),
        Target("kv.generations", Via.KV, Generation,
               lambda rng: f"{subjects.GENERATIONS_BUCKET}/{job(rng)}", lambda s: [],
               exact=False),
        Target("kv.health_snapshots", Via.KV, JobSnapshot,
               lambda rng: f"{subjects.HEALTH_BUCKET}/{job(rng)}", lambda s: [], exact=False,
               disruptive=True),
        Target("kv.elasticity_snapshots", Via.KV, JobSnapshot,
               lambda rng: f"{subjects.ELASTICITY_BUCKET}/{job(rng)}", lambda s: [],
               exact=False, disruptive=True),
        Target("kv.admission_placements", Via.KV, JobPlacement,
               lambda rng: f"{subjects.ADMISSION_BUCKET}/{job_key(job(rng))}", lambda s: [],
               exact=False, disruptive=True),
        Target("kv.admission_claims", Via.KV, NodeClaims,
               lambda rng: f"{subjects.ADMISSION_BUCKET}/{node_key(node(rng))}", lambda s: [],
               exact=False, disruptive=True),
        Target("kv.admission_lease", Via.KV, Lease,
               fixed(f"{subjects.ADMISSION_BUCKET}/{LEADER_KEY}"), lambda s: [], exact=False,
               disruptive=True, by_design=_never_expires),
        Target("kv.leases", Via.KV, Lease,
               lambda rng: f"{subjects.LEASES_BUCKET}/{rng.choice(['health', 'elasticity'])}",
               lambda s: [], exact=False, disruptive=True, by_design=_never_expires),
        Target("kv.cursors", Via.KV, StreamCursor,
               lambda rng: f"{subjects.CURSORS_BUCKET}/{rng.choice(['health', 'elasticity'])}",
               lambda s: [], exact=False, disruptive=True),
    ]
    # Stable sort: what ends jobs (admission, job states, job records) after what acts on
    # the running job, and leadership state last.
    return sorted(out, key=lambda t: (t.disruptive, t.name.startswith(("admission", "job.state",
                                                                       "kv."))))


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# --- the services under fire -----------------------------------------------------------


@dataclasses.dataclass
class Services:
    admission: AdmissionService
    health: HealthService
    elasticity: ElasticityService
    agent: AgentService

    def all(self) -> list[Service]:
        return [self.admission, self.health, self.elasticity, self.agent]


class ErrorLog(logging.Handler):
    """Keeps every exception a service logged (at ERROR or above). Errors logged without
    one ("unreadable health state skipped") are services reporting bad input they handled."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)

    def summary(self) -> list[str]:
        def named(exc: BaseException) -> str:
            inner = [named(e) for e in exc.exceptions] \
                if isinstance(exc, BaseExceptionGroup) else []  # what a TaskGroup raised
            return f"{type(exc).__name__}: {exc}" + (f" [{'; '.join(inner)}]" if inner else "")

        def line(r: logging.LogRecord) -> str:
            cause = f": {named(r.exc_info[1])}" if r.exc_info and r.exc_info[1] else ""
            return f"{r.name}: {r.getMessage()}{cause}"[:400]
        return [f"{n} x {text}" for text, n in Tally(map(line, self.records)).most_common()]


@dataclasses.dataclass
class TargetResult:
    inputs: int = 0
    bad: int = 0
    skipped: int = 0  # valid but destructive by design (see Target.sendable)
    counted: dict[str, int] = dataclasses.field(default_factory=dict)
    replies: dict[str, int] = dataclasses.field(default_factory=dict)
    findings: list[str] = dataclasses.field(default_factory=list)


class Barrage:
    """Runs the services in this process on ``nats_url`` and fires every target at them.

    Use as an async context manager; :meth:`fire` runs the targets, :meth:`still_works`
    proves the services still do their jobs afterwards.
    """

    def __init__(self, nats_url: str, work_dir: Path, *, seed: int, per_target: int,
                 world: World | None = None, settle_s: float = 30.0) -> None:
        self.config = BusConfig.load(env={}, servers=[nats_url], connect_timeout_s=5.0)
        self.work_dir = work_dir
        self.seed = seed
        self.per_target = per_target
        self.world = world or World()
        self.settle_s = settle_s
        self.errors = ErrorLog()
        self.results: dict[str, TargetResult] = {}
        self.services: Services | None = None
        self.bus: Bus | None = None
        self._level = logging.NOTSET

    async def __aenter__(self) -> Barrage:
        # Every bad input is logged at WARNING by design; only ERRORs are findings.
        logger = logging.getLogger("phalanx")
        self._level = logger.level
        logger.setLevel(logging.ERROR)
        logger.addHandler(self.errors)
        world = self.world
        self.bus = await Bus.connect(self.config, name="fuzzer")
        agent = AgentService(AgentConfig(node_id=world.node, slots=4, failure_domain="fz",
                                         heartbeat_interval_s=0.2, lost_after_s=3.0,
                                         shutdown_timeout_s=2.0, replacement_nice=0,
                                         work_dir=str(self.work_dir / "agent")), self.config)
        self.services = Services(
            admission=AdmissionService(AdmissionConfig(lease_s=1.5), self.config,
                                       instance="fz-adm"),
            health=HealthService(HealthPolicy(), self.config, instance="fz-health", lease_s=1.5),
            elasticity=ElasticityService(lambda: ElasticityCore(wait_timeout_s=60.0),
                                         self.config, instance="fz-elasticity", lease_s=1.5),
            agent=agent)
        for service in self.services.all():
            await service.start()
        await self.wait_leading()
        await self.submit(world.real_job, replicas=2, command=["sleep", "600"])
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.services is not None:
                for service in reversed(self.services.all()):
                    await service.stop()
            if self.bus is not None:
                await self.bus.close()
        finally:
            logger = logging.getLogger("phalanx")
            logger.removeHandler(self.errors)
            logger.setLevel(self._level)

    # --- firing -------------------------------------------------------------------------

    async def fire(self, only: list[str] | None = None) -> dict[str, TargetResult]:
        """Send ``per_target`` inputs to every target (or those named in ``only``)."""
        for target in targets(self.world):
            if only is None or target.name in only:
                self.results[target.name] = await self._fire(target)
        return self.results

    async def _fire(self, target: Target) -> TargetResult:
        assert self.services is not None and self.bus is not None
        rng = random.Random(f"{self.seed}:{target.name}")
        fuzzer = Fuzzer(rng, self.world)
        result = TargetResult()
        watched = target.counters(self.services)
        before = [c.bad_messages for c in watched]
        pending: set[asyncio.Task[None]] = set()
        unpaced = 0  # bytes published since the services last caught up
        for item in fuzzer.inputs(target.message_type, self.per_target):
            address = self._aim(target, item.payload, rng)
            if not target.sendable(item.payload, address):
                result.skipped += 1
                continue
            bad = not decodes(item.payload, target.message_type, target.subject(address))
            result.inputs += 1
            result.bad += bad
            if target.via is Via.REQUEST:
                if len(pending) >= 16:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                pending.add(asyncio.create_task(self._request(address, item, bad, result)))
            elif target.via is Via.PUBLISH:
                await self.bus.nc.publish(address, item.payload)
                unpaced += len(item.payload) + 256
                if unpaced > PACE_BYTES:  # else the server cuts off a slow consumer
                    unpaced = 0
                    await self._sent()
                    await self._caught_up(watched, before, result.bad)
            else:
                bucket, key = address.split("/", 1)
                # Patient: on a loaded machine the server may ack a write after the default
                # 5 s, and a put retried after a timeout could land twice and be counted so.
                kv = await self.bus.nc.jetstream(timeout=KV_ACK_TIMEOUT_S).key_value(bucket)
                await kv.put(key, item.payload)
                if bad:  # read before the next write: a follower may see only a key's latest
                    await self._caught_up(watched, before, result.bad, poll_s=0.002)
        if pending:
            await asyncio.wait(pending)
        await self._sent()
        await self._settle(target, watched, before, result)
        return result

    def _aim(self, target: Target, payload: bytes, rng: random.Random) -> str:
        """Where to send ``payload``: for a publish or a KV write, mostly to the job or
        node it names when that is one of the world's (a message about another job than
        its subject's is refused at decode and tests nothing else); else anywhere."""
        address = target.address(rng)
        owner = subjects.owner(target.subject(address))
        if target.via is Via.REQUEST or owner is None or rng.random() < 0.2:
            return address
        kind, current = owner
        try:
            named = names(decode(payload, target.message_type), kind)
        except WireError:
            return address
        if named == current or named not in (self.world.jobs if kind == "job"
                                             else self.world.nodes):
            return address
        if target.via is Via.KV:
            return f"{address.split('/', 1)[0]}/{named}"
        tokens = address.split(".")
        tokens[tokens.index(current, 2)] = named
        return ".".join(tokens)

    async def _sent(self) -> None:
        """Until the server has everything published so far (patient, as a loaded
        machine needs)."""
        assert self.bus is not None
        if not await self.bus.round_trip(KV_ACK_TIMEOUT_S):
            raise TimeoutError(f"the server did not answer a PING in {KV_ACK_TIMEOUT_S:g} s")

    async def _request(self, subject: str, item: Input, bad: bool, result: TargetResult) -> None:
        assert self.bus is not None
        try:
            reply = await self.bus.nc.request(subject, item.payload, timeout=10.0)
        except Exception as exc:  # no reply at all: the worst answer a request can get
            code = f"no reply ({type(exc).__name__})"
        else:
            code = (reply.headers or {}).get(ERROR_CODE_HEADER, "ok")
        result.replies[code] = result.replies.get(code, 0) + 1
        if bad and code != "400":
            result.findings.append(f"bad {item.how} input answered {code}: {item.payload[:80]!r}")
        elif (not bad and code in ("500",)) or code.startswith("no reply"):
            result.findings.append(f"{item.how} input answered {code}: {item.payload[:120]!r}")

    async def _caught_up(self, watched: list[Counters], before: list[int], bad: int,
                         poll_s: float = 0.02) -> None:
        """Until every watched counter counted ``bad`` inputs (or ``settle_s`` passed): a
        subscriber handles in order, so by then it has handled what came before them."""
        deadline = time.monotonic() + self.settle_s
        while any(c.bad_messages - b < bad for c, b in zip(watched, before, strict=True)):
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(poll_s)  # counters move in other tasks; nothing to await on

    async def _settle(self, target: Target, watched: list[Counters], before: list[int],
                      result: TargetResult) -> None:
        """Wait until every watched counter counted every bad input, then check exactness."""
        await self._caught_up(watched, before, result.bad)
        if target.exact:
            await asyncio.sleep(0.2)  # anything counted twice would show by now
        for i, (counter, start) in enumerate(zip(watched, before, strict=True)):
            counted = counter.bad_messages - start
            result.counted[str(i)] = counted
            if counted < result.bad or (target.exact and counted != result.bad):
                result.findings.append(f"counter {i} counted {counted} of {result.bad} bad "
                                       "inputs")

    # --- proof of life ------------------------------------------------------------------

    async def wait_leading(self, timeout_s: float = 30.0) -> None:
        """Until admission, health and elasticity each lead (they are the only instances).

        Raises:
            TimeoutError: one of them still does not lead; names which.
        """
        assert self.services is not None
        s = self.services
        deadline = time.monotonic() + timeout_s
        while True:
            lagging = [name for name, leads in (
                ("admission", s.admission.term is not None and s.admission.term.serving),
                ("health", s.health.term is not None and s.health.term.reader is not None),
                ("elasticity", s.elasticity.term is not None
                 and s.elasticity.term.reader is not None)) if not leads]
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{lagging} not leading {timeout_s:g} s after the barrage")
            await asyncio.sleep(0.1)

    async def submit(self, job_id: str, *, replicas: int, command: list[str],
                     timeout_s: float = 30.0) -> JobRecord:
        """Submit a valid job and wait until its record says admitted."""
        assert self.bus is not None
        admitted = asyncio.get_running_loop().create_future()

        async def on_state(record: JobRecord, _: object) -> None:
            if record.state is JobState.ADMITTED and not admitted.done():
                admitted.set_result(record)

        sub = await self.bus.subscribe(subjects.job_state(job_id), JobRecord, on_state)
        try:
            spec = JobSpec(name=job_id, team="default", priority_class="normal",
                           replicas=ReplicaRange(min=replicas, max=replicas), command=command)
            await self._admission(SubmitRequest(job_id=job_id, spec=spec), timeout_s)
            try:
                return await asyncio.wait_for(admitted, timeout_s)
            except TimeoutError:
                why = await self.bus.request(subjects.admission_explain(),
                                             JobRequest(job_id=job_id), Explanation)
                raise TimeoutError(f"{job_id} not admitted within {timeout_s:g} s: "
                                   f"{why.state} ({why.reason})") from None
        finally:
            await sub.unsubscribe()

    async def _admission(self, request: SubmitRequest | JobRequest, timeout_s: float) -> None:
        """Submit or cancel, retrying while admission elects a leader (503/504), as the
        CLI does: leadership state was fuzzed too."""
        assert self.bus is not None
        subject = subjects.admission_submit() if isinstance(request, SubmitRequest) \
            else subjects.admission_cancel()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.bus.request(subject, request, JobRecord, timeout_s=10.0)
                return
            except RemoteError as exc:
                if exc.code not in ("503", "504") or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)

    async def still_works(self, probe_job: str) -> dict[str, Any]:
        """After the barrage: every service runs, leads, answers ``$SRV.PING``, a node
        heartbeat still lands in the registry, and a new valid job is admitted.

        Raises:
            AssertionError / TimeoutError: naming what no longer works.
        """
        assert self.services is not None and self.bus is not None
        stopped = [s.name for s in self.services.all() if s.stopping]
        assert not stopped, f"services stopped during the barrage: {stopped}"
        await self.wait_leading()
        for service in self.services.all():
            reply = await self.bus.nc.request(f"$SRV.PING.{service.name}", b"", timeout=5.0)
            assert json.loads(reply.data)["name"] == service.name
        nodes = await TypedKV.open(self.bus.js, subjects.NODES_BUCKET, NodeRecord)
        first, _ = await nodes.current(self.world.node)
        beat = await self._heartbeat_after(first.heartbeat_seq if first else -1)
        await self._cancel_all()
        await self._uncordon(nodes)
        # The barrage registered valid records for a node no agent runs ("fz-ghost"):
        # until its heartbeats are heard to stop it is a node like any other, and the
        # probe could be placed there. Forget it as an operator would.
        for ghost in self.world.nodes:
            if ghost != self.world.node:
                await nodes.kv.purge(ghost)
        record = await self.submit(probe_job, replicas=1, command=["sleep", "30"])
        return {"probe_job": record.job_id, "probe_nodes": list(record.nodes),
                "heartbeat_seq": beat}

    async def _heartbeat_after(self, seq: int, timeout_s: float = 10.0) -> int:
        """Wait for a registry entry of this node newer than ``seq``; returns its sequence."""
        assert self.bus is not None
        nodes = await TypedKV.open(self.bus.js, subjects.NODES_BUCKET, NodeRecord)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record, _ = await nodes.current(self.world.node)
            if record is not None and record.heartbeat_seq != seq:
                return record.heartbeat_seq
            await asyncio.sleep(0.1)
        raise TimeoutError(f"no heartbeat of {self.world.node} registered within {timeout_s:g} s")

    async def _uncordon(self, nodes: TypedKV[NodeRecord]) -> None:
        """Uncordon the agent's node as an operator would (``phalanx node uncordon``): the
        barrage's jobs crash, and health cordons a node whose ranks keep crashing."""
        assert self.bus is not None
        node = self.world.node
        def uncordoned(record: NodeRecord | None) -> NodeRecord:
            assert record is not None, f"{node} left the registry"
            return msgspec.structs.replace(record, cordoned=False)

        await nodes.modify(node, uncordoned)
        await self.bus.publish(subjects.node_condition(node), NodeConditionChanged(
            node_id=node, condition=NodeCondition.UNCORDONED, reason="fuzz", at=time.time()))

    async def _cancel_all(self) -> None:
        """Cancel every job the barrage left, so the probe job finds room."""
        assert self.bus is not None
        jobs = await TypedKV.open(self.bus.js, subjects.JOBS_BUCKET, JobRecord)
        entries, _ = await jobs.entries()
        for entry in entries:
            if not entry.value.state.terminal:
                try:
                    await self._admission(JobRequest(job_id=entry.key), timeout_s=30.0)
                except RemoteError as exc:
                    if exc.code != "404":
                        raise

    def report(self) -> dict[str, Any]:
        """Per target: inputs, bad inputs, what counted them, reply codes, findings."""
        return {
            "seed": self.seed,
            "targets": {name: dataclasses.asdict(r) for name, r in self.results.items()},
            "errors_logged": self.errors.summary(),
            "findings": sum(len(r.findings) for r in self.results.values()),
        }
