"""The wire codec: every message round-trips, every bad payload is one WireError.

Each rejection test checks that the error names the subject it was given, the
message type that was expected, and the problem (field path / numbers).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from phalanx.bus import spill
from phalanx.schemas import subjects
from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, decode, encode
from phalanx.schemas.errors import PhalanxError, WireError
from phalanx.schemas.messages import (
    ALL_MESSAGES,
    MAX_INT,
    MAX_SPILLED_BYTES,
    BuddyPlacement,
    BuddyReason,
    CatalogStep,
    ChaosAction,
    ChaosReply,
    ChaosRequest,
    CheckpointCatalog,
    ExitCause,
    Explanation,
    Fault,
    FaultKind,
    Generation,
    GenerationApplied,
    GenerationGivenUp,
    GenerationReason,
    GenerationRecord,
    JobHistory,
    JobPlacement,
    JobProgress,
    JobRecord,
    JobRequest,
    JobSnapshot,
    JobSpec,
    JobState,
    LaunchReplica,
    Lease,
    LogReply,
    LogRequest,
    Member,
    Message,
    NodeClaims,
    NodeCondition,
    NodeConditionChanged,
    NodeHeartbeat,
    NodeInfo,
    NodeRecord,
    NodeStatusRequest,
    Placement,
    RankExited,
    RankProgress,
    RankStarted,
    ReasonCode,
    ReplicaFetch,
    ReplicaFetched,
    ReplicaLog,
    ReplicaRange,
    ReplicaReady,
    ReplicaReply,
    RequeueRequest,
    ResumeAnswer,
    ResumeRequest,
    ScaleRequest,
    ScalingEvent,
    ScalingEventKind,
    ShardCopy,
    SnapshotRecord,
    SnapshotReservation,
    SnapshotReserve,
    SnapshotTier,
    Spilled,
    StopReplica,
    StreamCursor,
    SubmitRequest,
)

SUBJECT = "phalanx.node.gpu-node-07.heartbeat"

INFO = NodeInfo(
    node_id="gpu-node-07", host="gpu-node-07.rack3.example", slots=8, failure_domain="rack-3",
    labels={"gpu": "a100", "zone": "eu-west-1b"}, agent_pid=41235, agent_version="0.1.0",
    started_at=1_717_000_000.25,
)

_SPEC = JobSpec(name="llama-ft", team="nlp", priority_class="high",
                replicas=ReplicaRange(min=2, max=2), command=["python", "train.py"])

#: One realistic instance of every top-level message type.
EXAMPLES: dict[type[Message], Message] = {
    NodeRecord: NodeRecord(node=INFO, heartbeat_seq=42, heartbeat_at=1_717_000_021.5,
                           slots_used=6, cordoned=True),
    NodeHeartbeat: NodeHeartbeat(node_id="gpu-node-07", seq=42, sent_at=1_717_000_021.5,
                                 slots_used=6),
    NodeStatusRequest: NodeStatusRequest(),
    JobSpec: JobSpec(
        name="llama-ft", team="nlp", priority_class="high", replicas=ReplicaRange(min=2, max=8),
        command=["python", "train.py", "--lr", "3e-4"], slots_per_replica=4,
        placement=Placement(node_labels={"gpu": "a100"}, spread_failure_domains=True),
        env={"NCCL_DEBUG": "WARN"}, schedule_timeout_s=600.0, grace_period_s=30.0,
        hang_timeout_s=5.0,
    ),
    Generation: Generation(
        job_id="llama-ft", generation=3,
        members=[Member(replica_id="r0-0", rank=0, node_id="gpu-node-07",
                        endpoint="10.0.0.7:41234"),
                 Member(replica_id="r1-0", rank=1, node_id="gpu-node-03",
                        endpoint="10.0.0.3:40111"),
                 Member(replica_id="r3-1", rank=2, node_id="gpu-node-11",
                        endpoint="gpu-node-11:39001")],
        world_size=3, rendezvous="llama-ft-g3", resume_step=1200,
        reason=GenerationReason.FAULT, cause="node gpu-node-02 lost",
    ),
    ReplicaReady: ReplicaReady(job_id="llama-ft", replica_id="r3-1", slot=3,
                               node_id="gpu-node-11", endpoint="gpu-node-11:39001",
                               sent_at=1_717_000_040.0),
    GenerationApplied: GenerationApplied(job_id="llama-ft", generation=3, replica_id="r1-0",
                                         committed_step=1200, resume_step=1200, rebuild_s=0.021,
                                         state_copy_s=0.35, state_bytes=201_326_592,
                                         pause_s=0.28),
    GenerationGivenUp: GenerationGivenUp(
        job_id="llama-ft", generation=4, replica_id="r1-0", sent_at=1_717_000_042.0,
        reason="rendezvous of generation 4: timed out connecting to 10.0.0.7:41234"),
    JobHistory: JobHistory(job_id="llama-ft", replacements=1, updated_at=1_717_000_041.0,
                           generations=[GenerationRecord(
                               generation=3, reason=GenerationReason.FAULT, world_size=7,
                               members=["r0-0", "r1-0", "r2-0", "r4-0", "r5-0", "r6-0", "r7-0"],
                               resume_step=1200, decided_at=1_717_000_030.1,
                               cause="dropped r3-0 (crash: killed by signal SIGKILL)",
                               pause_s=0.28)]),
    LaunchReplica: LaunchReplica(job_id="llama-ft", slot=3, replica_id="r3-1"),
    StopReplica: StopReplica(job_id="llama-ft", slot=3, replica_id="r3-1"),
    ReplicaReply: ReplicaReply(node_id="gpu-node-11", replica_id="r3-1", pid=4343,
                             detail="started r3-1 in slot 3 (stopped r3-0 first)"),
    Fault: Fault(fault_id="f-0001", job_id="llama-ft", kind=FaultKind.CRASH,
                 node_id="gpu-node-02", detected_at=1_717_000_030.0, rank=5, exit_code=-9,
                 signal="SIGKILL", detail="killed by the OOM killer"),
    RankProgress: RankProgress(job_id="llama-ft", rank=2, replica_id="r3", generation=3,
                               step=1201, step_time_s=0.412, sent_at=1_717_000_031.0,
                               total_steps=5000),
    JobProgress: JobProgress(job_id="llama-ft", step=1201, total_steps=5000, steps_per_s=2.4,
                             window_s=30.0, restarts=1, updated_at=1_717_000_031.0),
    SnapshotRecord: SnapshotRecord(job_id="llama-ft", step=1200, shard=3, num_shards=8,
                                   node_id="gpu-node-03", tier=SnapshotTier.BUDDY,
                                   nbytes=1 << 30, checksum="9f86d081884c7d65",
                                   created_at=1_717_000_029.0),
    JobRecord: JobRecord(job_id="llama-ft-1a2b3c", spec=_SPEC, state=JobState.ADMITTED,
                         submitted_at=1_717_000_000.0, updated_at=1_717_000_001.0,
                         reason_code=ReasonCode.ADMITTED, reason="running 2 replica(s)",
                         nodes=["gpu-node-07", "gpu-node-03"], slots=[0, 4], next_slot=5),
    SubmitRequest: SubmitRequest(job_id="llama-ft-1a2b3c", spec=_SPEC),
    JobRequest: JobRequest(job_id="llama-ft-1a2b3c"),
    RequeueRequest: RequeueRequest(job_id="llama-ft-1a2b3c",
                                   reason="below its minimum of 2 members for more than 60 s"),
    ScaleRequest: ScaleRequest(job_id="llama-ft-1a2b3c", replicas=2),
    ScalingEvent: ScalingEvent(job_id="llama-ft-1a2b3c", kind=ScalingEventKind.SHRINK,
                               from_replicas=4, to_replicas=2,
                               reason="preempted for urgent-1 (priority high, team t)",
                               at=1_717_000_000.5, deadline=1_717_000_600.5),
    Explanation: Explanation(job_id="llama-ft-1a2b3c", state=JobState.PENDING,
                             reason_code=ReasonCode.RESERVED, reason="needs 8 slots",
                             position=2, queue_length=7),
    JobPlacement: JobPlacement(team="nlp", slots_per_replica=4,
                               nodes=["gpu-node-07", "gpu-node-03"], updated_at=1_717_000_001.0),
    NodeClaims: NodeClaims(claims={"llama-ft-1a2b3c": 4, "bert-eval-9f8e": 2},
                           updated_at=1_717_000_001.0),
    Lease: Lease(holder="host-123-abc", epoch=4, expires_at=1_717_000_004.0),
    StreamCursor: StreamCursor(seq=1234, updated_at=1_717_000_005.0),
    JobSnapshot: JobSnapshot(job_id="llama-ft-1a2b3c", seq=1234, format=1,
                             state=b"\x81\xa6job_id\xafllama-ft-1a2b3c"),
    Spilled: Spilled(bucket="phalanx_generations", key="llama-ft-1a2b3c",
                     of="phalanx.generation.v1", digest="ab" * 32, size=1_207_857, chunks=2),
    RankStarted: RankStarted(job_id="llama-ft-1a2b3c", rank=1, world_size=2,
                             node_id="gpu-node-03", pid=4242, started_at=1_717_000_002.0),
    RankExited: RankExited(job_id="llama-ft-1a2b3c", rank=1, node_id="gpu-node-03", pid=4242,
                           cause=ExitCause.EXITED, exited_at=1_717_000_009.0, signal="SIGKILL"),
    ChaosRequest: ChaosRequest(action=ChaosAction.KILL_RANK, job_id="llama-ft-1a2b3c", rank=1,
                               signal="STOP"),
    ChaosReply: ChaosReply(node_id="gpu-node-03", detail="sent SIGSTOP to rank 1", pid=4242),
    LogRequest: LogRequest(job_id="llama-ft-1a2b3c", replica_id="r1-0", offset=4096),
    LogReply: LogReply(node_id="gpu-node-03", logs=[ReplicaLog(replica_id="r1-0", size=9000)],
                       offset=4096, data=b"step 41 loss 2.31\n", size=9000),
    SnapshotReserve: SnapshotReserve(job_id="llama-ft", replica_id="r3-0", shard=3, shards=8,
                                     nbytes=1 << 30, buffers=3),
    SnapshotReservation: SnapshotReservation(
        node_id="gpu-node-03",
        paths=["/dev/shm/phalanx-llama-ft-s3-0", "/dev/shm/phalanx-llama-ft-s3-1"]),
    CheckpointCatalog: CheckpointCatalog(job_id="llama-ft", keep=2, durable_keep=3, steps=[
        CatalogStep(step=1200, shards=2, total_bytes=2048, copies=[
            ShardCopy(shard=0, node_id="gpu-node-03", tier=SnapshotTier.LOCAL, nbytes=1024,
                      checksum="9f86d081884c7d65", generation=3),
            ShardCopy(shard=0, node_id="gpu-node-03", tier=SnapshotTier.DURABLE,
                      nbytes=1100, checksum="1b2c3d4e5f607182", generation=3,
                      location="s3://ckpt/llama-ft/step-0000001200-g3-w2"),
            ShardCopy(shard=1, node_id="gpu-node-07", tier=SnapshotTier.LOCAL, nbytes=1024,
                      checksum="60303ae22b998861", generation=3, corrupt=True)])]),
    BuddyPlacement: BuddyPlacement(node_id="gpu-node-03", failure_domain="rack-a",
                                   buddy_id="gpu-node-07", buddy_domain="rack-b",
                                   reason=BuddyReason.BUDDY_LOST, placed_at=1_717_000_030.0),
    ResumeRequest: ResumeRequest(job_id="llama-ft", world_size=8,
                                 at_nodes=["gpu-node-03", "gpu-node-05"], memory_only=True),
    ResumeAnswer: ResumeAnswer(job_id="llama-ft", step=1200, shards=1, sources=[
        ShardCopy(shard=0, node_id="gpu-node-03", tier=SnapshotTier.LOCAL, nbytes=1024,
                  checksum="9f86d081884c7d65")], held_by=[["gpu-node-03", "gpu-node-07"]]),
    ReplicaFetch: ReplicaFetch(job_id="llama-ft", step=1200, shard=1, shards=4,
                               to_node="gpu-node-05"),
    ReplicaFetched: ReplicaFetched(node_id="gpu-node-07", nbytes=1 << 30, seconds=0.41),
    NodeConditionChanged: NodeConditionChanged(node_id="gpu-node-02",
                                               condition=NodeCondition.LOST,
                                               reason="no heartbeat for 3.1 s",
                                               at=1_717_000_010.0),
}


def pack(obj: Any) -> bytes:
    """Raw MessagePack, bypassing the codec's own checks."""
    return msgspec.msgpack.encode(obj)


def as_map(message: Message, **changes: Any) -> dict[str, Any]:
    """The wire map of ``message`` (with its ``type``), with top-level ``changes``."""
    data = msgspec.to_builtins(message)
    data.update(changes)
    return data


def rejected(data: bytes, expected: type[Message], *fragments: str,
             subject: str = SUBJECT) -> WireError:
    """Decode ``data``, assert a WireError naming subject, type and every fragment."""
    with pytest.raises(WireError) as excinfo:
        decode(data, expected, subject=subject)
    err = excinfo.value
    text = str(err)
    assert err.subject == subject
    assert err.message_type == expected.wire_name()
    assert err.problem and err.problem in text
    if subject:
        assert repr(subject) in text
    assert expected.wire_name() in text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    return err


# --- round trips ---------------------------------------------------------------------------


def test_examples_cover_every_message_type() -> None:
    assert set(EXAMPLES) == set(ALL_MESSAGES)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_round_trip(cls: type[Message]) -> None:
    message = EXAMPLES[cls]
    data = encode(message)
    assert isinstance(data, bytes)
    back = decode(data, cls, subject="")
    assert type(back) is cls
    assert back == message
    assert encode(back) == data


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_payload_is_a_map_tagged_with_the_versioned_wire_name(cls: type[Message]) -> None:
    raw = msgspec.msgpack.decode(encode(EXAMPLES[cls]))
    assert isinstance(raw, dict)
    assert raw["type"] == cls.wire_name()
    assert cls.wire_name().startswith("phalanx.")
    assert cls.wire_name().endswith(".v1")


def test_wire_names_are_unique() -> None:
    names = [cls.wire_name() for cls in ALL_MESSAGES]
    assert len(set(names)) == len(names)


def test_defaults_may_be_omitted_on_the_wire() -> None:
    data = pack({"type": NodeHeartbeat.wire_name(), "node_id": "n1", "seq": 0, "sent_at": 0.0})
    assert decode(data, NodeHeartbeat) == NodeHeartbeat(node_id="n1", seq=0, sent_at=0.0)


def test_enums_decode_to_enum_members() -> None:
    back = decode(encode(EXAMPLES[Fault]), Fault)
    assert back.kind is FaultKind.CRASH
    back = decode(encode(EXAMPLES[Generation]), Generation)
    assert back.reason is GenerationReason.FAULT


def test_payload_of_exactly_the_limit_round_trips_and_one_byte_more_is_refused() -> None:
    def spec(n: int) -> JobSpec:
        return JobSpec(name="big", team="t", priority_class="p",
                       replicas=ReplicaRange(min=1, max=1), command=["x" * n])

    probe = 100_000
    overhead = len(encode(spec(probe))) - probe
    exact = spec(MAX_PAYLOAD_BYTES - overhead)
    data = encode(exact)
    assert len(data) == MAX_PAYLOAD_BYTES
    assert decode(data, JobSpec) == exact

    with pytest.raises(WireError) as excinfo:
        encode(spec(MAX_PAYLOAD_BYTES - overhead + 1))
    err = excinfo.value
    assert err.message_type == JobSpec.wire_name()
    assert f"{MAX_PAYLOAD_BYTES + 1} B" in str(err)
    assert f"{MAX_PAYLOAD_BYTES} B limit" in str(err)


# --- the error type ------------------------------------------------------------------------


def test_wire_error_is_a_value_error_and_a_phalanx_error() -> None:
    err = rejected(b"", NodeHeartbeat)
    assert isinstance(err, ValueError)
    assert isinstance(err, PhalanxError)


def test_wire_error_without_subject_does_not_invent_one() -> None:
    err = rejected(b"", NodeHeartbeat, subject="")
    assert str(err) == "cannot decode payload as phalanx.node_heartbeat.v1: empty payload"


# --- garbage -------------------------------------------------------------------------------


def test_empty_payload() -> None:
    err = rejected(b"", NodeHeartbeat, "empty payload")
    assert err.problem == "empty payload"


def test_oversized_payload_is_refused_before_parsing() -> None:
    # Valid MessagePack of a valid message, just too big: the size check must win.
    big = EXAMPLES[JobSpec]
    data = pack(as_map(big, command=["x" * MAX_PAYLOAD_BYTES]))
    assert len(data) > MAX_PAYLOAD_BYTES
    rejected(data, JobSpec, f"payload of {len(data)} B", f"{MAX_PAYLOAD_BYTES} B limit")


def test_a_larger_limit_takes_a_value_put_together_from_chunks() -> None:
    """A value stored in chunks (phalanx.bus.spill) is encoded and decoded past one
    payload, up to the limit its caller gives, and refused past that, naming it."""
    big = msgspec.structs.replace(EXAMPLES[JobSpec], command=["x" * MAX_PAYLOAD_BYTES])
    with pytest.raises(WireError, match=f"{MAX_PAYLOAD_BYTES} B limit"):
        encode(big)
    data = encode(big, limit=MAX_SPILLED_BYTES)
    assert decode(data, JobSpec, limit=MAX_SPILLED_BYTES) == big
    with pytest.raises(WireError, match=f"exceeds the {len(data) - 1} B limit"):
        decode(data, JobSpec, limit=len(data) - 1)


def test_a_pointer_is_told_from_a_value_and_a_bad_one_refused() -> None:
    pointer = EXAMPLES[Spilled]
    assert spill.pointer(encode(pointer)) == pointer
    assert spill.pointer(encode(EXAMPLES[JobSnapshot])) is None
    assert spill.pointer(b"") is None
    bad = pack(as_map(pointer, digest="not-hex"))
    with pytest.raises(WireError, match="digest"):
        spill.pointer(bad)


def test_oversized_garbage_is_refused_by_size() -> None:
    data = b"\xc1" * (MAX_PAYLOAD_BYTES + 1)
    rejected(data, NodeHeartbeat, f"payload of {MAX_PAYLOAD_BYTES + 1} B exceeds")


@pytest.mark.parametrize(
    ("data", "fragment"),
    [(b"\xc1", "malformed"), (b"\x82\xa4type", "truncated"), (b"\xd9", "truncated"),
     (b"\x81\xa1x\xc1", "malformed")],
    ids=["never-used-opcode", "truncated-map", "truncated-str8", "bad-opcode-in-value"],
)
def test_not_messagepack(data: bytes, fragment: str) -> None:
    rejected(data, NodeHeartbeat, "not MessagePack", fragment)


def test_truncated_valid_payload() -> None:
    data = encode(EXAMPLES[NodeHeartbeat])
    rejected(data[:-1], NodeHeartbeat, "truncated")


def test_trailing_bytes_after_a_valid_payload() -> None:
    data = encode(EXAMPLES[NodeHeartbeat]) + b"\x00"
    rejected(data, NodeHeartbeat, "trailing")


def test_json_is_not_accepted() -> None:
    data = msgspec.json.encode(EXAMPLES[NodeHeartbeat])
    rejected(data, NodeHeartbeat)


@pytest.mark.parametrize("value", [[1, 2], "text", 7, None, 1.5, True],
                         ids=["array", "str", "int", "nil", "float", "bool"])
def test_top_level_must_be_a_map(value: Any) -> None:
    rejected(pack(value), NodeHeartbeat, "Expected `object`")


def test_different_message_type_names_both() -> None:
    err = rejected(encode(EXAMPLES[Fault]), NodeHeartbeat, "phalanx.fault.v1")
    assert "phalanx.node_heartbeat.v1" in str(err)
    assert "got a phalanx.fault.v1 message" in err.problem


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_every_other_message_type_is_refused(cls: type[Message]) -> None:
    data = encode(EXAMPLES[cls])
    for other in ALL_MESSAGES:
        if other is cls:
            continue
        rejected(data, other, cls.wire_name())


def test_missing_type_field() -> None:
    data = pack({k: v for k, v in as_map(EXAMPLES[NodeHeartbeat]).items() if k != "type"})
    rejected(data, NodeHeartbeat, "missing required field `type`")


def test_type_field_of_the_wrong_type() -> None:
    rejected(pack(as_map(EXAMPLES[NodeHeartbeat], type=3)), NodeHeartbeat, "$.type")


def test_unknown_message_type_is_refused_and_named() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], type="phalanx.bogus.v1"))
    rejected(data, NodeHeartbeat, "phalanx.bogus.v1")


def test_unsupported_version_is_refused_and_named() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], type="phalanx.node_heartbeat.v2"))
    rejected(data, NodeHeartbeat, "phalanx.node_heartbeat.v2")




def test_unsupported_version_message_says_so() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], type="phalanx.node_heartbeat.v2"))
    rejected(data, NodeHeartbeat, "unsupported schema version v2",
             "this build speaks phalanx.node_heartbeat.v1")


def test_unknown_message_type_message_says_so() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], type="phalanx.bogus.v1"))
    rejected(data, NodeHeartbeat, "unknown message type 'phalanx.bogus.v1'")


def test_valid_messagepack_with_a_bad_field_is_not_called_not_messagepack() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], seq="1"))
    err = rejected(data, NodeHeartbeat, "$.seq")
    assert "not MessagePack" not in str(err)


# --- field validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "fragments"),
    [
        ("seq", "1", ("Expected `int`, got `str`", "$.seq")),
        ("seq", 1.5, ("Expected `int`, got `float`", "$.seq")),
        ("sent_at", "now", ("Expected `float`, got `str`", "$.sent_at")),
        ("node_id", 7, ("Expected `str`, got `int`", "$.node_id")),
        ("slots_used", None, ("Expected `int`, got `None`", "$.slots_used")),
    ],
)
def test_wrong_field_types(field: str, value: Any, fragments: tuple[str, ...]) -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], **{field: value}))
    rejected(data, NodeHeartbeat, *fragments)


@pytest.mark.parametrize(
    ("field", "value", "fragments"),
    [
        ("seq", -1, (">= 0", "$.seq")),
        ("sent_at", -0.5, (">= 0.0", "$.sent_at")),
        ("sent_at", float("nan"), ("$.sent_at",)),
        ("slots_used", -3, (">= 0", "$.slots_used")),
        ("node_id", "", ("length >= 1", "$.node_id")),
        ("node_id", "x" * 129, ("length <= 128", "$.node_id")),
        ("node_id", "a.b", ("regex", "$.node_id")),
        ("node_id", "gpu*", ("regex", "$.node_id")),
        ("node_id", "a b", ("regex", "$.node_id")),
    ],
)
def test_out_of_range_values(field: str, value: Any, fragments: tuple[str, ...]) -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], **{field: value}))
    rejected(data, NodeHeartbeat, *fragments)


def test_ident_of_exactly_128_characters_is_accepted() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], node_id="x" * 128))
    assert decode(data, NodeHeartbeat).node_id == "x" * 128




def test_ident_with_trailing_newline_is_refused() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], node_id="gpu-node-07\n"))
    rejected(data, NodeHeartbeat, "$.node_id")


def test_checksum_with_trailing_newline_is_refused() -> None:
    data = pack(as_map(EXAMPLES[SnapshotRecord], checksum="9f86d081884c7d65\n"))
    rejected(data, SnapshotRecord, "$.checksum")


def test_required_field_missing() -> None:
    data = pack({k: v for k, v in as_map(EXAMPLES[NodeHeartbeat]).items() if k != "seq"})
    rejected(data, NodeHeartbeat, "missing required field `seq`")


def test_unknown_extra_field() -> None:
    data = pack(as_map(EXAMPLES[NodeHeartbeat], extra_field=1))
    rejected(data, NodeHeartbeat, "unknown field `extra_field`")


def test_unknown_field_in_a_nested_part() -> None:
    data = as_map(EXAMPLES[NodeRecord])
    data["node"]["gpu_count"] = 8
    rejected(pack(data), NodeRecord, "unknown field `gpu_count`", "$.node")


def test_nested_field_out_of_range_names_the_path() -> None:
    data = as_map(EXAMPLES[NodeRecord])
    data["node"]["slots"] = 0
    rejected(pack(data), NodeRecord, ">= 1", "$.node.slots")


def test_bad_enum_value() -> None:
    data = pack(as_map(EXAMPLES[Fault], kind="meteor"))
    rejected(data, Fault, "$.kind")


def test_bad_checksum() -> None:
    data = pack(as_map(EXAMPLES[SnapshotRecord], checksum="NOT-HEX!"))
    rejected(data, SnapshotRecord, "$.checksum")


def test_empty_command_is_refused() -> None:
    data = pack(as_map(EXAMPLES[JobSpec], command=[]))
    rejected(data, JobSpec, "length >= 1", "$.command")


def test_labels_limit_is_64_entries() -> None:
    ok = {f"k{i}": "v" for i in range(64)}
    assert decode(pack(as_map(EXAMPLES[JobSpec], env=ok)), JobSpec).env == ok
    too_many = {f"k{i}": "v" for i in range(65)}
    rejected(pack(as_map(EXAMPLES[JobSpec], env=too_many)), JobSpec, "length <= 64", "$.env")


def test_non_positive_timeout_is_refused_but_null_is_allowed() -> None:
    rejected(pack(as_map(EXAMPLES[JobSpec], schedule_timeout_s=0.0)), JobSpec,
             "> 0.0", "$.schedule_timeout_s")
    assert decode(pack(as_map(EXAMPLES[JobSpec], schedule_timeout_s=None)),
                  JobSpec).schedule_timeout_s is None


# --- cross-field checks --------------------------------------------------------------------


def test_replica_range_min_above_max() -> None:
    data = pack(as_map(EXAMPLES[JobSpec], replicas={"min": 3, "max": 2}))
    rejected(data, JobSpec, "replicas.min 3 is greater than replicas.max 2")


def test_replica_range_min_equal_max_is_a_rigid_gang() -> None:
    data = pack(as_map(EXAMPLES[JobSpec], replicas={"min": 4, "max": 4}))
    assert decode(data, JobSpec).replicas == ReplicaRange(min=4, max=4)


def test_generation_world_size_does_not_match_members() -> None:
    data = pack(as_map(EXAMPLES[Generation], world_size=4))
    rejected(data, Generation, "world_size 4 but 3 members listed")


def test_generation_ranks_out_of_order() -> None:
    data = as_map(EXAMPLES[Generation])
    data["members"][0]["rank"], data["members"][1]["rank"] = 1, 0
    rejected(pack(data), Generation, "member ranks must be 0..2 in order", "[1, 0, 2]")


def test_generation_ranks_with_a_gap() -> None:
    data = as_map(EXAMPLES[Generation])
    data["members"][2]["rank"] = 5
    rejected(pack(data), Generation, "member ranks must be 0..2 in order", "[0, 1, 5]")


def test_snapshot_location_exactly_for_a_durable_copy() -> None:
    rejected(pack(as_map(EXAMPLES[SnapshotRecord], tier="durable")), SnapshotRecord,
             "location is required for a durable copy")
    rejected(pack(as_map(EXAMPLES[SnapshotRecord], location="/ckpt/j/step-1")),
             SnapshotRecord, "location is required for a durable copy and only for one")
    stored = decode(pack(as_map(EXAMPLES[SnapshotRecord], tier="durable",
                                location="/ckpt/j/step-1")), SnapshotRecord)
    assert stored.location == "/ckpt/j/step-1"


def test_snapshot_shard_not_below_num_shards() -> None:
    rejected(pack(as_map(EXAMPLES[SnapshotRecord], shard=8, num_shards=8)), SnapshotRecord,
             "shard 8 out of range for 8 shards")
    last = decode(pack(as_map(EXAMPLES[SnapshotRecord], shard=7, num_shards=8)), SnapshotRecord)
    assert last.shard == 7


def test_node_record_slots_used_above_slots() -> None:
    rejected(pack(as_map(EXAMPLES[NodeRecord], slots_used=9)), NodeRecord,
             "slots_used 9 exceeds the node's 8 slots")
    full = decode(pack(as_map(EXAMPLES[NodeRecord], slots_used=8)), NodeRecord)
    assert full.slots_used == 8


# --- hostile shapes ------------------------------------------------------------------------


def _nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\x90"


def test_deeply_nested_value_before_the_type_key_is_a_wire_error() -> None:
    data = (b"\x82" + pack("x") + _nested_arrays(5000)
            + pack("type") + pack(NodeStatusRequest.wire_name()))
    assert len(data) < MAX_PAYLOAD_BYTES
    rejected(data, NodeStatusRequest)


def test_deeply_nested_value_after_a_bad_type_key_is_a_wire_error() -> None:
    data = b"\x82" + pack("type") + pack("phalanx.bogus.v1") + pack("x") + _nested_arrays(5000)
    rejected(data, NodeStatusRequest)


def test_deeply_nested_value_after_a_good_type_key_is_a_wire_error() -> None:
    data = (b"\x82" + pack("type") + pack(NodeStatusRequest.wire_name()) + pack("x")
            + _nested_arrays(5000))
    rejected(data, NodeStatusRequest, "unknown field `x`")


@pytest.mark.parametrize("key", [b"\x80", b"\x91\x80"], ids=["map-key", "array-key"])
def test_unhashable_key_after_a_bad_type_is_a_wire_error(key: bytes) -> None:
    data = b"\x82" + pack("type") + pack("phalanx.node_heartbeat.v9") + key + pack(1)
    rejected(data, NodeHeartbeat)


def test_duplicate_type_key_naming_another_type_is_refused() -> None:
    name = NodeStatusRequest.wire_name()
    data = b"\x82" + pack("type") + pack(name) + pack("type") + pack("phalanx.fault.v1")
    rejected(data, NodeStatusRequest)





@pytest.mark.parametrize(
    "data",
    [
        b"\x81" + pack("type") + b"\xa2\xff\xfe",
        b"\x84" + pack("type") + pack(NodeHeartbeat.wire_name()) + pack("node_id")
        + b"\xa2\xff\xfe" + pack("seq") + pack(1) + pack("sent_at") + pack(1.0),
        b"\x82" + b"\xa2\xff\xfe" + pack(1) + pack("type") + pack(NodeHeartbeat.wire_name()),
    ],
    ids=["in-type-tag", "in-field-value", "in-key"],
)
def test_invalid_utf8_is_a_wire_error(data: bytes) -> None:
    rejected(data, NodeHeartbeat)


# --- found by bench/fuzz.py ----------------------------------------------------------------


def test_integers_beyond_max_int_are_refused() -> None:
    """A peer's 2**64 - 1 plus one, computed by a service, could not be encoded again
    (admission's leadership failed on a job record with next_slot = 2**64 - 1)."""
    data = pack(as_map(EXAMPLES[JobRecord], next_slot=MAX_INT + 1))
    rejected(data, JobRecord, f"<= {MAX_INT}", "$.next_slot")
    assert decode(pack(as_map(EXAMPLES[JobRecord], next_slot=MAX_INT)), JobRecord)


def test_an_admitted_record_without_nodes_is_refused() -> None:
    """Health's leadership failed on such a record (its core refuses to watch a job placed
    nowhere) and failed again on every takeover while the record stayed."""
    data = pack(as_map(EXAMPLES[JobRecord], nodes=[], slots=[]))
    rejected(data, JobRecord, "an admitted job must name the node of each replica")


def test_a_placement_larger_than_the_job_is_refused() -> None:
    """The fuzzer's record placing thousands of replicas of a job on one node had the agent
    launch far beyond its slots and rewrite a 212 MB manifest on every record."""
    most = _SPEC.replicas.max
    data = pack(as_map(EXAMPLES[JobRecord], nodes=["gpu-node-07"] * (most + 1), slots=[]))
    rejected(data, JobRecord, f"place more replicas than the job's replicas.max ({most})")
    assert decode(pack(as_map(EXAMPLES[JobRecord], nodes=["gpu-node-07"] * most, slots=[])),
                  JobRecord)


def test_encoding_a_value_beyond_64_bits_is_a_wire_error() -> None:
    # Constructors do not check ranges: what a service's arithmetic could produce.
    beat = msgspec.structs.replace(EXAMPLES[NodeHeartbeat], seq=2**64)
    with pytest.raises(WireError, match="cannot encode"):
        encode(beat)


def test_infinite_durations_and_times_are_refused() -> None:
    """Health's leadership failed on an admitted job with hang_timeout_s = inf (its core
    refuses it), again on every takeover while the record stayed."""
    spec = msgspec.to_builtins(EXAMPLES[JobRecord].spec) | {"hang_timeout_s": float("inf")}
    rejected(pack(as_map(EXAMPLES[JobRecord], spec=spec)), JobRecord, "$.spec.hang_timeout_s")
    rejected(pack(as_map(EXAMPLES[NodeHeartbeat], sent_at=float("inf"))), NodeHeartbeat,
             "$.sent_at")


def test_slot_and_replica_counts_are_bounded() -> None:
    """Admission's pass never ended: a node record claiming 2**63 - 1 slots and an elastic
    gang with replicas.max = 2**63 - 1 grew one replica at a time, forever."""
    spec = msgspec.to_builtins(EXAMPLES[JobRecord].spec) | {"replicas": {"min": 1,
                                                                         "max": 65_537}}
    rejected(pack(as_map(EXAMPLES[JobRecord], spec=spec)), JobRecord, "$.spec.replicas.max")
    node = msgspec.to_builtins(EXAMPLES[NodeRecord].node) | {"slots": 65_537}
    rejected(pack(as_map(EXAMPLES[NodeRecord], node=node)), NodeRecord, "$.node.slots")


# --- a job's or node's subject carries only messages about it -----------------------------


@pytest.mark.parametrize("subject, owner", [
    (subjects.job_fault("job-a"), ("job", "job-a")),
    (subjects.rank_exited("job-a"), ("job", "job-a")),
    (subjects.health_rank("job-a", 3), ("job", "job-a")),
    (subjects.ckpt_snapshot("job-a"), ("job", "job-a")),
    (subjects.node_heartbeat("n1"), ("node", "n1")),
    (subjects.agent_launch("n1"), ("node", "n1")),
    (subjects.kv_key(subjects.JOBS_BUCKET, "job-a"), ("job", "job-a")),
    (subjects.kv_key(subjects.GENERATIONS_BUCKET, "job-a"), ("job", "job-a")),
    (subjects.kv_key(subjects.NODES_BUCKET, "n1"), ("node", "n1")),
    (subjects.kv_key(subjects.BUDDIES_BUCKET, "n1"), ("node", "n1")),
    (subjects.ckpt_resume(), None),
    (subjects.admission_submit(), None),
    (subjects.kv_key(subjects.LEASES_BUCKET, "health"), None),
    ("$KV.phalanx_admission.job.job-a", None),
    ("_INBOX.cli.abc", None),
    ("", None),
])
def test_the_owner_of_a_subject(subject: str, owner: tuple[str, str] | None) -> None:
    assert subjects.owner(subject) == owner


def test_a_message_naming_another_job_than_its_subject_is_refused() -> None:
    fault = EXAMPLES[Fault]  # of job llama-ft
    assert decode(encode(fault), Fault, subject=subjects.job_fault("llama-ft")) == fault
    rejected(encode(fault), Fault, "names job 'llama-ft'", "belongs to job 'other'",
                      subject=subjects.job_fault("other"))


def test_a_record_under_another_nodes_key_is_refused() -> None:
    record = EXAMPLES[NodeRecord]  # of gpu-node-07
    key = subjects.kv_key(subjects.NODES_BUCKET, "gpu-node-07")
    assert decode(encode(record), NodeRecord, subject=key) == record
    rejected(encode(record), NodeRecord, "names node 'gpu-node-07'",
                      subject=subjects.kv_key(subjects.NODES_BUCKET, "gpu-node-11"))
    heartbeat = EXAMPLES[NodeHeartbeat]
    rejected(encode(heartbeat), NodeHeartbeat, "belongs to node 'gpu-node-11'",
                      subject=subjects.node_heartbeat("gpu-node-11"))
