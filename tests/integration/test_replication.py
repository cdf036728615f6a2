"""Buddy replication over real TCP between two snapshot stores: a committed buffer arrives
committed, checksum-equal, listed for a rank's restore, announced as a buddy copy and
counted against the receiver's bound; an overwritten ring slot is sent again; bad input
(garbage, another version, a wrong checksum, a path in the name, past the bound, an ended
job) is refused with a reply saying why and the listener goes on; a sender that dies
mid-replica leaves nothing a reader trusts; replicas of an earlier membership are pruned
and an ended job's go; with the cluster's replication key, only agents that prove it
send or receive anything; with its replication certificate, the stream is TLS 1.3 and
only agents holding that certificate take part."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from pathlib import Path

import pytest
import uvloop

from phalanx.runtime.snapshot import held_in
from phalanx.schemas import snapshot_file
from phalanx.schemas.errors import ConfigError
from phalanx.schemas.messages import SnapshotRecord, SnapshotReserve, SnapshotTier
from phalanx.services.agent import replica_tls, replication
from phalanx.services.agent.replica_auth import NO_MAC, Handshake
from phalanx.services.agent.replication import ReplicaListener, ReplicaSender
from phalanx.services.agent.snapshots import SnapshotStore
from phalanx.services.auth import tls

JOB = "j"


def commit(path: Path, step: int, shard: int, shards: int, size: int = 3000) -> None:
    """A committed snapshot of ``step`` in the ring buffer at ``path`` (random bytes)."""
    data = bytearray(path.read_bytes())
    header = snapshot_file.Header(JOB, step, 1, shard, shards, size * shards, size * shard,
                                  size, 0, 0)
    payload = os.urandom(size)

    def fill(view: memoryview) -> None:
        view[:] = payload

    snapshot_file.write(memoryview(data), header, b"meta", fill)
    path.write_bytes(bytes(data))


class Pair:
    """Node a's store replicating to node b's listener on 127.0.0.1."""

    def __init__(self, tmp_path: Path, limit: int = 100_000, *, a_key: bytes | None = None,
                 b_key: bytes | None = None, a_tls: ssl.SSLContext | None = None,
                 b_tls: ssl.SSLContext | None = None) -> None:
        self.a = SnapshotStore(tmp_path / "a", 100_000)
        self.b = SnapshotStore(tmp_path / "b", limit)
        self.announced: list[SnapshotRecord] = []
        self.ended: set[str] = set()
        self.listener = ReplicaListener(self.b, "b", self._announce, self.ended.__contains__,
                                        b_key, b_tls)
        self.port = 0
        self.sender = ReplicaSender(self.a, "a", self._buddy, key=a_key, tls=a_tls)

    async def _announce(self, record: SnapshotRecord) -> None:
        self.announced.append(record)

    async def _buddy(self):
        return "b", "127.0.0.1", self.port

    async def __aenter__(self) -> Pair:
        self.port = await self.listener.start("127.0.0.1")
        return self

    async def __aexit__(self, *_) -> None:
        await self.sender.close()
        await self.listener.stop()

    def ring(self, shard: int = 0, shards: int = 2) -> list[Path]:
        return self.a.reserve(SnapshotReserve(job_id=JOB, replica_id=f"r{shard}-0",
                                              shard=shard, shards=shards, nbytes=8192))

    async def connect(self, key: bytes | None = None) -> tuple[asyncio.StreamReader,
                                                               asyncio.StreamWriter, Handshake]:
        """A connection of its own with the handshake done (proving ``key``)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        handshake = Handshake(key, listener=False)
        handshake.theirs = replication.read_hello(await reader.readexactly(replication.HELLO_BYTES))
        writer.write(replication.pack_auth(handshake))
        assert await replication.read_reply(reader) == ""
        await reader.readexactly(32)  # the listener's proof
        return reader, writer, handshake

    async def raw(self, data: bytes, *, greet: bool = True) -> str:
        """Send ``data`` on a connection of its own (after the handshake, if ``greet``);
        the listener's reply."""
        if greet:
            reader, writer, _ = await self.connect()
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            await reader.readexactly(replication.HELLO_BYTES)  # the hello
        writer.write(data)
        await writer.drain()
        try:
            return await replication.read_reply(reader)
        finally:
            writer.close()


async def test_committed_buffers_reach_the_buddy_committed_and_listed(tmp_path) -> None:
    async with Pair(tmp_path) as pair:
        ring = pair.ring(shard=1)
        commit(ring[0], 5, 1, 2)
        commit(ring[1], 6, 1, 2)
        assert await pair.sender.send_pending() == 2
        assert await pair.sender.send_pending() == 0  # nothing new
        replicas = sorted(pair.b.job_dir(JOB).iterdir())
        assert [p.name for p in replicas] == ["buddy.a.w2-s1.0", "buddy.a.w2-s1.1"]
        for source, replica in zip(ring, replicas, strict=True):
            header = snapshot_file.read_header(replica.read_bytes())
            assert header == snapshot_file.read_header(source.read_bytes())
            snapshot_file.verify(memoryview(bytearray(replica.read_bytes())), header)
        # A rank on b lists them as it lists its own node's buffers.
        assert {(h.step, h.shard, h.shards) for h in held_in(pair.b.job_dir(JOB), JOB)} == {
            (5, 1, 2), (6, 1, 2)}
        assert [(r.step, r.tier, r.node_id) for r in pair.announced] == [
            (6, SnapshotTier.BUDDY, "b"), (5, SnapshotTier.BUDDY, "b")]  # newest first
        assert pair.b.used() == sum(p.stat().st_size for p in replicas)
        commit(ring[0], 7, 1, 2)  # the ring overwrites its oldest: sent again
        assert await pair.sender.send_pending() == 1
        assert snapshot_file.committed_header(replicas[0]).step == 7


async def test_a_copy_held_here_is_sent_on_its_own_connection_as_its_owners_replica(
        tmp_path) -> None:
    """A fetch before a restore: a's own buffer and a's replica of node c's buffer each
    reach b as a replica of their owner's ring, committed and checksum-equal, without
    touching the buddy stream; what a does not hold is not found."""
    async with Pair(tmp_path) as pair:
        own = pair.ring(shard=0)
        commit(own[0], 5, 0, 2)
        mirror = pair.a.replica_path(JOB, "c", "w2-s1.0")
        mirror.parent.mkdir(parents=True, exist_ok=True)
        mirror.write_bytes(bytes(own[0].stat().st_size))
        commit(mirror, 5, 1, 2)
        address = ("b", "127.0.0.1", pair.port)
        for shard, owner in ((0, None), (1, "c")):
            found = pair.a.copy_of(JOB, 5, 2, shard)
            assert found is not None and found[2] == owner
            path, header, _ = found
            assert await pair.sender.send_copy(address, path, header, owner or "a") == ""
        assert pair.sender.stream is None  # the buddy's connection was never opened
        assert sorted(p.name for p in pair.b.job_dir(JOB).iterdir()) == [
            "buddy.a.w2-s0.0", "buddy.c.w2-s1.0"]
        for source in (own[0], mirror):
            replica = pair.b.job_dir(JOB) / f"buddy.{'c' if source == mirror else 'a'}." \
                f"{SnapshotStore.ring_of(source)}"
            header = snapshot_file.read_header(replica.read_bytes())
            assert header == snapshot_file.read_header(source.read_bytes())
            snapshot_file.verify(memoryview(bytearray(replica.read_bytes())), header)
        assert {(h.step, h.shard) for h in held_in(pair.b.job_dir(JOB), JOB)} == {
            (5, 0), (5, 1)}
        assert pair.a.copy_of(JOB, 6, 2, 0) is None  # no such step
        assert pair.a.copy_of(JOB, 5, 4, 0) is None  # another membership
        assert pair.a.copy_of("other", 5, 2, 0) is None
        # A copy of b's own ring is refused by b, saying why.
        mirror_of_b = pair.a.replica_path(JOB, "b", "w2-s0.1")
        mirror_of_b.write_bytes(bytes(own[0].stat().st_size))
        commit(mirror_of_b, 6, 0, 2)
        path, header, owner = pair.a.copy_of(JOB, 6, 2, 0)
        assert owner == "b"
        assert "no replica of itself" in await pair.sender.send_copy(address, path, header, "b")


BAD_INPUTS = [
    (lambda offer, block, payload: b"GET / HTTP/1.1\r\n" + bytes(400), "not a phalanx"),
    (lambda offer, block, payload: offer[:7] + bytes([9]) + offer[8:] + block + NO_MAC
     + payload, "version 9; this agent speaks 2"),
    (lambda offer, block, payload: offer + block + NO_MAC + payload[:-1]
     + bytes([payload[-1] ^ 1]), "checksum mismatch"),
    (lambda offer, block, payload: offer + bytes(len(block)) + NO_MAC + payload,
     "never written"),
    (lambda offer, block, payload: replication.pack_offer("a", "../../etc", len(payload))
     + block + NO_MAC + payload, "not a node id and a ring buffer name"),
]


@pytest.mark.parametrize("damage, reason", BAD_INPUTS)
async def test_bad_input_is_refused_saying_why_and_the_listener_goes_on(
        tmp_path, damage, reason) -> None:
    async with Pair(tmp_path) as pair:
        ring = pair.ring()
        commit(ring[0], 5, 0, 2)
        data = ring[0].read_bytes()
        header = snapshot_file.read_header(data)
        block = data[:snapshot_file.HEADER_BYTES]
        payload = data[snapshot_file.HEADER_BYTES:header.nbytes]
        offer = replication.pack_offer("a", ring[0].name, len(payload))
        assert reason in await pair.raw(damage(offer, block, payload))
        assert not held_in(pair.b.job_dir(JOB), JOB)  # nothing a reader trusts
        assert await pair.sender.send_pending() == 1  # and the listener still serves
        assert pair.listener.refused == 1 and pair.listener.taken == 1


async def test_past_the_bound_or_for_an_ended_job_is_refused(tmp_path) -> None:
    async with Pair(tmp_path, limit=2000) as pair:
        commit(pair.ring()[0], 5, 0, 2)
        assert await pair.sender.send_pending() == 0
        assert "over this node's limit of 2000 B" in pair.b.refused
    async with Pair(tmp_path / "2") as pair:
        pair.ended.add(JOB)
        commit(pair.ring()[0], 5, 0, 2)
        assert await pair.sender.send_pending() == 0
        assert not pair.b.job_dir(JOB).exists()


async def test_a_sender_dying_mid_replica_leaves_nothing_trusted(tmp_path, caplog) -> None:
    async with Pair(tmp_path) as pair:
        ring = pair.ring()
        commit(ring[0], 5, 0, 2)
        assert await pair.sender.send_pending() == 1  # step 5 replicated
        await pair.sender.close()
        commit(ring[0], 7, 0, 2)  # the same slot, overwritten
        data = ring[0].read_bytes()
        header = snapshot_file.read_header(data)
        _, writer, _ = await pair.connect()
        writer.write(replication.pack_offer("a", ring[0].name, header.nbytes - 4096)
                     + data[:snapshot_file.HEADER_BYTES] + NO_MAC
                     + data[snapshot_file.HEADER_BYTES:snapshot_file.HEADER_BYTES + 1500])
        await writer.drain()
        with caplog.at_level(logging.WARNING, "phalanx.agent.replication"):
            writer.transport.abort()  # the sender's machine dies
            await pair.listener.wait_closed(2)  # the sender's, then this one
        assert "cut short" in caplog.text and "nothing kept" in caplog.text
        replica = pair.b.job_dir(JOB) / "buddy.a.w2-s0.0"
        assert snapshot_file.committed_header(replica) is None  # marked writing
        assert held_in(pair.b.job_dir(JOB), JOB) == []


KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))


async def test_agents_that_hold_the_replication_key_replicate(tmp_path) -> None:
    async with Pair(tmp_path, a_key=KEY, b_key=KEY) as pair:
        ring = pair.ring()
        commit(ring[0], 5, 0, 2)
        commit(ring[1], 6, 0, 2)
        assert await pair.sender.send_pending() == 2  # two offers sealed on one connection
        assert pair.listener.taken == 2 and pair.listener.refused == 0


@pytest.mark.parametrize("a_key", [None, OTHER_KEY], ids=["no key", "another key"])
async def test_a_sender_that_cannot_prove_the_key_is_refused(tmp_path, caplog,
                                                             a_key: bytes | None) -> None:
    async with Pair(tmp_path, a_key=a_key, b_key=KEY) as pair:
        commit(pair.ring()[0], 5, 0, 2)
        with caplog.at_level(logging.WARNING, "phalanx.agent.replication"):
            assert await pair.sender.send_pending() == 0
        assert pair.sender.failing and pair.listener.refused == 1
        assert "did not prove the cluster's replication key" in caplog.text
        assert not pair.b.job_dir(JOB).exists()  # nothing received, nothing reserved


@pytest.mark.parametrize("b_key", [None, OTHER_KEY], ids=["no key", "another key"])
async def test_a_keyed_sender_sends_nothing_to_a_buddy_that_cannot_prove_it(
        tmp_path, caplog, b_key: bytes | None) -> None:
    async with Pair(tmp_path, a_key=KEY, b_key=b_key) as pair:
        commit(pair.ring()[0], 5, 0, 2)
        with caplog.at_level(logging.WARNING, "phalanx.agent.replication"):
            assert await pair.sender.send_pending() == 0
        assert pair.sender.failing and pair.listener.taken == 0
        assert not pair.b.job_dir(JOB).exists()
        assert "prove" in caplog.text


async def test_an_offer_not_sealed_on_its_connection_is_refused(tmp_path) -> None:
    """A peer past the handshake (a hijacked connection) that cannot seal its offers, or
    replays a seal made for another offer, is refused before anything is reserved."""
    async with Pair(tmp_path, b_key=KEY) as pair:
        ring = pair.ring()
        commit(ring[0], 5, 0, 2)
        data = ring[0].read_bytes()
        block = data[:snapshot_file.HEADER_BYTES]
        payload = data[snapshot_file.HEADER_BYTES:snapshot_file.read_header(data).nbytes]
        offer = replication.pack_offer("a", ring[0].name, len(payload))
        for seal in (lambda h: NO_MAC, lambda h: (h.seal(offer, block), h.seal(offer, block))[1]):
            reader, writer, handshake = await pair.connect(KEY)
            writer.write(offer + block + seal(handshake) + payload)
            assert "not sealed with the cluster's replication key" in \
                await replication.read_reply(reader)
            writer.close()
        assert not pair.b.job_dir(JOB).exists() and pair.listener.refused == 2


def test_replicas_of_an_earlier_membership_are_pruned_and_go_with_the_job(tmp_path) -> None:
    store = SnapshotStore(tmp_path / "b", 100_000)
    old = store.replica_path(JOB, "a", "w4-s1.0")
    new = [store.replica_path(JOB, "a", f"w2-s0.{i}") for i in range(2)]
    for path in (old, *new):
        store.make_room(path, 8192, "test")
    commit(old, 60, 1, 4)
    assert store.prune_replicas(JOB) == 0  # the newest step is of the old membership
    commit(new[0], 61, 0, 2)
    assert store.prune_replicas(JOB) == 0  # one step of the new one
    commit(new[1], 62, 0, 2)
    assert store.prune_replicas(JOB) == 1 and not old.exists()
    assert store.own_rings() == []  # replicas are not this node's own rings
    store.drop(JOB)
    assert store.used() == 0


async def test_the_sender_rests_by_its_duty_cycle(tmp_path) -> None:
    async with Pair(tmp_path) as pair:
        pair.sender.duty = 0.01
        commit(pair.ring()[0], 5, 0, 2)
        busy: list[float] = []
        rests: list[float] = []
        send = pair.sender.send_pending

        async def timed() -> int:
            started = time.monotonic()
            sent = await send()
            busy.append(time.monotonic() - started)
            return sent

        async def sleep_or_stop(rest: float) -> bool:  # records the rest instead of taking it
            rests.append(rest)
            return len(rests) > 3

        pair.sender.send_pending = timed
        await pair.sender.run(sleep_or_stop)
        assert pair.sender.replicated == 1 and len(busy) == 3
        assert rests[0] == replication.SEND_EVERY_S
        for took, rest in zip(busy, rests[1:], strict=True):  # took is within its round
            assert rest >= max(replication.SEND_EVERY_S, took * 99)


async def test_a_buddy_away_is_logged_once_and_retried_until_it_answers(tmp_path,
                                                                          caplog) -> None:
    async with Pair(tmp_path) as pair:
        commit(pair.ring()[0], 5, 0, 2)
        await pair.listener.stop()  # the buddy's agent is away
        with caplog.at_level(logging.WARNING, "phalanx.agent.replication"):
            for _ in range(3):
                assert await pair.sender.send_pending() == 0
        assert caplog.text.count("replication to buddy b") == 1, caplog.text
        await pair.listener.start("127.0.0.1", pair.port)  # back, on the same port
        assert await pair.sender.send_pending() == 1 and not pair.sender.failing


def test_the_listener_and_sender_work_on_uvloop(tmp_path) -> None:
    """The agents run on uvloop, whose transports are not asyncio's classes."""
    uvloop.run(test_committed_buffers_reach_the_buddy_committed_and_listed(tmp_path / "a"))
    for i, (damage, reason) in enumerate(BAD_INPUTS):
        uvloop.run(test_bad_input_is_refused_saying_why_and_the_listener_goes_on(
            tmp_path / f"bad-{i}", damage, reason))


def cluster_tls(directory: Path) -> Path:
    """A cluster's CA, bus server certificate and replication certificate, as
    ``phalanx auth init`` makes them."""
    tls.make_ca_and_server_cert(directory, ["127.0.0.1"])
    tls.make_replication_cert(directory)
    return directory


async def test_with_the_replication_certificate_the_stream_is_tls_and_intact(
        tmp_path) -> None:
    folder = cluster_tls(tmp_path / "tls")
    async with Pair(tmp_path, a_key=KEY, b_key=KEY,
                    a_tls=replica_tls.context(folder, server=False),
                    b_tls=replica_tls.context(folder, server=True)) as pair:
        ring = pair.ring()
        commit(ring[0], 5, 0, 2)
        commit(ring[1], 6, 0, 2)
        assert await pair.sender.send_pending() == 2
        assert pair.listener.taken == 2 and pair.listener.refused == 0
        assert pair.sender.stream is not None
        tls_object = pair.sender.stream[1].get_extra_info("ssl_object")
        assert tls_object is not None and tls_object.version() == "TLSv1.3"
        for source in ring:  # decrypted, the same snapshot, checksum-verified
            replica = pair.b.replica_path(JOB, "a", source.name).read_bytes()
            header = snapshot_file.read_header(replica)
            assert header == snapshot_file.read_header(source.read_bytes())
            snapshot_file.verify(memoryview(bytearray(replica)), header)


def test_over_tls_the_listener_and_sender_work_on_uvloop(tmp_path) -> None:
    uvloop.run(test_with_the_replication_certificate_the_stream_is_tls_and_intact(tmp_path))


def swapped_in_server_cert(folder: Path, into: Path) -> Path:
    """A directory whose "replication" certificate is the bus server's: signed by the
    cluster's CA, but not the replication role's."""
    into.mkdir()
    for name, source in ((tls.CA_CERT, tls.CA_CERT), (tls.REPLICATION_CERT, tls.SERVER_CERT),
                         (tls.REPLICATION_KEY, tls.SERVER_KEY)):
        (into / name).write_bytes((folder / source).read_bytes())
    return into


@pytest.mark.parametrize("sender", ["clear", "another CA", "the bus server's certificate"])
async def test_a_tls_listener_takes_nothing_from_a_sender_without_the_certificate(
        tmp_path, caplog, monkeypatch, sender: str) -> None:
    # A sender in the clear waits for a hello that a TLS listener never sends (it waits
    # for a TLS hello): the sender's I/O timeout ends it.
    monkeypatch.setattr(replication, "IO_TIMEOUT_S", 1.0)
    folder = cluster_tls(tmp_path / "tls")
    a_tls = {"clear": None,
             "another CA": replica_tls.context(cluster_tls(tmp_path / "other"), server=False),
             "the bus server's certificate": replica_tls.context(
                 swapped_in_server_cert(folder, tmp_path / "server"), server=False)}[sender]
    async with Pair(tmp_path, a_tls=a_tls,
                    b_tls=replica_tls.context(folder, server=True)) as pair:
        commit(pair.ring()[0], 5, 0, 2)
        with caplog.at_level(logging.WARNING, "phalanx.agent.replication"):
            assert await pair.sender.send_pending() == 0
        assert pair.sender.failing and pair.listener.taken == 0
        assert not pair.b.job_dir(JOB).exists()  # nothing received, nothing reserved


@pytest.mark.parametrize("listener", ["clear", "another CA", "the bus server's certificate"])
async def test_a_tls_sender_sends_nothing_to_a_listener_without_the_certificate(
        tmp_path, caplog, listener: str) -> None:
    folder = cluster_tls(tmp_path / "tls")
    b_tls = {"clear": None,
             "another CA": replica_tls.context(cluster_tls(tmp_path / "other"), server=True),
             "the bus server's certificate": replica_tls.context(
                 swapped_in_server_cert(folder, tmp_path / "server"), server=True)}[listener]
    async with Pair(tmp_path, a_tls=replica_tls.context(folder, server=False),
                    b_tls=b_tls) as pair:
        commit(pair.ring()[0], 5, 0, 2)
        with caplog.at_level(logging.WARNING, "phalanx.agent.replication"):
            assert await pair.sender.send_pending() == 0
        assert pair.sender.failing and pair.listener.taken == 0
        assert not pair.b.job_dir(JOB).exists()
        if listener == "the bus server's certificate":
            assert "not the cluster's replication certificate" in caplog.text


def test_a_tls_directory_without_the_certificate_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"replication TLS in .*phalanx auth init"):
        replica_tls.context(tmp_path, server=True)
