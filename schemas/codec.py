"""The one codec of the wire: typed messages to MessagePack bytes and back.

:func:`decode` never lets a bad payload through and never raises anything but
:class:`~phalanx.schemas.errors.WireError`: oversized, empty or non-MessagePack
bytes, a missing or foreign ``type`` name, an unknown schema version, wrong
field types, out-of-range values, unknown fields and failed cross-field checks
all name the subject, the expected type and the problem.
"""

from __future__ import annotations

import re
from typing import TypeVar, Union

import msgspec

from phalanx.schemas import subjects
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import ALL_MESSAGES, Message

#: Matches the NATS server's default ``max_payload``; nothing we send needs more.
MAX_PAYLOAD_BYTES = 1024 * 1024

M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()
# Decoding against the union of all messages makes the ``type`` name mandatory
# (a lone tagged struct would accept a payload without it).
_decoder = msgspec.msgpack.Decoder(Union[ALL_MESSAGES])  # noqa: UP007
_by_base_name = {m.wire_name().rsplit(".v", 1)[0]: m for m in ALL_MESSAGES}
_VERSIONED = re.compile(r"^(?P<base>.+)\.v(?P<version>\d+)$")


def encode(message: Message, *, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    """Serialise ``message`` to MessagePack.

    ``limit``: the most bytes it may take; one NATS payload unless the caller stores it
    in chunks (:mod:`phalanx.bus.spill`, up to ``MAX_SPILLED_BYTES``).

    Raises:
        WireError: the encoded message exceeds ``limit``, or holds a value MessagePack
            cannot carry (an integer beyond 64 bits).
    """
    try:
        data = _encoder.encode(message)
    except (OverflowError, msgspec.EncodeError) as exc:
        raise WireError(f"cannot encode: {exc}", message_type=message.wire_name()) from None
    if len(data) > limit:
        raise WireError(
            f"encoded size {len(data)} B exceeds the {limit} B limit",
            message_type=message.wire_name(),
        )
    return data


def decode(data: bytes, expected: type[M], *, subject: str = "",
           limit: int = MAX_PAYLOAD_BYTES) -> M:
    """Decode and validate ``data`` as an ``expected`` message.

    Args:
        data: the raw payload.
        expected: the message type the subject carries.
        subject: where the payload came from: named in the error message, and a job's
            or node's subject (:func:`~phalanx.schemas.subjects.owner`) refuses a
            message naming another.
        limit: the most bytes accepted (a value put together from chunks may be larger
            than one payload).

    Raises:
        WireError: the payload is not a valid ``expected`` message.
    """
    name = expected.wire_name()
    if not data:
        raise WireError("empty payload", subject=subject, message_type=name)
    if len(data) > limit:
        raise WireError(
            f"payload of {len(data)} B exceeds the {limit} B limit",
            subject=subject, message_type=name,
        )
    try:
        message = _decoder.decode(data)
    except msgspec.ValidationError as exc:  # a DecodeError subclass: catch it first
        raise WireError(_explain(data, exc), subject=subject, message_type=name) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not MessagePack ({exc})", subject=subject, message_type=name) from None
    except UnicodeDecodeError as exc:
        raise WireError(f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                        subject=subject, message_type=name) from None
    except RecursionError:
        raise WireError("values nested too deeply", subject=subject,
                        message_type=name) from None
    if type(message) is not expected:
        raise WireError(
            f"got a {message.wire_name()} message", subject=subject, message_type=name
        )
    owner = subjects.owner(subject)
    if owner is not None:
        kind, owner_id = owner
        named = names(message, kind)
        if named is not None and named != owner_id:
            raise WireError(f"it names {kind} {named!r}, but {subject!r} belongs to "
                            f"{kind} {owner_id!r}", subject=subject, message_type=name)
    return message


def names(message: Message, kind: str) -> str | None:
    """The job (``kind`` "job") or node ("node") ``message`` is about, if it names one."""
    if kind == "job":
        return getattr(message, "job_id", None)
    node = getattr(message, "node", None)
    return node.node_id if node is not None else getattr(message, "node_id", None)


def _explain(data: bytes, exc: msgspec.ValidationError) -> str:
    """Turn a validation failure on the ``type`` tag into a version-aware message."""
    text = str(exc)
    if "$.type" not in text:
        return text
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return text
    wire_type = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(wire_type, str):
        return f"the `type` field ($.type) must name a message type, got {wire_type!r}"
    match = _VERSIONED.match(wire_type)
    known = _by_base_name.get(match["base"]) if match else None
    if match and known is not None:
        return (
            f"got {wire_type}: unsupported schema version v{match['version']} of "
            f"{match['base']}; this build speaks {known.wire_name()}"
        )
    return f"unknown message type {wire_type!r}"
