"""Buddy replication: each agent copies its node's snapshots to its buddy over direct TCP.

The checkpoint service places every node's *buddy*, a live node in another
failure domain (:func:`phalanx.services.checkpoint.core.place_buddies`, KV bucket
``phalanx_buddies``). Each agent runs both sides:

* **A listener** (:class:`ReplicaListener`) on the port its node record
  announces (``NodeInfo.replica_port``), which takes replicas of other nodes'
  ring buffers into this node's store (:meth:`.snapshots.SnapshotStore.replica_path`)
  with the never-torn protocol of :mod:`phalanx.schemas.snapshot_file`: the
  header marked *writing*, the bytes as they arrive, the xxh3-64 checksum
  checked against the sender's header, and only then the commit mark. A
  replica cut short (the sender died, the connection broke) or failing its
  checksum stays marked writing, which no reader trusts, and is logged with
  the byte count reached. Each committed replica is announced to the catalog
  as a ``buddy`` copy held by this node. Bad input (not this protocol, another
  version, a damaged or uncommitted header, a name that is not a ring buffer's,
  a size past the node's snapshot bound, a wrong checksum) is refused with a
  reply saying why, then the connection is closed; the agent goes on.
* **A sender** (:class:`ReplicaSender`) that, every :data:`SEND_EVERY_S`, looks
  for committed buffers of this node's own rings not yet sent to the current
  buddy (their headers only), newest step first, and streams each, read from
  the buffer file, over one connection kept open. It runs in the agent's
  process, never in a rank: training does not wait for it, but on a machine
  whose cores the ranks use the agent's CPU is theirs, so the sender keeps to
  a duty cycle (``AgentConfig.replica_duty``: after sending for t seconds it
  rests t * (1/duty - 1)); the buddy then holds an older step, and newest-first
  means it skips the steps in between, never falling further behind. A buffer the
  rank overwrites while it is being read fails the checksum at the receiver
  and is logged as overtaken (the newer step is sent next). When a ring holds
  older commits not yet sent they follow, so once training stops (all ranks
  killed) every committed buffer reaches the buddy.

The stream opens with the handshake of :mod:`.replica_auth`: the listener's
hello (:data:`_HELLO`: magic ``PHXREPL``, version, its nonce), the sender's
answer (:data:`_AUTH`: magic, version, its nonce, its proof of the cluster's
replication key), the listener's reply (:data:`_REPLY`) followed, when taken, by
its own proof. Then, per replica: an offer (:data:`_OFFER`: magic, version,
source node, ring buffer name, payload bytes), the buffer's 4 KiB header as
written, the MAC sealing both, then its meta and shard bytes; the receiver
answers with one reply (magic, version, ok or refused, a message). Without a
key on either side the proofs are zeros and nothing is checked; the listener
binds the address the node's host name resolves to (the cluster's interface),
not every interface, either way (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import xxhash

from phalanx.schemas import settings, snapshot_file
from phalanx.schemas.messages import SnapshotRecord, SnapshotTier
from phalanx.schemas.snapshot_file import Header, SnapshotFileError
from phalanx.schemas.subjects import token
from phalanx.services.agent import replica_tls
from phalanx.services.agent.replica_auth import MAC_BYTES, NONCE_BYTES, Handshake
from phalanx.services.agent.snapshots import SnapshotRefused, SnapshotStore

log = logging.getLogger("phalanx.agent.replication")

MAGIC = b"PHXREPL"
VERSION = 2
# magic, version, the listener's nonce
_HELLO = struct.Struct(f"<7sB{NONCE_BYTES}s")
HELLO_BYTES = _HELLO.size
# magic, version, the sender's nonce, its proof of the key
_AUTH = struct.Struct(f"<7sB{NONCE_BYTES}s{MAC_BYTES}s")
# magic, version, source node (128 bytes), ring buffer name (64 bytes), payload bytes
_OFFER = struct.Struct("<7sB128s64sQ")
# magic, version, 0 ok / 1 refused, message bytes (the message follows)
_REPLY = struct.Struct("<7sBBH")
CHUNK = 1 << 20
#: How long one read or write of the stream may take before the peer counts as gone.
IO_TIMEOUT_S = 30.0
SEND_EVERY_S = 0.1


class ReplicaRefused(ValueError):
    """The receiver refused a replica (the message says why)."""


# --- the wire --------------------------------------------------------------------------------


def pack_offer(source: str, ring: str, payload: int) -> bytes:
    return _OFFER.pack(MAGIC, VERSION, source.encode(), ring.encode(), payload)


def unpack_offer(data: bytes) -> tuple[str, str, int]:
    """``(source node, ring buffer name, payload bytes)`` of an offer.

    Raises:
        ReplicaRefused: not this protocol, another version, or names that are not ids.
    """
    magic, version, source, ring, payload = _OFFER.unpack(data)
    _check_version(magic, version, data)
    try:
        source_id = token(source.rstrip(b"\0").decode(), "source node")
        return source_id, ring.rstrip(b"\0").decode(), payload
    except (UnicodeDecodeError, ValueError) as exc:
        raise ReplicaRefused(f"bad offer: {exc}") from None


def _check_version(magic: bytes, version: int, data: bytes) -> None:
    """Refuse what is not this protocol at this version.

    Raises:
        ReplicaRefused: not this protocol, or another version of it.
    """
    if magic != MAGIC:
        raise ReplicaRefused(f"not a phalanx replication stream (starts {data[:7]!r})")
    if version != VERSION:
        raise ReplicaRefused(f"replication protocol version {version}; this agent speaks "
                             f"{VERSION}")


def pack_auth(handshake: Handshake) -> bytes:
    """The sender's answer to the listener's hello (whose nonce ``handshake`` holds)."""
    return _AUTH.pack(MAGIC, VERSION, handshake.mine, handshake.proof())


def read_hello(data: bytes) -> bytes:
    """The listener's nonce in its hello.

    Raises:
        ConnectionError: not a phalanx replication listener, or another version.
    """
    magic, version, nonce = _HELLO.unpack(data)
    try:
        _check_version(magic, version, data)
    except ReplicaRefused as exc:
        raise ConnectionError(f"the buddy's listener: {exc}") from None
    return bytes(nonce)


def pack_reply(problem: str = "") -> bytes:
    message = problem.encode()[:4000]
    return _REPLY.pack(MAGIC, VERSION, 1 if problem else 0, len(message)) + message


async def read_reply(reader: asyncio.StreamReader) -> str:
    """The receiver's answer: "" when the replica was taken, else why it was refused."""
    magic, version, refused, size = _REPLY.unpack(await reader.readexactly(_REPLY.size))
    if (magic, version) != (MAGIC, VERSION):
        raise ConnectionError(f"the buddy answered {magic!r} v{version}, not a replica reply")
    message = (await reader.readexactly(size)).decode(errors="replace")
    return (message or "refused") if refused else ""


# --- receiving -------------------------------------------------------------------------------


class ReplicaListener:
    """Takes replicas of other nodes' snapshots into ``store``; announces each.

    Each connection is a :class:`_Replicas` protocol that receives straight into its
    target: the offer and header into small buffers, the bytes into the replica file's
    mapping (one copy, from the socket to the tmpfs pages), checksummed as they land.

    Args:
        store: this node's snapshot store (the bound applies to replicas too).
        node_id: this node (the holder of the replicas it announces).
        announce: publishes a :class:`SnapshotRecord` to the catalog.
        ended: is this job over (its replicas are refused, so nothing outlives it)?
        key: the cluster's replication key (:mod:`.replica_auth`): senders must prove it.
            None: anyone who reaches the port may send.
        tls: the listener's TLS context (:mod:`.replica_tls`): senders speak mutual TLS
            with the cluster's replication certificate. None: the stream is in the clear.
    """

    def __init__(self, store: SnapshotStore, node_id: str,
                 announce: Callable[[SnapshotRecord], Awaitable[None]],
                 ended: Callable[[str], bool], key: bytes | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.store, self.node_id, self.announce, self.ended = store, node_id, announce, ended
        self.key, self.tls = key, tls
        self.server: asyncio.Server | None = None
        self.taken = 0  # replicas committed
        self.refused = 0  # replicas refused or cut short
        self.closed = 0  # connections served to their end
        self._closing = asyncio.Condition()
        self._announcing: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host``:``port`` (0: any free port); returns the port."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Replicas(self), host, port,
                                               ssl=self.tls)
        bound: int = self.server.sockets[0].getsockname()[1]
        return bound

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(IO_TIMEOUT_S):
                    await self.server.wait_closed()
            self.server = None

    async def wait_closed(self, count: int) -> None:
        """Wait until ``count`` connections have been served to their end."""
        async with self._closing:
            await self._closing.wait_for(lambda: self.closed >= count)

    def _ended_connection(self) -> None:
        async def count() -> None:
            async with self._closing:
                self.closed += 1
                self._closing.notify_all()

        self._spawn(count())

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    def _taken(self, header: Header, source: str, ring: str, what: str) -> None:
        """Announce a committed replica (kept either way: a rank's restore lists the
        store, not the catalog)."""
        self.taken += 1

        async def announce() -> None:
            try:
                await self.announce(SnapshotRecord(
                    job_id=header.job_id, step=header.step, shard=header.shard,
                    num_shards=header.shards, node_id=self.node_id, tier=SnapshotTier.BUDDY,
                    nbytes=header.length, checksum=f"{header.checksum:016x}",
                    created_at=time.time(), generation=header.generation,
                    total_bytes=header.total, detail=f"replica of {source}'s {ring}",
                    column=header.column, columns=header.columns))
            except Exception as exc:
                log.warning("%s kept but not announced to the catalog: %s", what, exc)

        self._spawn(announce())

    def _target(self, source: str, ring: str, header: Header, payload: int,
                what: str) -> Path:
        """Where the replica ``header`` names goes, made room for.

        Raises:
            ReplicaRefused, SnapshotRefused: it is not taken (the message says why).
        """
        if header.meta_length + header.length != payload:
            raise ReplicaRefused(f"the offer announces {payload} B, the header "
                                 f"{header.meta_length + header.length} B")
        if source == self.node_id:
            raise ReplicaRefused(f"{source} is this node: no replica of itself")
        if self.ended(header.job_id):
            raise ReplicaRefused(f"job {header.job_id} has ended")
        try:
            token(header.job_id, "job id")
            path = self.store.replica_path(header.job_id, source, ring)
        except ValueError as exc:
            raise ReplicaRefused(str(exc)) from None
        self.store.make_room(path, header.nbytes, what)
        return path


class _Replicas(asyncio.BufferedProtocol):
    """One sender's connection: offers, headers and bytes in turn, each received into
    where it belongs (:class:`ReplicaListener`). A refusal is answered and the connection
    closed (its position in the stream is lost); silence mid-replica for IO_TIMEOUT_S
    counts as the sender gone."""

    def __init__(self, listener: ReplicaListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.peer = None
        self.what = "replica"
        self.timer: asyncio.TimerHandle | None = None
        self.replica: tuple[mmap.mmap, Header, str, str] | None = None  # buffer, header, ...
        self.digest = xxhash.xxh3_64()
        self.handshake = Handshake(listener.key, listener=True)
        self._expect(bytearray(_AUTH.size), self._authed)

    def _expect(self, into: bytearray | memoryview, then: Callable[[], None]) -> None:
        self.view, self.got, self.then = memoryview(into), 0, then

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.peer = transport.get_extra_info("peername")
        self.what = f"replica from {self.peer}"
        assert self.transport is not None
        if self.listener.tls is not None:  # its TLS handshake is done: who is it?
            problem = replica_tls.peer_problem(transport.get_extra_info("peercert"))
            if problem:
                self.listener.refused += 1
                log.warning("replication peer %s refused: %s", self.peer, problem)
                self._abort()
                return
        self.transport.write(_HELLO.pack(MAGIC, VERSION, self.handshake.mine))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.replica is not None:  # the bytes: checksummed where they landed
            self.digest.update(self.view[self.got:self.got + nbytes])
            self._arm()
        self.got += nbytes
        if self.got == len(self.view):
            try:
                self.then()
            except (ReplicaRefused, SnapshotFileError, SnapshotRefused) as exc:
                self._refuse(str(exc) or type(exc).__name__)
            except Exception:  # one peer's trouble never stops the agent
                log.exception("%s failed", self.what)
                self._abort()

    def _authed(self) -> None:
        data = bytes(self.view)
        magic, version, nonce, proof = _AUTH.unpack(data)
        _check_version(magic, version, data)
        self.handshake.theirs = nonce
        if not self.handshake.proven(proof):
            raise ReplicaRefused("the sender did not prove the cluster's replication key "
                                 f"({settings.AGENT('replica_key_file')})")
        assert self.transport is not None
        self.transport.write(pack_reply() + self.handshake.proof())
        self._expect(bytearray(_OFFER.size), self._offered)

    def _offered(self) -> None:
        offer = bytes(self.view)
        source, ring, payload = unpack_offer(offer)
        self.what = f"replica of {source}'s {ring} (from {self.peer})"
        self._expect(bytearray(snapshot_file.HEADER_BYTES + MAC_BYTES),
                     lambda: self._headed(offer, source, ring, payload))
        self._arm()

    def _headed(self, offer: bytes, source: str, ring: str, payload: int) -> None:
        block = bytes(self.view[:snapshot_file.HEADER_BYTES])
        if not self.handshake.opened(offer, block, bytes(self.view[len(block):])):
            raise ReplicaRefused("the offer is not sealed with the cluster's replication "
                                 "key on this connection")
        header = snapshot_file.read_header(block)
        self.what = (f"replica of {source}'s shard {header.shard}/{header.shards} of "
                     f"{header.job_id} step {header.step} (from {self.peer})")
        path = self.listener._target(source, ring, header, payload, self.what)
        fd = os.open(path, os.O_RDWR)
        try:
            buffer = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        snapshot_file.begin(buffer, header)
        self.replica, self.digest = (buffer, header, source, ring), xxhash.xxh3_64()
        start = snapshot_file.HEADER_BYTES
        self._expect(memoryview(buffer)[start:start + payload], self._received)
        if not payload:
            self._received()

    def _received(self) -> None:
        assert self.replica is not None and self.transport is not None
        buffer, header, source, ring = self.replica
        self._drop()  # committed below, or left marked writing
        if self.digest.intdigest() != header.checksum:
            raise ReplicaRefused(f"checksum mismatch: shard {header.shard} of step "
                                 f"{header.step} arrived damaged (or overtaken at the "
                                 f"sender)")
        snapshot_file.commit(buffer, header)
        self._disarm()
        self.listener._taken(header, source, ring, self.what)
        self.transport.write(pack_reply())
        self._expect(bytearray(_OFFER.size), self._offered)

    def _drop(self) -> None:
        """Let go of the replica's mapping: closed once the transport's receive into it
        has returned (a mapping cannot close while a view of it lives)."""
        if self.replica is not None:
            asyncio.get_running_loop().call_soon(_close, self.replica[0])
            self.replica = None
            self.view.release()

    def _refuse(self, problem: str) -> None:
        assert self.transport is not None
        self.listener.refused += 1
        log.warning("%s refused: %s", self.what, problem)
        self._done()
        self.transport.write(pack_reply(problem))
        self.transport.close()  # the stream's position is unknown after a refusal

    def _abort(self) -> None:
        self._done()
        if self.transport is not None:
            self.transport.abort()

    def _done(self) -> None:
        """Nothing more is taken from this connection (its end was logged already)."""
        self._drop()
        self._expect(bytearray(4096), self._discard)

    def _discard(self) -> None:
        self.got = 0  # bytes still in flight after a refusal, until the close lands

    def _arm(self) -> None:
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(IO_TIMEOUT_S, self._stalled)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _stalled(self) -> None:
        self.listener.refused += 1
        log.warning("%s: nothing for %g s mid-replica; the sender counts as gone, nothing "
                    "kept", self.what, IO_TIMEOUT_S)
        self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.replica is not None:
            self.listener.refused += 1
            log.warning("%s cut short after %d of %d bytes (the sender closed: %r): nothing "
                        "kept", self.what, self.got, len(self.view), exc)
            self._drop()
        elif self.got and self.then in (self._offered, self._authed):
            log.warning("replication peer %s closed mid-%s (%d of %d bytes)", self.peer,
                        "offer" if self.then == self._offered else "handshake", self.got,
                        len(self.view))
        elif self.got:
            self.listener.refused += 1
            log.warning("%s cut short in its header: nothing kept", self.what)
        self.listener._ended_connection()


def _close(buffer: mmap.mmap) -> None:
    try:
        buffer.close()
    except BufferError:  # still viewed (should not be): the mapping goes with the views
        log.debug("a replica's mapping outlived its receive")


# --- sending ---------------------------------------------------------------------------------

#: Where a buddy listens: (its node id, host, port).
Address = tuple[str, str, int]


class ReplicaSender:
    """Streams this node's committed snapshot buffers to its buddy in the background.

    Args:
        store: this node's snapshot store (its own rings are sent).
        node_id: this node.
        buddy: the current buddy's address, or None while there is none (the placement
            is missing, the buddy's listener unknown).
        duty: the most of its time spent sending (1: send whenever something is pending).
        key: the cluster's replication key (:mod:`.replica_auth`): proven to the buddy, and
            nothing is sent to one that cannot prove it back. None: no proof either way.
        tls: the sender's TLS context (:mod:`.replica_tls`): nothing is sent to a buddy
            that does not present the cluster's replication certificate. None: in the clear.
    """

    def __init__(self, store: SnapshotStore, node_id: str,
                 buddy: Callable[[], Awaitable[Address | None]], duty: float = 1.0,
                 key: bytes | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.store, self.node_id, self.buddy, self.duty = store, node_id, buddy, duty
        self.key, self.tls = key, tls
        self.sent: dict[Path, tuple[int, int, int]] = {}  # buffer -> step, generation, sum
        self.address: Address | None = None
        self.stream: tuple[asyncio.StreamReader, asyncio.StreamWriter, Handshake] | None = None
        self.replicated = 0  # replicas the buddy took
        self.failing = False  # the last attempt to reach the buddy failed (logged once)
        self.sent_bytes = 0

    def pending(self) -> list[tuple[Path, Header]]:
        """Committed buffers of this node's rings the buddy does not have, newest first."""
        found = []
        for path in self.store.own_rings():
            header = snapshot_file.committed_header(path)
            if header is not None and self.sent.get(path) != _key(header):
                found.append((path, header))
        return sorted(found, key=lambda item: -item[1].step)

    async def run(self, sleep_or_stop: Callable[[float], Awaitable[bool]]) -> None:
        """Send what is pending every SEND_EVERY_S, resting as the duty cycle says, until
        ``sleep_or_stop`` says stop."""
        rest = SEND_EVERY_S
        try:
            while not await sleep_or_stop(rest):
                started = time.monotonic()
                await self.send_pending()
                busy = time.monotonic() - started
                rest = max(SEND_EVERY_S, busy * (1 / self.duty - 1))
        finally:
            await self.close()

    async def send_pending(self) -> int:
        """Send every pending buffer to the current buddy; returns how many it took."""
        address = await self.buddy()
        if address != self.address:  # a new buddy holds nothing of ours yet
            await self.close()
            self.sent.clear()
            self.address, self.failing = address, False
            if address is not None:
                log.info("replicating to buddy %s at %s:%d", *address)
        if address is None:
            return 0
        taken = 0
        for path, header in self.pending():
            try:
                problem = await self._send(address, path, header)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                if not self.failing:  # once, not at every retry while the buddy is away
                    log.warning("replication to buddy %s at %s:%d failed (%r); retrying "
                                "until it answers or another buddy is placed", *address, exc)
                self.failing = True
                await self.close()
                return taken
            if self.failing:
                log.info("buddy %s at %s:%d answers again", *address)
                self.failing = False
            if problem is None:
                continue  # overwritten since it was listed or sent: the newer one is pending
            if problem:
                log.warning("buddy %s refused %s: %s", address[0], path.name, problem)
                await self.close()
            else:
                taken += 1
                self.replicated += 1
            # Sent either way: a refused buffer is not offered again until it changes.
            self.sent[path] = _key(header)
        return taken

    async def send_copy(self, address: Address, path: Path, listed: Header,
                        owner: str) -> str:
        """Stream one copy held here (``owner``'s ring buffer or a replica of it) to the
        listener at ``address`` on a connection of its own, not the buddy's: its answer
        ("" taken, else why not).

        Raises:
            OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError: the
                listener could not be reached, or the stream broke.
        """
        once = ReplicaSender(self.store, self.node_id, _no_buddy, key=self.key, tls=self.tls)
        try:
            problem = await once._send(address, path, listed, owner)
        finally:
            await once.close()
        self.sent_bytes += once.sent_bytes
        return f"{path.name} was overwritten meanwhile" if problem is None else problem

    async def _send(self, address: Address, path: Path, listed: Header,
                    owner: str | None = None) -> str | None:
        """Stream the buffer at ``path`` (a ring of ``owner``'s, by default this node's);
        the listener's answer ("" taken), None if the buffer no longer holds the snapshot
        ``listed`` names."""
        with path.open("rb") as f:
            block = f.read(snapshot_file.HEADER_BYTES)
            try:
                header = snapshot_file.read_header(block)
            except SnapshotFileError:
                return None
            if _key(header) != _key(listed):
                return None
            reader, writer, handshake = await self._connect(address)
            payload = header.meta_length + header.length
            offer = pack_offer(owner or self.node_id, SnapshotStore.ring_of(path), payload)
            writer.write(offer + block + handshake.seal(offer, block))
            left = payload
            while left:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{path.name} ended {left} bytes early")
                writer.write(chunk)
                left -= len(chunk)
                async with asyncio.timeout(IO_TIMEOUT_S):
                    await writer.drain()
        async with asyncio.timeout(IO_TIMEOUT_S):
            problem = await read_reply(reader)
        self.sent_bytes += payload
        if problem and snapshot_file.committed_header(path) != header:
            log.info("%s was overwritten by a newer snapshot while being sent", path.name)
            await self.close()  # the buddy closes after a refusal
            return None
        return problem

    async def _connect(self, address: Address) -> tuple[asyncio.StreamReader,
                                                         asyncio.StreamWriter, Handshake]:
        """The connection to the buddy at ``address``, its handshake done.

        Raises:
            ConnectionError: the buddy refused this sender, or cannot prove the key.
        """
        if self.stream is None:
            async with asyncio.timeout(IO_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(address[1], address[2],
                                                               ssl=self.tls)
                try:
                    if self.tls is not None:
                        problem = replica_tls.peer_problem(writer.get_extra_info("peercert"))
                        if problem:
                            raise ConnectionError(f"the buddy's listener: {problem}")
                    handshake = Handshake(self.key, listener=False)
                    handshake.theirs = read_hello(await reader.readexactly(_HELLO.size))
                    writer.write(pack_auth(handshake))
                    problem = await read_reply(reader)
                    if problem:
                        raise ConnectionError(f"the buddy refused this node: {problem}")
                    if not handshake.proven(await reader.readexactly(MAC_BYTES)):
                        raise ConnectionError("the buddy did not prove the cluster's "
                                              "replication key: no snapshot is sent to it")
                except BaseException:
                    writer.close()
                    raise
            self.stream = reader, writer, handshake
        return self.stream

    async def close(self) -> None:
        if self.stream is not None:
            _, writer, _ = self.stream
            self.stream = None
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _no_buddy() -> Address | None:
    return None


def _key(header: Header) -> tuple[int, int, int]:
    return header.step, header.generation, header.checksum
