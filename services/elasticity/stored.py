"""What of a job's membership outlives the elasticity leader: its stored type. Pure.

:class:`StoredMembership` is a job's whole :class:`~.model.JobMembership`, versioned;
:func:`snapshot` encodes it (msgpack) for the shell to store after each event, and
:func:`restore` takes it back, so that a core restored after event *k* and fed events
*k+1…* decides exactly what one that never stopped decides.
"""

from __future__ import annotations

import msgspec

from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import Generation, GenerationRecord
from phalanx.services.elasticity.events import LaunchReplacement, MemberFailed
from phalanx.services.elasticity.model import JobMembership, Replica

#: The layout :class:`StoredMembership` has. Version 1 is the one the live dataclass was
#: stored in before this type existed, without the field: such data reads as version 1.
VERSION = 1


class StoredReplica(msgspec.Struct, frozen=True):
    replica_id: str
    slot: int
    node_id: str
    endpoint: str = ""


class StoredLaunch(msgspec.Struct, frozen=True):
    """A replacement still to ask for (:class:`~.events.LaunchReplacement`)."""

    job_id: str
    slot: int
    node_id: str
    replica_id: str
    cause: str = ""
    warm_only: bool = False
    gang: bool = False


class StoredFault(msgspec.Struct, frozen=True):
    """A declared session's fault kept until it is managed (:class:`~.events.MemberFailed`)."""

    job_id: str
    replica_id: str
    detail: str = ""
    replaceable: bool = True
    event_id: str = ""
    admission: int = 0


class StoredMembership(msgspec.Struct, frozen=True, kw_only=True):
    """One job's membership as stored: the fields of :class:`~.model.JobMembership`, which
    says what each means."""

    version: int = VERSION
    job_id: str
    min_members: int
    max_members: int
    slots: dict[int, str]
    replacements_left: int
    admission: int = 0
    current: Generation | None = None
    replacement_budget: int | None = None
    replicas: dict[str, StoredReplica] = {}
    launched: dict[str, int] = {}
    forming: tuple[str, ...] = ()
    incarnation: dict[int, int] = {}
    applied: tuple[str, ...] = ()
    committed: dict[str, int] = {}
    failed: dict[str, str] = {}
    ready: tuple[str, ...] = ()
    waiting_since: float | None = None
    complete: bool = False
    to_launch: tuple[StoredLaunch, ...] = ()
    high_water: int = 0
    managed: bool = False
    early_faults: tuple[StoredFault, ...] = ()
    leaving: tuple[str, ...] = ()
    departing: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    history: tuple[GenerationRecord, ...] = ()
    warm_ready: tuple[str, ...] = ()
    gather_since: float | None = None
    replaced: int = 0
    given_up: str = ""
    session: bool = False
    gang_round: int = 0


class _Versioned(msgspec.Struct):
    """Only the version, read first: a layout this version does not know is named as
    such, not as whichever field no longer fits."""

    version: int = VERSION


_ENCODER = msgspec.msgpack.Encoder()
_VERSION_DECODER = msgspec.msgpack.Decoder(_Versioned)
_DECODER = msgspec.msgpack.Decoder(StoredMembership)


def stored(job: JobMembership) -> StoredMembership:
    """``job`` as stored."""
    return StoredMembership(
        job_id=job.job_id, min_members=job.min_members, max_members=job.max_members,
        slots=dict(job.slots), replacements_left=job.replacements_left,
        admission=job.admission, current=job.current,
        replacement_budget=job.replacement_budget,
        replicas={r: StoredReplica(x.replica_id, x.slot, x.node_id, x.endpoint)
                  for r, x in job.replicas.items()},
        launched=dict(job.launched), forming=tuple(sorted(job.forming)),
        incarnation=dict(job.incarnation), applied=tuple(sorted(job.applied)),
        committed=dict(job.committed), failed=dict(job.failed), ready=tuple(job.ready),
        waiting_since=job.waiting_since, complete=job.complete,
        to_launch=tuple(StoredLaunch(d.job_id, d.slot, d.node_id, d.replica_id, d.cause,
                                     d.warm_only, d.gang) for d in job.to_launch),
        high_water=job.high_water, managed=job.managed,
        early_faults=tuple(StoredFault(f.job_id, f.replica_id, f.detail, f.replaceable,
                                       f.event_id, f.admission) for f in job.early_faults),
        leaving=tuple(job.leaving), departing=tuple(job.departing), sizes=tuple(job.sizes),
        history=tuple(job.history), warm_ready=tuple(job.warm_ready),
        gather_since=job.gather_since, replaced=job.replaced, given_up=job.given_up,
        session=job.session, gang_round=job.gang_round)


def live(kept: StoredMembership) -> JobMembership:
    """The membership ``kept`` stores."""
    return JobMembership(
        kept.job_id, kept.min_members, kept.max_members, dict(kept.slots),
        kept.replacements_left, admission=kept.admission, current=kept.current,
        replacement_budget=kept.replacement_budget,
        replicas={r: Replica(x.replica_id, x.slot, x.node_id, x.endpoint)
                  for r, x in kept.replicas.items()},
        launched=dict(kept.launched), forming=set(kept.forming),
        incarnation=dict(kept.incarnation), applied=set(kept.applied),
        committed=dict(kept.committed), failed=dict(kept.failed), ready=list(kept.ready),
        waiting_since=kept.waiting_since, complete=kept.complete,
        to_launch=[LaunchReplacement(d.job_id, d.slot, d.node_id, d.replica_id, d.cause,
                                     d.warm_only, d.gang) for d in kept.to_launch],
        high_water=kept.high_water, managed=kept.managed,
        early_faults=[MemberFailed(f.job_id, f.replica_id, f.detail, f.replaceable,
                                   f.event_id, f.admission) for f in kept.early_faults],
        leaving=list(kept.leaving), departing=list(kept.departing), sizes=list(kept.sizes),
        history=list(kept.history), warm_ready=list(kept.warm_ready),
        gather_since=kept.gather_since, replaced=kept.replaced, given_up=kept.given_up,
        session=kept.session, gang_round=kept.gang_round)


def snapshot(job: JobMembership) -> bytes:
    """One job's whole state, for :func:`restore`."""
    return _ENCODER.encode(stored(job))


def restore(data: bytes) -> JobMembership:
    """The membership a :func:`snapshot` (or an earlier version's) stores.

    Raises:
        StoredStateError: ``data`` is not a snapshot this version can read; the message
            says what is wrong (its version, or the field that does not fit).
    """
    try:
        version = _VERSION_DECODER.decode(data).version
        if version != VERSION:
            raise StoredStateError(f"an elasticity job snapshot of version {version}; "
                                   f"this version reads version {VERSION}")
        return live(_DECODER.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoredStateError(f"not an elasticity job snapshot: {exc}") from None
