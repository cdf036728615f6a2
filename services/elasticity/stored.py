"""What of a job's membership outlives the elasticity leader. Pure.

:func:`snapshot` encodes a job's whole :class:`~.model.JobMembership` (msgpack) for the
shell to store after each event, and :func:`restore` takes it back, so that a core
restored after event *k* and fed events *k+1…* decides exactly what one that never
stopped decides.
"""

from __future__ import annotations

import msgspec

from phalanx.schemas.errors import StoredStateError
from phalanx.services.elasticity.model import JobMembership

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(JobMembership)


def snapshot(job: JobMembership) -> bytes:
    """One job's whole state, for :func:`restore`."""
    return _ENCODER.encode(job)


def restore(data: bytes) -> JobMembership:
    """The membership a :func:`snapshot` stores.

    Raises:
        StoredStateError: ``data`` is not a snapshot this version can read.
    """
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoredStateError(f"not an elasticity job snapshot: {exc}") from None
