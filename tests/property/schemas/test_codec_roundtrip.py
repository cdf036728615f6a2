"""Properties of the codec: valid messages round-trip, anything else is one WireError.

``hypothesis.strategies.from_type`` ignores ``msgspec.Meta`` constraints (it
happily builds ``node_id=""``), so the strategies here are derived from
``msgspec.inspect`` type info, which carries every constraint, plus a small
fix-up per struct for its ``__post_init__`` cross-field rules.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, decode, encode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import (
    ALL_MESSAGES,
    MIN_RANK_MEMORY,
    BuddyPlacement,
    BuddyReason,
    ChaosAction,
    ChaosRequest,
    CheckpointPolicy,
    Generation,
    GpuFaultKind,
    JobRecord,
    JobSpec,
    JobState,
    Message,
    NodeHeartbeat,
    NodeRecord,
    NodeStatusRequest,
    ReplicaFetch,
    ReplicaRange,
    ScalingChange,
    ScalingEventKind,
    ScalingPolicy,
    SnapshotRecord,
    SnapshotReserve,
    SnapshotTier,
    memory_bytes,
)

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=100,
                    suppress_health_check=[HealthCheck.too_slow])

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# --- strategies from msgspec type info -----------------------------------------------------


#: A pattern that is one character class repeated (identifiers, names, checksums).
_REPEATED_CLASS = re.compile(r"\^(\[[^\]]+\])([+*])\\Z")
#: The characters a class that lists what it takes is drawn from: ASCII and a few beyond
#: it (one of each kind a class may take or refuse); a negated class draws from all.
_CANDIDATES = "".join(map(chr, range(32, 127))) + "\t\né€Ω中🙂"


def _str(t: mi.StrType) -> st.SearchStrategy[str]:
    lo = t.min_length or 0
    hi = t.max_length if t.max_length is not None else 24
    if t.pattern is None:
        return st.text(min_size=lo, max_size=min(hi, 24))
    if (repeated := _REPEATED_CLASS.fullmatch(t.pattern)) is not None:
        # As from_regex would draw it, at a fraction of its cost (the largest of this
        # module's, which ran for minutes on a loaded machine).
        character = re.compile(repeated.group(1))
        alphabet: st.SearchStrategy[str] | list[str] = \
            st.characters(codec="utf-8").filter(lambda c: character.fullmatch(c) is not None) \
            if repeated.group(1).startswith("[^") \
            else [c for c in _CANDIDATES if character.fullmatch(c)]
        least = max(lo, 1 if repeated.group(2) == "+" else 0)
        return st.text(alphabet=alphabet, min_size=least, max_size=max(least, min(hi, 24)))
    return st.from_regex(t.pattern, fullmatch=True).filter(lambda s: lo <= len(s) <= hi)


def _int(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else INT64_MIN)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT64_MAX)
    return st.integers(lo, hi)


def _float(t: mi.FloatType) -> st.SearchStrategy[float]:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return st.floats(min_value=lo, max_value=hi, exclude_min=t.gt is not None,
                     exclude_max=t.lt is not None, allow_nan=False)


def _fix_replica_range(kw: dict[str, Any]) -> dict[str, Any]:
    kw["min"], kw["max"] = sorted((kw["min"], kw["max"]))
    return kw


def _fix_node_record(kw: dict[str, Any]) -> dict[str, Any]:
    if "slots_used" in kw:
        kw["slots_used"] = min(kw["slots_used"], kw["node"].slots)
    if "cordoned_slots" in kw:
        kw["cordoned_slots"] = {s % kw["node"].slots: why
                                for s, why in kw["cordoned_slots"].items()}
    return kw


def _fix_generation(kw: dict[str, Any]) -> dict[str, Any]:
    kw["members"] = [msgspec.structs.replace(m, rank=i, replica_id=f"{m.replica_id[:120]}-{i}")
                     for i, m in enumerate(kw["members"])]
    kw["world_size"] = len(kw["members"])
    return kw


def _fix_snapshot(kw: dict[str, Any]) -> dict[str, Any]:
    kw["shard"] = min(kw["shard"], kw["num_shards"] - 1)
    kw["column"] = min(kw.get("column", 0), kw.get("columns", 1) - 1)
    durable = kw["tier"] is SnapshotTier.DURABLE
    kw["location"] = (kw.get("location") or "/ckpt") if durable else ""
    return kw


def _fix_checkpoint_policy(kw: dict[str, Any]) -> dict[str, Any]:
    memory = kw.get("memory_every_steps", "auto")
    if kw.get("durable_every_steps") and memory != "auto":  # a multiple of a fixed interval
        kw["memory_every_steps"] = memory or 1
        kw["durable_every_steps"] = kw["memory_every_steps"] * min(
            kw["durable_every_steps"], 1_000_000 // kw["memory_every_steps"])
    return kw


def _fix_snapshot_reserve(kw: dict[str, Any]) -> dict[str, Any]:
    kw["shard"] = min(kw["shard"], kw["shards"] - 1)
    return kw


def _fix_scaling_policy(kw: dict[str, Any]) -> dict[str, Any]:
    if kw.get("replica_discrete_values") is not None:
        kw["replica_increment_step"] = None
        kw["replica_discrete_values"] = sorted(set(kw["replica_discrete_values"]))
    return kw


def _fix_job_spec(kw: dict[str, Any]) -> dict[str, Any]:
    scaling, replicas = kw.get("scaling"), kw["replicas"]
    if scaling is not None and scaling.replica_discrete_values is not None:
        inside = sorted({min(max(v, replicas.min), replicas.max)
                         for v in scaling.replica_discrete_values})
        kw["scaling"] = msgspec.structs.replace(scaling, replica_discrete_values=inside)
    slots = kw.get("slots_per_replica", 1)  # a group's slots fit one node
    kw["ranks_per_replica"] = min(kw.get("ranks_per_replica", 1), 65_536 // slots)
    memory = kw.get("memory_per_rank")
    if isinstance(memory, str) and memory_bytes(memory) < MIN_RANK_MEMORY:
        kw["memory_per_rank"] = "64Mi"  # the pattern allows less than a rank's least
    return kw


def _fix_scaling_change(kw: dict[str, Any]) -> dict[str, Any]:
    if kw["kind"] not in (ScalingEventKind.GROW, ScalingEventKind.SHRINK):
        kw["kind"] = ScalingEventKind.GROW
    return kw


def _fix_job_record(kw: dict[str, Any]) -> dict[str, Any]:
    if kw["state"] is JobState.ADMITTED and not kw.get("nodes"):
        kw["nodes"] = ["n0"]
    kw["nodes"] = kw.get("nodes", [])[:kw["spec"].replicas.max]
    if "slots" in kw:
        kw["slots"] = list(range(len(kw.get("nodes", [])))) if kw["slots"] else []
        if kw["slots"] and kw.get("next_slot"):  # a slot number not yet handed out
            kw["next_slot"] = max(kw["next_slot"], len(kw["slots"]))
    return kw


def _fix_chaos(kw: dict[str, Any]) -> dict[str, Any]:
    if kw["action"] is ChaosAction.KILL_RANK:
        kw["job_id"] = kw.get("job_id") or "job"
        kw["rank"] = kw.get("rank") if kw.get("rank") is not None else 0
    if kw["action"] is ChaosAction.GPU_FAULT and kw.get("gpu") is None:
        kw["gpu"] = 0
    if kw.get("gpu_fault", GpuFaultKind.XID) is not GpuFaultKind.XID:
        kw["code"] = None
    return kw


def _fix_buddy(kw: dict[str, Any]) -> dict[str, Any]:
    buddy = kw.get("buddy_id", "")
    if buddy == kw["node_id"]:
        buddy = kw["buddy_id"] = buddy[:120] + "-b"
    kw["reason"] = BuddyReason.NO_OTHER_DOMAIN if not buddy else (
        kw.get("reason") if kw.get("reason") not in (None, BuddyReason.NO_OTHER_DOMAIN)
        else BuddyReason.PLACED)
    if buddy and kw.get("buddy_domain", "") == kw["failure_domain"]:
        kw["buddy_domain"] = kw["failure_domain"][:120] + "-other"
    return kw


#: Make generated fields satisfy each struct's ``__post_init__``.
FIXUPS: dict[type, Callable[[dict[str, Any]], dict[str, Any]]] = {
    ReplicaRange: _fix_replica_range,
    NodeRecord: _fix_node_record,
    Generation: _fix_generation,
    SnapshotRecord: _fix_snapshot,
    CheckpointPolicy: _fix_checkpoint_policy,
    ScalingPolicy: _fix_scaling_policy,
    SnapshotReserve: _fix_snapshot_reserve,
    ReplicaFetch: _fix_snapshot_reserve,
    JobSpec: _fix_job_spec,
    ScalingChange: _fix_scaling_change,
    JobRecord: _fix_job_record,
    ChaosRequest: _fix_chaos,
    BuddyPlacement: _fix_buddy,
}


def _struct(t: mi.StructType) -> st.SearchStrategy[Any]:
    required = {}
    optional = {}
    for f in t.fields:
        strategy = strategy_for(f.type)
        if f.name == "members":  # a Generation has world_size >= 1
            strategy = st.lists(strategy_for(f.type.item_type), min_size=1, max_size=4)
        (required if f.required else optional)[f.name] = strategy
    fix = FIXUPS.get(t.cls, lambda kw: kw)
    return st.fixed_dictionaries(required, optional=optional).map(
        lambda kw: t.cls(**fix(dict(kw))))


def strategy_for(t: mi.Type) -> st.SearchStrategy[Any]:
    match t:
        case mi.StructType():
            return _struct(t)
        case mi.StrType():
            return _str(t)
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            return _int(t)
        case mi.FloatType():
            return _float(t)
        case mi.NoneType():
            return st.none()
        case mi.BytesType():
            return st.binary(min_size=t.min_length or 0, max_size=min(t.max_length or 64, 64))
        case mi.EnumType():
            return st.sampled_from(list(t.cls))
        case mi.LiteralType():
            return st.sampled_from(list(t.values))
        case mi.UnionType():
            return st.one_of([strategy_for(x) for x in t.types])
        case mi.ListType():
            hi = min(t.max_length if t.max_length is not None else 4, 4)
            return st.lists(strategy_for(t.item_type), min_size=t.min_length or 0,
                            max_size=max(hi, t.min_length or 0))
        case mi.DictType():
            hi = min(t.max_length if t.max_length is not None else 4, 4)
            return st.dictionaries(strategy_for(t.key_type), strategy_for(t.value_type),
                                   min_size=t.min_length or 0, max_size=hi)
    raise NotImplementedError(f"no strategy for {t!r}: extend strategy_for")


@functools.cache
def messages_of(cls: type[Message]) -> st.SearchStrategy[Message]:
    return strategy_for(mi.type_info(cls))


any_message = st.one_of([messages_of(cls) for cls in ALL_MESSAGES])

MSG_IDS = [cls.__name__ for cls in ALL_MESSAGES]


def check_rejection(err: WireError, expected: type[Message], subject: str) -> None:
    assert err.subject == subject
    assert err.message_type == expected.wire_name()
    assert expected.wire_name() in str(err)
    assert repr(subject) in str(err)


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=MSG_IDS)
@SETTINGS
@given(data=st.data())
def test_every_valid_message_round_trips(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(messages_of(cls))
    payload = encode(message)
    assert len(payload) <= MAX_PAYLOAD_BYTES
    back = decode(payload, cls, subject="phalanx.test")
    assert type(back) is cls
    assert back == message
    assert encode(back) == payload


@SETTINGS
@given(message=any_message, expected=st.sampled_from(ALL_MESSAGES))
def test_decoding_as_another_type_is_refused_naming_both(
    message: Message, expected: type[Message]
) -> None:
    payload = encode(message)
    if type(message) is expected:
        assert decode(payload, expected) == message
        return
    with pytest.raises(WireError) as excinfo:
        decode(payload, expected, subject="phalanx.other")
    check_rejection(excinfo.value, expected, "phalanx.other")
    assert type(message).wire_name() in str(excinfo.value)


def test_ident_strategy_respects_the_meta_constraints() -> None:
    """The builder honours pattern and lengths (``st.from_type`` would not)."""
    ident = next(f.type for f in mi.type_info(NodeHeartbeat).fields if f.name == "node_id")
    assert isinstance(ident, mi.StrType)
    assert ident.pattern is not None and ident.min_length == 1 and ident.max_length == 128

    @settings(derandomize=True, database=None, max_examples=50)
    @given(st.data())
    def ident_values(data: st.DataObject) -> None:
        value = data.draw(strategy_for(ident))
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,128}", value)

    ident_values()


# --- garbage in, WireError out -------------------------------------------------------------


def decode_or_wire_error(payload: bytes, expected: type[Message], subject: str) -> None:
    """The only two outcomes allowed: a valid ``expected``, or a WireError about it."""
    try:
        message = decode(payload, expected, subject=subject)
    except WireError as err:
        check_rejection(err, expected, subject)
    else:
        assert type(message) is expected
        # whatever was accepted must be re-encodable to an equivalent message
        assert decode(encode(message), expected) == message


@SETTINGS
@given(payload=st.binary(max_size=512), expected=st.sampled_from(ALL_MESSAGES))
def test_random_bytes_decode_or_raise_wire_error(payload: bytes,
                                                 expected: type[Message]) -> None:
    decode_or_wire_error(payload, expected, "phalanx.fuzz")


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(INT64_MIN, 2**64 - 1)
    | st.floats() | st.text(max_size=12) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)

FIELD_NAMES = sorted({f.encode_name for cls in ALL_MESSAGES for f in mi.type_info(cls).fields}
                     | {"min", "max", "rank", "slots", "bogus"})
TYPE_NAMES = [cls.wire_name() for cls in ALL_MESSAGES] + [
    "phalanx.node_heartbeat.v2", "phalanx.bogus.v1", "", "phalanx.fault"]


@SETTINGS
@given(
    fields=st.dictionaries(st.sampled_from(FIELD_NAMES), msgpack_values, max_size=8),
    type_name=st.none() | st.sampled_from(TYPE_NAMES) | msgpack_values,
    expected=st.sampled_from(ALL_MESSAGES),
)
def test_random_maps_decode_or_raise_wire_error(
    fields: dict[str, Any], type_name: Any, expected: type[Message]
) -> None:
    if type_name is not None:
        fields = {"type": type_name, **fields}
    decode_or_wire_error(msgspec.msgpack.encode(fields), expected, "phalanx.fuzz.map")


@SETTINGS
@example(message=NodeStatusRequest(), edits=[(7, 0x80)], cut=None)  # breaks the `type` str
@given(
    message=any_message,
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1,
                   max_size=4),
    cut=st.none() | st.integers(0, 10_000),
)
def test_corrupted_valid_payloads_decode_or_raise_wire_error(
    message: Message, edits: list[tuple[int, int]], cut: int | None
) -> None:
    payload = bytearray(encode(message))
    for pos, byte in edits:
        payload[pos % len(payload)] = byte
    if cut is not None:
        payload = payload[: cut % (len(payload) + 1)]
    decode_or_wire_error(bytes(payload), type(message), "phalanx.fuzz.flip")


@SETTINGS
@given(message=any_message, field=st.sampled_from(FIELD_NAMES), value=msgpack_values)
def test_one_replaced_field_decodes_or_raises_wire_error(
    message: Message, field: str, value: Any
) -> None:
    data = msgspec.to_builtins(message)
    data[field] = value
    decode_or_wire_error(msgspec.msgpack.encode(data), type(message), "phalanx.fuzz.field")
