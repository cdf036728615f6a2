"""Values larger than one NATS payload: stored in chunks, found through a pointer.

A job of thousands of replicas has a record, generations and leaders' snapshots that
each list them, and past about 15,000 replicas (fewer with long ids) their encodings
pass NATS's 1 MiB payload. Such a value is *spilled*: its encoding is cut into
:data:`CHUNK_BYTES` slices stored in the ``phalanx_chunks`` bucket under
``<bucket>.<key>.<digest>.<i>`` (``digest``: the SHA-256 of the whole encoding), and
its key holds a :class:`~phalanx.schemas.messages.Spilled` pointer in its place; the
same pointer is what is published on the value's subject.

Why a reader never sees half a value:

* the chunks are all stored before the pointer is written (compare-and-swapped as any
  value), so a pointer a reader can see names chunks that are there;
* chunks are content-addressed and never rewritten: a newer value has another digest,
  hence other keys;
* a value's chunks are removed only after a newer value has replaced its pointer under
  the same key, by the writer that replaced it (:meth:`ChunkStore.remove`), or once the
  key is deleted (:meth:`ChunkStore.drop`). A reader that then finds one missing
  (:class:`Superseded`) reads the key again and gets the newer value; one that has all
  of them checks their concatenation against the digest before decoding.

So a reader gets the whole value, or a newer one, never a mix. The chunks are removed
with a subject purge of the chunk stream (no delete markers are left behind).

Cost: a spilled write is one read of the pointer it replaces, ``ceil(size /
CHUNK_BYTES)`` puts one after another, the pointer, then one purge of the replaced value's
chunks; a spilled read is the pointer and the chunks in parallel (direct gets).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging

import nats.js.errors as jse
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from phalanx.bus.failover import through_failover
from phalanx.bus.tasks import concurrently
from phalanx.schemas import subjects
from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, decode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import MAX_SPILLED_BYTES, Spilled

log = logging.getLogger("phalanx.bus.spill")

#: An encoding larger than this is spilled (the rest of the payload is left to the
#: message's headers: trace context, message ids).
SPILL_ABOVE = MAX_PAYLOAD_BYTES - 16 * 1024
#: The size of one chunk.
CHUNK_BYTES = 768 * 1024
_MARK = subjects.PREFIX.encode() + b".spilled.v"


class Superseded(Exception):
    """A pointer's chunks are gone: a newer value replaced it (read the key again)."""


def pointer(data: bytes, *, subject: str = "") -> Spilled | None:
    """The pointer ``data`` is, or None when it is a value of its own.

    Raises:
        WireError: it is marked as a pointer but is not a valid one.
    """
    if len(data) > 4096 or _MARK not in data[:40]:
        return None
    return decode(data, Spilled, subject=subject)


def chunk_key(bucket: str, key: str, digest: str, index: int) -> str:
    """The chunk bucket's key of chunk ``index`` of ``key``'s value of ``digest``."""
    return f"{bucket}.{key}.{digest}.{index}"


class ChunkStore:
    """The chunk bucket, as one connection's JetStream context reaches it."""

    def __init__(self, js: JetStreamContext, replicas: int) -> None:
        self.js = js
        self.replicas = replicas  # of the bucket, if this store creates it
        self._kv: KeyValue | None = None
        self._opening = asyncio.Lock()

    async def _bucket(self) -> KeyValue:
        async with self._opening:
            if self._kv is None:
                try:
                    self._kv = await self.js.key_value(subjects.CHUNKS_BUCKET)
                except jse.BucketNotFoundError:
                    try:
                        self._kv = await self.js.create_key_value(KeyValueConfig(
                            bucket=subjects.CHUNKS_BUCKET, history=1,
                            storage=StorageType.FILE, replicas=self.replicas,
                            max_value_size=CHUNK_BYTES))
                    except jse.BadRequestError as exc:
                        if exc.err_code != 10058:  # made meanwhile
                            raise
                        self._kv = await self.js.key_value(subjects.CHUNKS_BUCKET)
            return self._kv

    async def spill(self, bucket: str, key: str, of: str, data: bytes) -> Spilled:
        """Store ``data`` (the encoding of a message named ``of``, stored under ``key``
        of ``bucket``) in chunks; the pointer to write in its place."""
        if len(data) > MAX_SPILLED_BYTES:
            raise WireError(f"encoded size {len(data)} B exceeds the {MAX_SPILLED_BYTES} B "
                            "limit of a value stored in chunks", message_type=of)
        kv = await self._bucket()
        digest = hashlib.sha256(data).hexdigest()
        pieces = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]

        async def put(i: int, piece: bytes) -> int:
            # A chunk's key names its bytes: a put retried after a lost answer stores the
            # same value again. Retried as every KV call is, through a slow or electing
            # server (a 768 KiB put on a loaded one was seen to take over 5 s).
            name = chunk_key(bucket, key, digest, i)
            return await through_failover(lambda: kv.put(name, piece), f"chunks/{name}")

        # One at a time: the client buffers at most 2 MiB of outgoing data before it forces
        # a flush with a deadline, and three 768 KiB chunks at once passed it (a 1.6 MB
        # state stored every second; the client's flush timed out under load and its
        # service stopped).
        for i, piece in enumerate(pieces):
            await put(i, piece)
        return Spilled(bucket=bucket, key=key, of=of, digest=digest, size=len(data),
                       chunks=len(pieces))

    async def load(self, spilled: Spilled) -> bytes:
        """The value ``spilled`` points to, checked against its digest.

        Raises:
            Superseded: a chunk is gone (a newer value replaced this one).
            WireError: the chunks do not put together the value the pointer names.
        """
        kv = await self._bucket()

        async def piece(i: int) -> bytes:
            name = chunk_key(spilled.bucket, spilled.key, spilled.digest, i)
            try:
                entry = await through_failover(lambda: kv.get(name), f"chunks/{name}")
            except jse.KeyNotFoundError:
                raise Superseded(f"{spilled.bucket}/{spilled.key}: chunk {i} of "
                                 f"{spilled.digest[:12]} is gone") from None
            return entry.value or b""

        data = b"".join(await concurrently(piece(i) for i in range(spilled.chunks)))
        if len(data) != spilled.size or hashlib.sha256(data).hexdigest() != spilled.digest:
            raise WireError(f"its {spilled.chunks} chunks hold {len(data)} B that do not hash "
                            f"to {spilled.digest[:12]}",
                            subject=subjects.kv_subject(spilled.bucket, spilled.key),
                            message_type=spilled.of)
        return data

    async def remove(self, bucket: str, key: str, digest: str) -> None:
        """Remove the chunks of ``key``'s value of ``digest`` (a value replaced, or a write
        refused; none there is no error)."""
        stream = subjects.kv_stream(subjects.CHUNKS_BUCKET)
        with contextlib.suppress(jse.NotFoundError):
            await self.js.purge_stream(
                stream, subject=f"$KV.{subjects.CHUNKS_BUCKET}.{bucket}.{key}.{digest}.>")

    async def drop(self, bucket: str, key: str, keep: str | None = None) -> int:
        """Remove every chunk set of ``key`` but ``keep``'s; how many sets were removed.
        Called once the key is deleted (nothing to remove is no error)."""
        stream = subjects.kv_stream(subjects.CHUNKS_BUCKET)
        prefix = f"$KV.{subjects.CHUNKS_BUCKET}.{bucket}.{key}."
        try:
            info = await self.js.stream_info(stream, subjects_filter=f"{prefix}*.*")
        except jse.NotFoundError:
            return 0
        digests = {subject.removeprefix(prefix).split(".")[0]
                   for subject in (info.state.subjects or {})} - {keep}
        for digest in digests:
            await self.js.purge_stream(stream, subject=f"{prefix}{digest}.>")
        return len(digests)

    async def current(self, spilled: Spilled) -> bytes | None:
        """The value now stored under the pointer's key (a newer one, after
        :class:`Superseded`): its own bytes, or its chunks put together; None when the
        key is gone."""
        stream = subjects.kv_stream(spilled.bucket)
        for _ in range(8):
            try:
                msg = await self.js.get_msg(
                    stream, subject=subjects.kv_subject(spilled.bucket, spilled.key))
            except jse.NotFoundError:
                return None
            data = msg.data or b""
            if not data:  # a delete marker
                return None
            newer = pointer(data, subject=subjects.kv_subject(spilled.bucket, spilled.key))
            if newer is None:
                return data
            try:
                return await self.load(newer)
            except Superseded:
                continue
        raise WireError("its chunks were replaced eight times while being read",
                        subject=subjects.kv_subject(spilled.bucket, spilled.key),
                        message_type=spilled.of)
