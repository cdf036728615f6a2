"""Where a leader-leased service keeps each job's state and its place in the event stream.

Health and elasticity act on the job-events stream (:mod:`phalanx.bus.stream`)
and keep per-job state that a successor must take over. :class:`JobStateStore`
holds, for one term of leadership:

* one snapshot per job in the service's bucket, tagged with the stream sequence
  of the last event it reflects; each write is compare-and-swapped on the
  revision this leader last wrote or read (fencing: a deposed leader that has
  not noticed yet cannot overwrite its successor, it gets
  :class:`~phalanx.services.lease.LeadershipLost` instead);
* any other key a term writes that a successor's writes must win over
  (:class:`FencedKeys`: elasticity's generation records), compare-and-swapped the
  same way, the first write of a key in a term on the revision read just before;
* the service's cursor in ``phalanx_cursors``: every event up to it is acted on
  and stored. It is written lazily (a replay of a few events is harmless, each
  job skips what its snapshot reflects), compare-and-swapped as well.

A new leader loads every snapshot (:meth:`load`), reads the stream on from
``cursor + 1``, and skips, per job, events at or before that job's sequence
(:meth:`seen`).

A job's events and its record come through two consumers (the stream, a watch of
the jobs bucket), so an event can overtake the record change that caused it: a rank
started, or a fault raised, for a job whose admission the watch has not brought yet.
Handled against the older record such an event is lost, and its sequence counts as
handled. :class:`JobRecords` gives the leader the record as the bucket holds it now
for a job it does not know yet, before its event. (Elasticity's core also keeps a
job's early events until its record comes, but only in memory: the cursor moved past
them, a successor never saw them.)
"""

from __future__ import annotations

import logging
import time
from typing import Generic, TypeVar

from phalanx.bus.errors import Conflict
from phalanx.bus.kv import Change, Entry, TypedKV
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import JobRecord, Message, StreamCursor
from phalanx.services.lease import LeadershipLost

log = logging.getLogger("phalanx.jobstate")
S = TypeVar("S", bound=Message)


class JobStateStore(Generic[S]):
    """Per-job snapshots of type ``S`` and the stream cursor of ``service``."""

    def __init__(self, snapshots: TypedKV[S], cursors: TypedKV[StreamCursor],
                 service: str) -> None:
        self.snapshots = snapshots
        self.cursors = cursors
        self.service = service
        self.cursor = 0  # every event up to here is acted on and stored
        self._cursor_revision: int | None = None
        self._revisions: dict[str, int] = {}
        self._seqs: dict[str, int] = {}  # job -> the last event its stored state reflects

    async def load(self) -> list[Entry[S]]:
        """The stored snapshots (undecodable ones are logged and skipped) and the cursor."""
        # Absent: the first leader ever. Undecodable: counted, and replaced at its revision.
        # Either way this leader reads the whole stream (acting twice is harmless).
        cursor, revision = await self.cursors.current(self.service)
        self.cursor = cursor.seq if cursor is not None else 0
        self._cursor_revision = revision or None
        stored, bad = await self.snapshots.entries()
        for error in bad:
            log.error("unreadable %s state skipped: %s", self.service, error)
        for entry in stored:
            self._revisions[entry.key] = entry.revision
        return stored

    def restored(self, job_id: str, seq: int) -> None:
        """``job_id``'s state, as loaded, reflects events up to ``seq``."""
        self._seqs[job_id] = seq

    def seen(self, job_id: str, seq: int) -> bool:
        """Whether ``job_id``'s state already reflects event ``seq`` (skip it)."""
        return seq <= self._seqs.get(job_id, 0)

    def reflects(self, job_id: str, seq: int | None) -> None:
        """Note that ``job_id``'s state now reflects event ``seq`` (None: a change from
        elsewhere, a job record, which moves no sequence)."""
        if seq is not None:
            self._seqs[job_id] = max(seq, self._seqs.get(job_id, 0))

    def seq(self, job_id: str) -> int:
        """The sequence to store with ``job_id``'s state: the last event it reflects (the
        cursor for a job no event of this term has touched)."""
        return self._seqs.get(job_id, self.cursor)

    async def store(self, job_id: str, snapshot: S) -> None:
        """Write ``job_id``'s snapshot, fenced on the revision this leader knows.

        Raises:
            LeadershipLost: another instance wrote it since.
        """
        revision = self._revisions.get(job_id)
        try:
            self._revisions[job_id] = (
                await self.snapshots.update(job_id, snapshot, revision) if revision is not None
                else await self.snapshots.create(job_id, snapshot))
        except Conflict:
            raise LeadershipLost(f"the {self.service} state of {job_id} was written by "
                                 "another instance") from None

    async def forget(self, job_id: str) -> None:
        """Delete ``job_id``'s snapshot (fenced like :meth:`store`)."""
        revision = self._revisions.pop(job_id, None)
        self._seqs.pop(job_id, None)
        if revision is None:
            return
        try:
            await self.snapshots.delete(job_id, revision=revision)
        except Conflict:
            raise LeadershipLost(f"the {self.service} state of {job_id} was written by "
                                 "another instance") from None

    async def advance(self, seq: int) -> None:
        """Store the cursor at ``seq`` if it moved (every event up to it is stored).

        Raises:
            LeadershipLost: another instance wrote the cursor since.
        """
        if seq <= self.cursor:
            return
        cursor = StreamCursor(seq=seq, updated_at=time.time())
        try:
            self._cursor_revision = (
                await self.cursors.update(self.service, cursor, self._cursor_revision)
                if self._cursor_revision is not None
                else await self.cursors.create(self.service, cursor))
        except Conflict:
            raise LeadershipLost(f"the {self.service} stream cursor was written by another "
                                 "instance") from None
        self.cursor = seq


class FencedKeys(Generic[S]):
    """Keys of ``bucket`` that one term writes, each compare-and-swapped on the revision
    this term last wrote, or read just before its first write of the key.

    A successor's first write of a key moves its revision on, so a write of the deposed
    leader that a cut held back and the heal lets through is refused, not applied.
    """

    def __init__(self, bucket: TypedKV[S], service: str) -> None:
        self.bucket = bucket
        self.service = service
        self._revisions: dict[str, int] = {}

    async def put(self, key: str, value: S) -> None:
        """Write ``key``, fenced.

        Raises:
            LeadershipLost: another instance wrote it since this term last did.
        """
        revision = self._revisions.get(key)
        if revision is None:
            _, revision = await self.bucket.current(key)
        try:
            self._revisions[key] = (await self.bucket.update(key, value, revision) if revision
                                    else await self.bucket.create(key, value))
        except Conflict:
            raise LeadershipLost(f"the {self.service} record {key} was written by another "
                                 "instance") from None

    def forget(self, key: str) -> None:
        """``key`` is deleted or no longer this term's: its next write reads it afresh."""
        self._revisions.pop(key, None)


class JobRecords:
    """The job records a leader has applied, each at most once and never an older one
    after a newer: the watch's changes, and the records read ahead of an event."""

    def __init__(self, bucket: TypedKV[JobRecord]) -> None:
        self.bucket = bucket
        self._applied: dict[str, int] = {}  # job -> the revision of its record applied

    def fresh(self, change: Change[JobRecord]) -> bool:
        """Whether ``change`` is newer than the job's record applied so far; if so, it
        counts as applied from now on."""
        if change.revision <= self._applied.get(change.key, 0):
            return False
        self._applied[change.key] = change.revision
        return True

    async def ahead(self, job_id: str) -> Change[JobRecord] | None:
        """``job_id``'s record as the bucket holds it now, if newer than the one applied
        (None if not, or if there is none): read before an event of a job the leader
        does not know, which may have overtaken its record."""
        try:
            entry = await self.bucket.get(job_id)
        except WireError:  # counted and logged; the watch reports it as well
            return None
        if entry is None or entry.revision <= self._applied.get(job_id, 0):
            return None
        return Change(entry.key, entry.value, entry.revision)
