"""Every outcome of a conditional KV write is an answer, on real nats-servers.

A create or update refused with "wrong last sequence" is looked up in the key's last
message on the stream's leader, and that read may find a deletion marker (written
again at its revision), another writer's value (a conflict), or nothing at all: the
key emptied since (a TTL, a subject purge), or another writer's create still in flight
on a replicated bucket. nats-py's own ``create`` raises ``KeyNotFoundError`` for the
last case; a leader service's lease task died of exactly that (issue 49).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import nats.js.errors as jse
import pytest
from nats.js.api import KeyValueConfig

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import Conflict
from phalanx.bus.kv import TypedKV
from phalanx.schemas.messages import Lease
from phalanx.services import metrics
from phalanx.services.deadline import wait_set
from phalanx.services.lease import Leadership
from phalanx.services.natsd import NatsCluster


def lease(holder: str, epoch: int = 1) -> Lease:
    return Lease(holder=holder, epoch=epoch, expires_at=1e9)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path / "js", 3, log_dir=tmp_path) as running:
        yield running


async def test_a_create_racing_one_in_flight_on_a_replicated_bucket_loses_cleanly(
        cluster: NatsCluster, uid: str) -> None:
    """The stream's leader refuses a write to a key while another write to it is
    proposed and not yet stored, and a read of the key finds nothing then. With the
    followers paused the proposal cannot commit, so the race is held open: a lease
    check meeting it stands by, and the create in flight wins once they are back."""
    config = BusConfig.load(env={"PHALANX_NATS_REPLICAS": "3"}, servers=",".join(cluster.urls))
    bucket = f"leases_{uid}"
    async with await Bus.connect(config, name="setup") as setup:
        await TypedKV.open(setup.js, bucket, Lease)
        info = (await setup.js.stream_info(f"KV_{bucket}")).cluster
    assert info is not None and info.replicas is not None
    names = [s.routes.server_name if s.routes else "" for s in cluster.servers]
    followers = [names.index(r.name) for r in info.replicas]
    leader = names.index(info.leader or "")
    assert len(followers) == 2
    metrics.register(metrics.LEADERSHIP)
    # Connected to the leader alone, every request of this client is answered while the
    # followers are paused, and in the order it was sent.
    only_leader = BusConfig.load(env={}, servers=cluster.urls[leader])
    async with await Bus.connect(only_leader, name="test") as bus:
        kv = await TypedKV.open(bus.js, bucket, Lease)
        proposed = await bus.nc.subscribe(f"$KV.{bucket}.svc")

        first_leads = asyncio.Event()

        async def lead_first() -> None:
            first_leads.set()
            await asyncio.Event().wait()

        async def lead() -> None:
            await asyncio.Event().wait()

        first = Leadership(kv, "svc", "first", 0.6, lead_first, bus_config=bus.config)
        second = Leadership(kv, "svc", "second", 3.0, lead, bus_config=bus.config)
        for i in followers:
            os.kill(cluster.servers[i].process.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            taking = asyncio.create_task(first._check())
            await proposed.next_msg(timeout=30)  # the leader has it: proposed, not stored
            await proposed.unsubscribe()  # a drain would wait on what it holds unread
            with pytest.raises(Conflict, match="already exists"):
                await kv.create("svc", lease("raw"))
            await second._check()  # refused while "first" is in flight: no error, no lead
            assert not second.leading
        finally:
            for i in followers:
                os.kill(cluster.servers[i].process.pid, signal.SIGCONT)  # type: ignore[union-attr]
        await taking
        # Its create is stored once the followers are back. If its attempt went unanswered
        # for the publish timeout meanwhile (a loaded machine), its retries met its own
        # proposal in flight and it stood by: its loop's next check finds the lease its
        # own and leads.
        stop = asyncio.Event()
        running = asyncio.create_task(first.run(lambda s: wait_set(stop, s)))
        try:
            await asyncio.wait_for(first_leads.wait(), 30)
            entry = await kv.get("svc")
            assert entry is not None and entry.value.holder == "first"
            assert not second.leading
        finally:
            stop.set()
            await running


async def test_a_create_in_flight_beside_a_stored_one_is_refused_not_lost(
        bus: Bus, uid: str) -> None:
    """The in-flight race's companion on one server: ``raw`` exists, so a create is a
    conflict naming the key, and nothing is overwritten."""
    kv = await TypedKV.open(bus.js, f"outcomes_{uid}", Lease)
    await kv.create("k", lease("a"))
    with pytest.raises(Conflict, match=f"outcomes_{uid}/k already exists"):
        await kv.create("k", lease("b"))
    entry = await kv.get("k")
    assert entry is not None and entry.value.holder == "a"


async def test_a_key_emptied_between_the_refusal_and_the_read_is_created(
        bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write is refused because the key holds a value; before the refusal is looked
    up, every message of the key is removed (as a subject purge or a TTL does). The
    create is then answered by creating the key at revision 0."""
    bucket = f"emptied_{uid}"
    kv = await TypedKV.open(bus.js, bucket, Lease)
    await kv.put("k", lease("expiring"))
    publish = kv.kv._js.publish
    purged: list[str] = []

    async def refused_then_emptied(subject: str, payload: bytes = b"", **kwargs: object):
        try:
            return await publish(subject, payload, **kwargs)  # type: ignore[arg-type]
        except jse.APIError as exc:
            if exc.err_code in (10071, 10164) and not purged:
                await bus.js.purge_stream(f"KV_{bucket}", subject=subject)
                purged.append(subject)
            raise

    monkeypatch.setattr(kv.kv._js, "publish", refused_then_emptied)
    revision = await kv.create("k", lease("new"))
    assert purged == [f"$KV.{bucket}.k"]
    entry = await kv.get("k")
    assert entry is not None and entry.value.holder == "new" and entry.revision == revision


async def test_a_key_whose_ttl_ran_out_reads_absent_and_is_created_again(
        bus: Bus, uid: str) -> None:
    """On a bucket with limit markers the server replaces an expired message by a
    marker of its own (``Nats-Marker-Reason``, no ``KV-Operation``): that is a deletion,
    not a value that does not decode, and a create over it succeeds at its revision."""
    bucket = f"ttl_{uid}"
    await bus.js.create_key_value(KeyValueConfig(bucket=bucket, limit_marker_ttl=60))
    kv = await TypedKV.open(bus.js, bucket, Lease)
    await kv.kv.create("k", b"\x00", msg_ttl=1)  # someone else's entry, gone in a second
    stream = f"KV_{bucket}"
    for _ in range(100):  # the server expires it within a second or two of its TTL
        if (await bus.js.stream_info(stream)).state.last_seq > 1:
            break
        await asyncio.sleep(0.1)
    marker = await bus.js.get_msg(stream, subject=f"$KV.{bucket}.k")
    assert marker.headers and "Nats-Marker-Reason" in marker.headers
    assert await kv.get("k") is None
    assert await kv.current("k") == (None, 0)
    revision = await kv.create("k", lease("after"))
    assert revision > (marker.seq or 0)
    assert kv.counters.bad_messages == 0


async def test_a_create_over_delete_and_purge_markers_takes_the_markers_revision(
        bus: Bus, uid: str) -> None:
    kv = await TypedKV.open(bus.js, f"markers_{uid}", Lease)
    for remove in (kv.kv.delete, kv.kv.purge):
        revision = await kv.put("k", lease("old"))
        await remove("k")
        assert await kv.get("k") is None
        created = await kv.create("k", lease("new"))
        assert created > revision
        with pytest.raises(Conflict):
            await kv.create("k", lease("late"))


async def test_a_lease_check_that_fails_unexpectedly_steps_down_and_leads_again(
        bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error the lease does not know (here the one nats-py raised in issue 49) ends
    neither its loop nor its service: the work is cancelled, and the next check leads
    again from a fresh read."""
    leases = await TypedKV.open(bus.js, f"leases_{uid}", Lease)
    metrics.register(metrics.LEADERSHIP)
    terms, stop = asyncio.Queue[asyncio.Event](), asyncio.Event()

    async def lead() -> None:
        ended = asyncio.Event()
        terms.put_nowait(ended)
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    leadership = Leadership(leases, "svc", "me", 0.6, lead, bus_config=bus.config)
    update = TypedKV.update
    failures = 0

    async def failing_once(self: TypedKV[Lease], key: str, value: Lease,
                           revision: int) -> int:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise jse.KeyNotFoundError
        return await update(self, key, value, revision)

    running = asyncio.create_task(leadership.run(lambda s: wait_set(stop, s)))
    try:
        first = await asyncio.wait_for(terms.get(), 10)
        # The next renewal fails (on the lease's own thread and connection: the class's).
        monkeypatch.setattr(TypedKV, "update", failing_once)
        assert await wait_set(first, 10)
        second = await asyncio.wait_for(terms.get(), 10)
        assert failures == 1 and not second.is_set() and leadership.leading
        assert not running.done()
    finally:
        stop.set()
        await running
    assert await leases.get("svc") is None  # released at the stop
