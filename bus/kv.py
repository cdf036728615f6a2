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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors as jse
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from phalanx.bus.client import Counters, raise_if_cancelled, replicas_for, subscribed
from phalanx.bus.errors import Conflict
from phalanx.bus.tasks import concurrently
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode, encode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import Message

M = TypeVar("M", bound=Message)
T = TypeVar("T")
log = logging.getLogger("phalanx.bus.kv")

#: How long a call keeps retrying while JetStream cannot answer for a bucket (a leader
#: election takes 4-9 s); the last attempt may add its own timeout (5 s) to this.
FAILOVER_S = 15.0
_RETRY_S = 0.2
# Failures that mean "nobody answered for the bucket yet", not "the answer is no".
_UNANSWERED = (TimeoutError, nats.errors.NoRespondersError, jse.NoStreamResponseError,
               jse.ServiceUnavailableError)


async def through_failover(call: Callable[[], Awaitable[T]], what: str,
                           failover_s: float = FAILOVER_S) -> T:
    """``await call()``, retried every 0.2 s while it fails unanswered (see the module
    docstring) until ``failover_s`` has passed; then the last error is raised."""
    deadline = time.monotonic() + failover_s
    while True:
        try:
            result = await call()
            raise_if_cancelled()
            return result
        except _UNANSWERED as exc:
            raise_if_cancelled()
            if time.monotonic() >= deadline:
                raise
            log.debug("%s unanswered (%r); retrying", what, exc)
        await asyncio.sleep(_RETRY_S)


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

    async def _conditional(self, key: str, data: bytes,
                           write: Callable[[], Awaitable[int]]) -> int:
        """``write()`` (a create or an update of ``key`` to ``data``), retried while
        unanswered; raises ``KeyWrongLastSequenceError`` unless the conflict is an
        earlier attempt of this write that was stored after all."""
        unanswered = False

        async def attempt() -> int:
            nonlocal unanswered
            try:
                return await write()
            except _UNANSWERED:
                unanswered = True
                raise

        try:
            return await self._retrying(attempt, key)
        except jse.KeyWrongLastSequenceError:
            if unanswered:
                raw = await self._raw(key)
                if raw is not None and raw.value == data:
                    return raw.revision or 0
            raise

    async def _raw(self, key: str) -> KeyValue.Entry | None:
        try:
            return await self._retrying(lambda: self.kv.get(key), key)
        except jse.KeyNotFoundError:
            return None

    def _decode(self, key: str, data: bytes | None) -> M:
        try:
            return decode(data or b"", self.message_type,
                          subject=subjects.kv_subject(self.bucket, key))
        except WireError as exc:
            self.counters.bad_message(str(exc))
            raise

    async def get(self, key: str) -> Entry[M] | None:
        """The current entry, or ``None`` if the key is absent or deleted.

        Raises:
            WireError: the stored value does not decode.
        """
        raw = await self._raw(key)
        if raw is None:
            return None
        return Entry(key, self._decode(key, raw.value), raw.revision or 0)

    async def current(self, key: str) -> tuple[M | None, int]:
        """The value to compute a compare-and-swap from, and the revision to swap at.

        ``(None, 0)`` when the key is absent or deleted (so: create). A value that does
        not decode counts as absent but keeps its revision, so the next
        :meth:`update` replaces it (counted and logged here).
        """
        raw = await self._raw(key)
        if raw is None:
            return None, 0
        try:
            return self._decode(key, raw.value), raw.revision or 0
        except WireError as exc:
            log.warning("replacing an undecodable KV entry: %s", exc)
            return None, raw.revision or 0

    async def put(self, key: str, value: M) -> int:
        """Store ``value`` unconditionally; returns the new revision."""
        data = encode(value)
        revision = await self._retrying(lambda: self.kv.put(key, data), key)
        raise_if_cancelled()
        return revision

    async def create(self, key: str, value: M) -> int:
        """Store ``value`` only if ``key`` does not exist.

        Raises:
            Conflict: the key exists.
        """
        data = encode(value)
        try:
            revision = await self._conditional(key, data, lambda: self.kv.create(key, data))
        except jse.KeyWrongLastSequenceError:
            raise Conflict(f"{self.bucket}/{key} already exists") from None
        finally:
            raise_if_cancelled()
        return revision

    async def update(self, key: str, value: M, revision: int) -> int:
        """Store ``value`` only if ``key`` is still at ``revision``.

        Raises:
            Conflict: the key changed since ``revision``.
        """
        data, last = encode(value), revision
        try:
            revision = await self._conditional(
                key, data, lambda: self.kv.update(key, data, last=last))
        except jse.KeyWrongLastSequenceError:
            raise Conflict(f"{self.bucket}/{key} changed since revision {revision}") from None
        finally:
            raise_if_cancelled()
        return revision

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
                    value = self._decode(raw.key, raw.value)
                except WireError as exc:
                    log.warning("skipping undecodable KV entry: %s", exc)
                    continue
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
