"""The shell of a service of which any number of instances run and one leads.

Admission, health, elasticity and checkpoint each run as several instances; the
holder of the service's lease (:class:`~phalanx.services.lease.Leadership`) does
the work, the others stand by and take over within the lease bound.
:class:`LeaderService` is that shape once: the instance's name, the lease, and a
*term* — whatever exists only while this instance leads (its core, its stores,
its subscriptions) — made fresh at each start of leadership and dropped at its
end, so that a term never sees the state of one before it.

:class:`JobEventsLeader` adds what health and elasticity share: both keep
per-job state that a successor takes over (:class:`~.jobstate.JobStateStore`),
follow the job records, and act on the job-events stream from where the
previous leader's stored state ends. A term restores every job's stored state,
applies the current records, reads the stream on from the stored cursor and,
until it ends, applies record changes and events one at a time (``turn``): an
event that overtook its job's record has the record applied first
(:class:`~.jobstate.JobRecords`), in one place for both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from phalanx.bus import telemetry
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import Change, TypedKV
from phalanx.bus.stream import EventReader, StreamEvent, ensure_job_events
from phalanx.schemas import subjects
from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import JobRecord, JobSnapshot, Lease, StreamCursor
from phalanx.services.base import Service
from phalanx.services.jobstate import JobRecords, JobStateStore
from phalanx.services.lease import Leadership

log = logging.getLogger("phalanx.leader")
TermT = TypeVar("TermT")


def instance_name() -> str:
    """A name that tells this instance apart from every other: host, pid and a nonce."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class LeaderService(Service, Generic[TermT]):
    """A service whose instances share one lease; the holder runs :meth:`lead`.

    Subclasses name the service and its lease (:attr:`service_name`, :attr:`lease_key`),
    open their buckets in :meth:`~.base.Service.setup`, call :meth:`start_leadership`
    with the lease bucket, and implement :meth:`begin_term` (the term's fresh state)
    and :meth:`lead` (the leader's work, which runs until the lease is lost and is
    then cancelled).

    Args:
        instance: this instance's name; by default :func:`instance_name`.
        lease_s: how long the lease lasts without renewal (the takeover bound).
    """

    #: The service's name for ``$SRV``.
    service_name: ClassVar[str]
    #: Its key in the lease bucket.
    lease_key: ClassVar[str]

    def __init__(self, bus_config: BusConfig | None = None, *, instance: str | None = None,
                 lease_s: float = 3.0) -> None:
        super().__init__(self.service_name, instance or instance_name(), bus_config)
        self.lease_s = lease_s
        #: What exists only while this instance leads; None while it stands by.
        self.term: TermT | None = None

    @property
    def leading(self) -> bool:
        return self.term is not None

    def start_leadership(self, leases: TypedKV[Lease]) -> None:
        """Contend for the lease from now until the service stops."""
        assert self.bus is not None
        bus = self.bus
        self.leadership = Leadership(leases, self.lease_key, self.instance, self.lease_s,
                                     self._term, bus_config=bus.config,
                                     in_majority=lambda: bus.in_majority)
        self.keep_running(lambda: self.leadership.run(self.sleep_or_stop), "lease")

    async def _term(self) -> None:
        term = self.begin_term()
        self.term = term
        try:
            await self.lead(term)
        finally:
            if self.term is term:
                self.term = None

    def begin_term(self) -> TermT:
        """The state of a new term of leadership."""
        raise NotImplementedError

    async def lead(self, term: TermT) -> None:
        """The leader's work for one term, until cancelled."""
        raise NotImplementedError


class JobCore(Protocol):
    """What :class:`JobEventsLeader` needs of a core: the jobs it holds."""

    @property
    def jobs(self) -> dict[str, Any]: ...


CoreT = TypeVar("CoreT", bound=JobCore)


@dataclasses.dataclass
class JobTerm(Generic[CoreT]):
    """A term of a :class:`JobEventsLeader`: its core, each job's stored state and stream
    position, the records applied, and the reader of the stream."""

    core: CoreT
    store: JobStateStore[JobSnapshot]
    records: JobRecords
    reader: EventReader | None = None
    # Records, events and timeouts are applied one at a time: the core's state and a
    # job's stored snapshot change together.
    turn: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


JobTermT = TypeVar("JobTermT", bound=JobTerm[Any])


class JobEventsLeader(LeaderService[JobTermT]):
    """A leader that follows the job records and acts on the job-events stream.

    Subclasses set :attr:`event_kinds`, call :meth:`open_job_state` in ``setup``,
    and implement :meth:`restore_job`, :meth:`on_record` and :meth:`on_event`; the
    hooks :meth:`restored`, :meth:`caught_up`, :meth:`term_loops` and :meth:`end_term`
    are optional.
    """

    #: The job-event kinds the leader acts on (:data:`phalanx.bus.stream.KINDS`).
    event_kinds: ClassVar[frozenset[str]]

    async def open_job_state(self, snapshot_bucket: str) -> None:
        """Open the jobs, snapshot, cursor and lease buckets and the job-events stream,
        then contend for the lease."""
        assert self.bus is not None
        self.jobs = await self.bucket(subjects.JOBS_BUCKET, JobRecord)
        self.snapshots = await self.bucket(snapshot_bucket, JobSnapshot)
        self.cursors = await self.bucket(subjects.CURSORS_BUCKET, StreamCursor)
        leases = await self.bucket(subjects.LEASES_BUCKET, Lease)
        await ensure_job_events(self.bus)
        self.start_leadership(leases)

    def job_state(self) -> tuple[JobStateStore[JobSnapshot], JobRecords]:
        """A new term's store of job snapshots and its applied records."""
        return (JobStateStore(self.snapshots, self.cursors, self.lease_key),
                JobRecords(self.jobs))

    # --- to implement -------------------------------------------------------------------

    def restore_job(self, term: JobTermT, state: bytes, now: float) -> str:
        """Put a job's stored state into the term's core; returns its job id.

        Raises:
            StoredStateError: the state cannot be read by this version (it is skipped).
        """
        raise NotImplementedError

    async def on_record(self, term: JobTermT, change: Change[JobRecord]) -> None:
        """Apply a change of a job's record (under the term's turn)."""
        raise NotImplementedError

    async def on_event(self, term: JobTermT, event: StreamEvent) -> None:
        """Act on a job event not yet reflected in its job's state (under the turn, in the
        span of the message)."""
        raise NotImplementedError

    async def restored(self, term: JobTermT) -> None:
        """Runs once every job's stored state is restored, before the records are read."""

    async def caught_up(self, term: JobTermT) -> None:
        """Runs once the current records are applied, before the stream is read."""

    def term_loops(self, term: JobTermT) -> Iterable[Coroutine[Any, Any, None]]:
        """The term's own loops, run beside the records and the events."""
        return ()

    async def end_term(self, term: JobTermT) -> None:
        """Release what the term took besides the reader (its subscriptions)."""

    # --- the term -----------------------------------------------------------------------

    async def lead(self, term: JobTermT) -> None:
        """Restore, apply the current records, then follow records and events (and the
        term's loops) until cancelled."""
        assert self.bus is not None
        records = self.jobs.follow(self.bus.resync_event())
        try:
            await self._restore(term)
            await self.restored(term)
            async for change in records:  # the current records first
                if change is None:
                    break
                async with term.turn:
                    await self._record(term, change)
            await self.caught_up(term)
            term.reader = await EventReader(self.bus, term.store.cursor + 1,
                                            self.event_kinds).start()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._follow_records(term, records))
                tasks.create_task(self._follow_events(term, term.reader))
                for loop in self.term_loops(term):
                    tasks.create_task(loop)
        finally:
            # Standing by before the teardown's awaits: nothing started from now on (a
            # reconnection's resumption) may act on the ending term.
            self.term = None
            await self.end_term(term)
            if term.reader is not None:
                await term.reader.close()
            await records.aclose()

    async def _restore(self, term: JobTermT) -> None:
        """Every job's stored state, and the stream position to read on from."""
        now = time.time()
        for entry in await term.store.load():
            try:
                job_id = self.restore_job(term, entry.value.state, now)
            except StoredStateError as exc:
                log.error("%s state of %s skipped: %s", self.lease_key, entry.key, exc)
                continue
            term.store.restored(job_id, entry.value.seq)
        log.info("restored", extra={"service": self.lease_key, "jobs": len(term.core.jobs),
                                    "cursor": term.store.cursor})

    async def _record(self, term: JobTermT, change: Change[JobRecord]) -> None:
        if term.records.fresh(change):  # else applied already, read ahead of an event
            await self.on_record(term, change)

    async def _follow_records(self, term: JobTermT,
                              records: AsyncIterator[Change[JobRecord] | None]) -> None:
        async for change in records:
            if change is not None:
                async with term.turn:
                    await self._record(term, change)

    async def _follow_events(self, term: JobTermT, reader: EventReader) -> None:
        async for event in reader:
            job_id = event.message.job_id
            if term.store.seen(job_id, event.seq):
                continue
            ahead = None if job_id in term.core.jobs else await term.records.ahead(job_id)
            async with term.turn:
                if ahead is not None:  # the event overtook its job's record (jobstate)
                    await self._record(term, ahead)
                with telemetry.consumer_span(event.delivery.subject, event.delivery.headers,
                                             0):
                    await self.on_event(term, event)
