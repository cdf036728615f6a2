"""Typed JetStream key-value buckets with compare-and-swap updates.

Every value is a wire message, so what one process stores another decodes
with the same validation as a bus message. :meth:`TypedKV.modify` is the
read-modify-write loop services use for shared state: it retries when another
writer got there first, so two instances can never both apply a change
computed from the same old value.

A stored value that does not decode is a *bad message*, counted in
:attr:`TypedKV.counters` and logged. Reads raise :class:`WireError` for it,
watches skip it, and writers that compute from the current value
(:meth:`TypedKV.current`, :meth:`TypedKV.modify`) treat it as absent and
replace it at its revision: garbage under a key must never wedge its writer
(an agent's heartbeat, a leader's lease or cursor) for good.

On a NATS cluster a bucket is a replicated stream with a leader. When the server
that leads it dies, JetStream cannot answer for it until the survivors have
elected another leader (4-9 s measured on nats-server 2.15), and a client whose
server died needs a moment to reconnect to another. Every call here therefore
retries what fails for want of an answer (a timeout, "no response from stream",
503, no responders) until :attr:`TypedKV.failover_s` has passed, and then raises
the last error: a caller sees the election as a slow call, not as a failure. A
conditional write retried after an unanswered attempt may find that attempt was
stored (only its acknowledgement was lost): when the key then holds exactly the
bytes written, that is the write's result, not a conflict.

Every outcome of a conditional write is an answer (:meth:`TypedKV._swap`): stored;
lost to another writer (:class:`~phalanx.bus.errors.Conflict`); the key deleted, so
created again at the revision of its deletion marker (a delete, a purge, or the
server's own marker when a message's TTL ran out); unanswered, so retried. A refusal
is resolved by reading the key's last message from the stream's leader, and that read
may find nothing at all: the key's messages removed since (an expiry, a subject purge),
or, on a replicated bucket, another writer's message proposed but not yet stored (the
leader refuses a write to a key while another to it is in flight). A create then tries
again at revision 0, and is refused again exactly while the other write is in flight.

A value whose encoding passes one payload is stored in chunks with a pointer under its
key (:mod:`phalanx.bus.spill`); every read here puts it back together, or reads the key
again when a newer value replaced it meanwhile, so callers never see the difference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Generic, TypeVar

import nats.js.errors as jse
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from phalanx.bus import spill
from phalanx.bus.client import Counters, replicas_for, subscribed
from phalanx.bus.errors import Conflict
from phalanx.bus.failover import _UNANSWERED, FAILOVER_S, through_failover
from phalanx.bus.tasks import concurrently, raise_if_cancelled
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode, encode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import MAX_SPILLED_BYTES, Message, Spilled

M = TypeVar("M", bound=Message)
T = TypeVar("T")
log = logging.getLogger("phalanx.bus.kv")

#: Headers that make a key's last message a deletion: a KV delete or purge, and the
#: marker the server leaves when a message's TTL or the bucket's age limit removes it.
_OPERATION, _DELETED_OPERATIONS, _MARKER_REASON = "KV-Operation", ("DEL", "PURGE"), \
    "Nats-Marker-Reason"
#: How often a create meets a fresh deletion marker (or an emptied key) before it counts
#: as lost: each such refusal means another writer touched the key meanwhile.
_RECREATES = 3


@dataclasses.dataclass(frozen=True)
class Stored:
    """A key's last message as the stream holds it: a value, or a deletion marker."""

    data: bytes
    revision: int
    deleted: bool


@dataclasses.dataclass(frozen=True)
class Entry(Generic[M]):
    key: str
    value: M
    revision: int


@dataclasses.dataclass(frozen=True)
class Change(Generic[M]):
    """One watched update: ``value`` is None when the key was deleted or purged."""

    key: str
    value: M | None
    revision: int


class TypedKV(Generic[M]):
    """A KV bucket whose values are ``message_type`` messages."""

    def __init__(self, kv: KeyValue, bucket: str, message_type: type[M]) -> None:
        self.kv = kv
        self.bucket = bucket
        self.message_type = message_type
        self.counters = Counters()
        self.failover_s = FAILOVER_S
        """How long a call retries while the bucket's stream elects a leader."""
        self.chunks = spill.ChunkStore(kv._js, replicas_for(kv._js))
        self._spilled: dict[str, Spilled] = {}  # key -> the pointer this instance last wrote

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, message_type: type[M], *,
                   history: int = 1, storage: StorageType = StorageType.FILE) -> TypedKV[M]:
        """Open ``bucket``, creating it if it does not exist yet, with as many replicas as
        the bus is configured for (:func:`~phalanx.bus.client.replicas_for`). A bucket that
        exists keeps the replicas it was created with."""
        async def open_or_create() -> KeyValue:
            try:
                return await js.key_value(bucket)
            except jse.BucketNotFoundError:
                pass
            try:
                return await js.create_key_value(KeyValueConfig(
                    bucket=bucket, history=history, storage=storage, replicas=replicas_for(js)))
            except jse.BadRequestError as exc:
                if exc.err_code != 10058:  # "stream name already in use": made meanwhile
                    raise
                return await js.key_value(bucket)

        return cls(await through_failover(open_or_create, f"opening bucket {bucket}"),
                   bucket, message_type)

    async def _retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        return await through_failover(call, f"{self.bucket}/{what}", self.failover_s)

    async def _swap(self, key: str, data: bytes, last: int) -> int:
        """Store ``data`` under ``key`` if its last revision is ``last`` (0: if it is
        absent or deleted); the new revision. Each outcome is an answer (module
        docstring): an unanswered attempt is retried, and a refusal is looked up in the
        key's last message on the stream's leader.

        Raises:
            Conflict: another writer's value is there, or one is being stored.
        """
        at = last
        for _ in range(_RECREATES):
            unanswered = False

            async def attempt(at: int = at) -> int:
                nonlocal unanswered
                try:
                    return await self.kv.update(key, data, last=at)
                except _UNANSWERED:
                    unanswered = True
                    raise

            try:
                return await self._retrying(attempt, key)
            except jse.KeyWrongLastSequenceError:
                pass
            if last and not unanswered:
                break  # an update refused at once: the key moved on, nothing to look up
            stored = await self._last(key, leader=True)
            if unanswered and stored is not None and not stored.deleted \
                    and stored.data == data:
                return stored.revision  # an earlier attempt of this very write was stored
            if last or (stored is not None and not stored.deleted):
                break  # the key moved on from ``last``, or holds another writer's value
            at = stored.revision if stored is not None else 0  # deleted, or emptied, since
        raise Conflict(f"{self.bucket}/{key} changed since revision {last}" if last
                       else f"{self.bucket}/{key} already exists")

    async def _last(self, key: str, *, leader: bool = False) -> Stored | None:
        """``key``'s last message, value or deletion marker, or None if it has none; from
        the stream's leader when ``leader`` (a bucket that allows direct gets may
        otherwise answer from a replica that lags behind)."""
        direct = bool(self.kv._direct) and not leader
        subject = f"{self.kv._pre}{key}"
        try:
            msg = await self._retrying(lambda: self.kv._js.get_msg(
                self.kv._stream, subject=subject, direct=direct), key)
        except jse.NotFoundError:
            return None
        headers = msg.headers or {}
        deleted = headers.get(_OPERATION) in _DELETED_OPERATIONS or _MARKER_REASON in headers
        return Stored(msg.data or b"", msg.seq or 0, deleted)

    async def _raw(self, key: str) -> Stored | None:
        """``key``'s live value, or None if it is absent or deleted."""
        stored = await self._last(key)
        return None if stored is None or stored.deleted else stored

    async def _decode(self, key: str, data: bytes | None) -> M:
        """The value ``data`` stores, its chunks put together if it is a pointer.

        Raises:
            WireError: it does not decode (counted).
            spill.Superseded: it is a pointer whose chunks a newer value removed.
        """
        subject = subjects.kv_subject(self.bucket, key)
        try:
            spilled = spill.pointer(data or b"", subject=subject)
            if spilled is not None:
                if spilled.of != self.message_type.wire_name():
                    raise WireError(f"it points to a {spilled.of} value",
                                    subject=subject, message_type=self.message_type.wire_name())
                data = await self.chunks.load(spilled)
            return decode(data or b"", self.message_type, subject=subject,
                          limit=MAX_SPILLED_BYTES)
        except WireError as exc:
            self.counters.bad_message(str(exc))
            raise

    async def _read(self, key: str) -> tuple[M | None, Stored | None]:
        """The key's live value and what is stored for it; (None, None) when absent.
        A pointer whose chunks a newer value removed meanwhile is read again."""
        for _ in range(8):
            raw = await self._raw(key)
            if raw is None:
                return None, None
            try:
                return await self._decode(key, raw.data), raw
            except spill.Superseded:
                continue
        raise WireError("its chunks were replaced eight times while being read",
                        subject=subjects.kv_subject(self.bucket, key),
                        message_type=self.message_type.wire_name())

    async def _write(self, key: str, value: M, store: Callable[[bytes], Awaitable[int]]) -> int:
        """Store ``value`` under ``key`` with ``store`` (a put or a compare-and-swap of the
        bytes); the new revision.

        Past one payload the value's chunks are stored first and ``store`` writes the
        pointer to them (:mod:`phalanx.bus.spill`). Once stored, the chunks of the value
        it replaced are removed, and only those: another writer's, stored meanwhile, may
        be the key's next value (a deposed leader's put racing its successor's). The
        chunks of a write refused are removed at once; those of a writer that died
        between its chunks and its pointer stay until the key is deleted.
        """
        data = encode(value, limit=MAX_SPILLED_BYTES)
        spilled: Spilled | None = None
        replaced: Spilled | None = self._spilled.get(key)
        if len(data) > spill.SPILL_ABOVE:
            previous = await self._raw(key)
            try:
                replaced = None if previous is None else spill.pointer(previous.data)
            except WireError:
                replaced = None  # garbage under the key: nothing of it to remove
            spilled = await self.chunks.spill(self.bucket, key, value.wire_name(), data)
            data = encode(spilled)
        try:
            revision = await store(data)
        except Conflict:
            if spilled is not None and (replaced is None or replaced.digest != spilled.digest):
                await self.chunks.remove(self.bucket, key, spilled.digest)
            raise
        finally:
            raise_if_cancelled()
        if spilled is not None:
            self._spilled[key] = spilled
        else:
            self._spilled.pop(key, None)
        if replaced is not None and (spilled is None or replaced.digest != spilled.digest):
            await self.chunks.remove(self.bucket, key, replaced.digest)
        return revision

    def pointer(self, key: str) -> Spilled | None:
        """The pointer this instance last stored under ``key`` in place of a value too
        large for one payload (None: its last write there was a value of its own); what
        to publish for that value (:meth:`~phalanx.bus.client.Bus.publish`)."""
        return self._spilled.get(key)

    async def get(self, key: str) -> Entry[M] | None:
        """The current entry, or ``None`` if the key is absent or deleted.

        Raises:
            WireError: the stored value does not decode.
        """
        value, raw = await self._read(key)
        if value is None or raw is None:
            return None
        return Entry(key, value, raw.revision)

    async def current(self, key: str) -> tuple[M | None, int]:
        """The value to compute a compare-and-swap from, and the revision to swap at.

        ``(None, 0)`` when the key is absent or deleted (so: create). A value that does
        not decode counts as absent but keeps its revision, so the next
        :meth:`update` replaces it (counted and logged here).
        """
        try:
            value, raw = await self._read(key)
        except WireError as exc:
            log.warning("replacing an undecodable KV entry: %s", exc)
            raw = await self._raw(key)
            return None, 0 if raw is None else raw.revision
        return (None, 0) if value is None or raw is None else (value, raw.revision)

    async def put(self, key: str, value: M) -> int:
        """Store ``value`` unconditionally; returns the new revision."""
        return await self._write(
            key, value, lambda data: self._retrying(lambda: self.kv.put(key, data), key))

    async def create(self, key: str, value: M) -> int:
        """Store ``value`` only if ``key`` does not exist.

        Raises:
            Conflict: the key exists.
        """
        return await self._write(key, value, lambda data: self._swap(key, data, 0))

    async def update(self, key: str, value: M, revision: int) -> int:
        """Store ``value`` only if ``key`` is still at ``revision``.

        Raises:
            Conflict: the key changed since ``revision``.
        """
        return await self._write(key, value, lambda data: self._swap(key, data, revision))

    async def modify(self, key: str, change: Callable[[M | None], M], *,
                     attempts: int = 16) -> Entry[M]:
        """Apply ``change`` to the current value with compare-and-swap, retrying on conflict.

        ``change`` gets ``None`` when the key is absent (or its value does not decode,
        see :meth:`current`) and must be pure: it may run several times.

        Raises:
            Conflict: still losing after ``attempts`` tries.
        """
        for _ in range(attempts):
            value, revision = await self.current(key)
            new = change(value)
            try:
                revision = await (self.update(key, new, revision) if revision
                                  else self.create(key, new))
            except Conflict:
                continue
            return Entry(key, new, revision)
        raise Conflict(f"{self.bucket}/{key}: lost {attempts} compare-and-swap races in a row")

    async def delete(self, key: str, revision: int | None = None) -> None:
        """Delete ``key``; with ``revision``, only if it is still at that revision.

        Raises:
            Conflict: ``revision`` was given and the key has moved on.
        """
        try:
            await self._retrying(lambda: self.kv.delete(key, last=revision), key)
        except jse.APIError as exc:
            raise_if_cancelled()
            if revision is None:
                raise
            raise Conflict(
                f"{self.bucket}/{key} changed since revision {revision}: {exc}") from None
        raise_if_cancelled()
        self._spilled.pop(key, None)
        await self.chunks.drop(self.bucket, key)

    async def watch(self) -> AsyncGenerator[Change[M] | None, None]:
        """Current values, then ``None`` once they are all delivered, then every change.

        Values that do not decode are logged and skipped; the watch goes on.
        """
        watcher = await self._retrying(  # through a JetStream election, like every call
            lambda: subscribed(self.kv.watchall(), KeyValue.KeyWatcher.stop), "(watch)")
        try:
            async for raw in watcher:
                if raw is None:
                    yield None
                    continue
                if raw.operation in ("DEL", "PURGE"):
                    yield Change(raw.key, None, raw.revision or 0)
                    continue
                try:
                    value = await self._decode(raw.key, raw.value)
                except WireError as exc:
                    log.warning("skipping undecodable KV entry: %s", exc)
                    continue
                except spill.Superseded:
                    continue  # a newer value replaced it: the watch brings that one next
                yield Change(raw.key, value, raw.revision or 0)
        finally:
            await watcher.stop()

    async def follow(self, resync: asyncio.Event) -> AsyncGenerator[Change[M] | None, None]:
        """Every current value, then ``None``, then every change; all again whenever
        ``resync`` is set.

        Set ``resync`` after a reconnection: a watcher may have stalled or missed
        changes while the server was away. The current values come from
        :meth:`entries` (exact), not from a watcher's first pass, which can end early
        while the server is starting (seen right after a nats-server restart: an
        empty first pass); changes come from a watcher, each key's only when newer
        than what was yielded for it. Deletions are yielded only as the server
        reports them, never inferred from a key's absence.
        """
        yielded: dict[str, int] = {}  # key -> the revision last yielded
        while True:
            resync.clear()
            changes: asyncio.Queue[Change[M] | None] = asyncio.Queue()
            pump = asyncio.create_task(self._pump(changes))  # from before the read: no gap
            try:
                current, _ = await self.entries()
                for entry in current:
                    if entry.revision > yielded.get(entry.key, 0):
                        yielded[entry.key] = entry.revision
                        yield Change(entry.key, entry.value, entry.revision)
                yield None
                while True:
                    change = await _first(changes.get(), resync.wait())
                    if resync.is_set():
                        break
                    if change is None and pump.done():  # the watch failed (or ended)
                        pump.result()
                        break
                    if change is None or change.revision <= yielded.get(change.key, 0):
                        continue  # the watcher's first pass, or older than what we have
                    yielded[change.key] = change.revision
                    yield change
            finally:
                pump.cancel()
                await asyncio.wait([pump])  # raises nothing: a failure was raised above
                if not pump.cancelled():
                    pump.exception()  # retrieved: no "never retrieved" warning

    async def _pump(self, into: asyncio.Queue[Change[M] | None]) -> None:
        try:
            async for change in self.watch():
                into.put_nowait(change)
        finally:  # wakes follow(), which must not wait on a watch that is gone
            into.put_nowait(None)

    async def _keys(self, prefix: str = "") -> list[str]:
        """Every key (starting with ``prefix``) with a value or a delete marker, as the
        server lists the bucket's subjects.

        nats-py's ``keys()`` lists through a watcher that can end its initial pass early
        while keys are being written, and so miss some; the stream's per-subject state is
        exact. (``KeyValue`` exposes no stream handle, hence its private ``_js``/``_stream``.)
        """
        subject_prefix = f"$KV.{self.bucket}."
        wanted = f"{subject_prefix}{prefix}>" if prefix else f"{subject_prefix}>"
        try:
            info = await self._retrying(lambda: self.kv._js.stream_info(
                self.kv._stream, subjects_filter=wanted), "(keys)")
        except jse.NotFoundError:
            return []
        return [subject.removeprefix(subject_prefix) for subject in (info.state.subjects or {})]

    async def currents(self, prefix: str, *,
                       in_flight: int = 256) -> dict[str, tuple[M | None, int]]:
        """:meth:`current` of every key under ``prefix`` (which ends with a dot), read
        ``in_flight`` at a time; keys deleted are left out, undecodable values are None
        with their revision. A leader restoring thousands of records reads them this way
        (one at a time took seconds at 10,000 keys)."""
        gate = asyncio.Semaphore(in_flight)

        async def read(key: str) -> tuple[str, M | None, int]:
            async with gate:
                value, revision = await self.current(key)
            return key, value, revision

        read_all = await concurrently(read(key) for key in await self._keys(prefix))
        return {key: (value, revision) for key, value, revision in read_all if revision}

    async def entries(self) -> tuple[list[Entry[M]], list[WireError]]:
        """Every live entry, and the errors of those whose values do not decode."""
        keys = await self._keys()
        good: list[Entry[M]] = []
        bad: list[WireError] = []
        for key in sorted(keys):
            try:
                entry = await self.get(key)
            except WireError as exc:
                bad.append(exc)
                continue
            if entry is not None:
                good.append(entry)
        return good, bad


async def _first(first: Awaitable[T], *others: Awaitable[object]) -> T | None:
    """The result of ``first`` if it finishes before any of ``others`` (else None); the
    rest are cancelled."""
    winner = asyncio.ensure_future(first)
    tasks = [winner, *(asyncio.ensure_future(a) for a in others)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return winner.result() if winner in done else None
