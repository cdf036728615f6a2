"""The bus layer over a real nats-server: typed pub/sub, requests, errors, KV."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import BusUnavailable, Conflict, NoResponders, RemoteError, RequestTimeout
from phalanx.bus.kv import TypedKV
from phalanx.schemas.codec import encode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import NodeHeartbeat, NodeInfo, NodeRecord, NodeStatusRequest


def beat(node: str, seq: int) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, seq=seq, sent_at=1.0)


def record(node: str, seq: int = 0) -> NodeRecord:
    info = NodeInfo(node_id=node, host="h", slots=4, failure_domain="d")
    return NodeRecord(node=info, heartbeat_seq=seq, heartbeat_at=1.0)


async def test_publish_subscribe_delivers_typed_messages(bus: Bus, uid: str) -> None:
    got: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

    async def on_beat(msg: NodeHeartbeat, _: Delivery) -> None:
        await got.put(msg)

    await bus.subscribe(f"t.{uid}", NodeHeartbeat, on_beat)
    await bus.publish(f"t.{uid}", beat(uid, 7))
    assert await asyncio.wait_for(got.get(), 5) == beat(uid, 7)


async def test_garbage_is_counted_and_dropped_and_subscription_survives(bus: Bus, uid: str) -> None:
    got: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

    async def on_beat(msg: NodeHeartbeat, _: Delivery) -> None:
        await got.put(msg)

    await bus.subscribe(f"t.{uid}", NodeHeartbeat, on_beat)
    before = bus.counters.bad_messages
    for junk in (b"\xc1\xc1", b"", msgspec.msgpack.encode({"type": "nope"}),
                 encode(NodeStatusRequest())):
        await bus.nc.publish(f"t.{uid}", junk)
    await bus.publish(f"t.{uid}", beat(uid, 1))
    assert await asyncio.wait_for(got.get(), 5) == beat(uid, 1)
    assert bus.counters.bad_messages - before == 4
    assert got.empty()


async def test_request_reply_and_error_replies(bus: Bus, uid: str) -> None:
    async def status(_: NodeStatusRequest, __: Delivery) -> NodeRecord:
        return record(uid)

    await bus.subscribe(f"t.{uid}.status", NodeStatusRequest, status)
    assert await bus.request(f"t.{uid}.status", NodeStatusRequest(), NodeRecord) == record(uid)

    # A request with a bad payload gets a 400 naming the problem.
    reply = await bus.nc.request(f"t.{uid}.status", b"\x01garbage", timeout=2)
    assert reply.headers["Nats-Service-Error-Code"] == "400"
    assert "not MessagePack" in reply.headers["Nats-Service-Error"] or \
        "phalanx.node_status_request.v1" in reply.headers["Nats-Service-Error"]


async def test_handler_failure_is_a_500_and_the_subscription_lives_on(bus: Bus, uid: str) -> None:
    calls = 0

    async def flaky(_: NodeStatusRequest, __: Delivery) -> NodeRecord:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("disk on fire")
        return record(uid)

    await bus.subscribe(f"t.{uid}.flaky", NodeStatusRequest, flaky)
    with pytest.raises(RemoteError) as err:
        await bus.request(f"t.{uid}.flaky", NodeStatusRequest(), NodeRecord)
    assert err.value.code == "500" and "disk on fire" in err.value.description
    assert await bus.request(f"t.{uid}.flaky", NodeStatusRequest(), NodeRecord) == record(uid)
    assert bus.counters.handler_errors >= 1


async def test_request_errors_name_the_subject(bus: Bus, uid: str) -> None:
    with pytest.raises(NoResponders, match=f"t.{uid}.nobody"):
        await bus.request(f"t.{uid}.nobody", NodeStatusRequest(), NodeRecord, timeout_s=1)

    async def silent(msg):  # raw responder that never answers
        return None

    await bus.nc.subscribe(f"t.{uid}.silent", cb=silent)
    with pytest.raises(RequestTimeout, match="within 0.2 s"):
        await bus.request(f"t.{uid}.silent", NodeStatusRequest(), NodeRecord, timeout_s=0.2)


async def test_reply_of_the_wrong_type_is_a_wire_error(bus: Bus, uid: str) -> None:
    async def wrong(msg):
        await msg.respond(encode(beat(uid, 1)))

    await bus.nc.subscribe(f"t.{uid}.wrong", cb=wrong)
    with pytest.raises(WireError, match="got a phalanx.node_heartbeat.v1 message"):
        await bus.request(f"t.{uid}.wrong", NodeStatusRequest(), NodeRecord)


async def test_connect_to_nothing_fails_clearly_and_fast() -> None:
    config = BusConfig.load(env={}, servers=["nats://127.0.0.1:1"], connect_timeout_s=1.0)
    with pytest.raises(BusUnavailable, match="cannot reach NATS at nats://127.0.0.1:1"):
        await Bus.connect(config)


async def test_kv_create_update_cas_and_modify(bus: Bus, uid: str) -> None:
    kv = await TypedKV.open(bus.js, "phalanx_test", NodeRecord)
    rev = await kv.create(uid, record(uid, 0))
    with pytest.raises(Conflict, match="already exists"):
        await kv.create(uid, record(uid, 1))
    rev2 = await kv.update(uid, record(uid, 1), rev)
    with pytest.raises(Conflict, match=f"since revision {rev}"):
        await kv.update(uid, record(uid, 2), rev)  # stale revision
    entry = await kv.get(uid)
    assert entry is not None and entry.revision == rev2 and entry.value.heartbeat_seq == 1

    # Concurrent modifies never lose an increment.
    def bump(current: NodeRecord | None) -> NodeRecord:
        assert current is not None
        return record(uid, current.heartbeat_seq + 1)

    await asyncio.gather(*(kv.modify(uid, bump) for _ in range(10)))
    final = await kv.get(uid)
    assert final is not None and final.value.heartbeat_seq == 11

    with pytest.raises(Conflict):
        await kv.delete(uid, revision=rev2)  # moved on since
    await kv.delete(uid, revision=final.revision)
    assert await kv.get(uid) is None


async def test_kv_entries_skip_corrupt_values_and_report_them(bus: Bus, uid: str) -> None:
    kv = await TypedKV.open(bus.js, f"phalanx_test_{uid}", NodeRecord)
    await kv.put("good", record("good"))
    await kv.kv.put("bad", b"\x00not a record")
    entries, errors = await kv.entries()
    assert [e.key for e in entries] == ["good"]
    assert len(errors) == 1 and "bad" in errors[0].subject


async def test_round_trips_that_give_up_leave_the_connection_reading(
        bus_config: BusConfig, uid: str) -> None:
    """A round trip that gives up before its PONG (here: at once) answers False, and the
    late PONG does not stop the connection reading. nats-py's own flush with a timeout
    that expires cancels the PONG's future but keeps it queued, and its read loop then
    dies on the late PONG: nothing more is received, which is what made health blind."""
    async with await Bus.connect(bus_config) as bus:
        got: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

        async def on_beat(msg: NodeHeartbeat, _: Delivery) -> None:
            await got.put(msg)

        await bus.subscribe(f"t.{uid}", NodeHeartbeat, on_beat)
        for _ in range(5):
            assert await bus.round_trip(1e-9) is False
        assert await bus.round_trip(10.0)  # after every abandoned PONG came in
        for seq in range(3):
            await bus.publish(f"t.{uid}", beat(uid, seq))
        assert [(await asyncio.wait_for(got.get(), 10)).seq for _ in range(3)] == [0, 1, 2]


async def test_a_cancellation_at_any_point_of_subscribing_ends_the_task_and_its_subscription(
        bus: Bus, uid: str) -> None:
    """Cancel a KV watch and a subscription at every point of their start, in turn.

    nats-py can swallow a cancellation there (a JetStream consumer is made by a request,
    whose ``wait_for`` returns the reply if both arrive together on Python 3.11): the
    watch went on waiting for changes and whoever cancelled it waited forever (a
    ``TypedKV.follow`` whose close hung in CI). Every task must end, cancelled, and
    leave no subscription behind. Without the fix this hung 2 times in 240."""
    kv = await TypedKV.open(bus.js, f"cancel_{uid}", NodeRecord)
    await kv.put("n", record("n"))

    async def watch() -> None:
        async for _ in kv.watch():
            pass

    async def subscribe() -> None:
        async def ignore(_: NodeHeartbeat, __: Delivery) -> None:
            pass
        subscription = await bus.subscribe(f"t.{uid}", NodeHeartbeat, ignore)
        try:
            await asyncio.Event().wait()
        finally:
            await subscription.unsubscribe()

    baseline = len(bus.nc._subs)
    for start in (watch, subscribe):
        for loop_turns in range(80):
            task = asyncio.create_task(start())
            for _ in range(loop_turns):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=10)
            assert done, f"{start.__name__} cancelled after {loop_turns} loop turns never ended"
            assert task.cancelled(), f"{start.__name__} ended but not cancelled: {task}"
            assert len(bus.nc._subs) == baseline, f"{start.__name__} left a subscription"


async def test_closing_with_a_message_left_unread_does_not_wait_for_it(
        bus_config: BusConfig, bus: Bus, uid: str) -> None:
    """A subscription read with ``next_msg`` and a message left in it: the drain waited
    its whole timeout (30 s) for a reader that never comes (a test's teardown did)."""
    reader = await Bus.connect(bus_config, name="reader")
    unread = await reader.nc.subscribe(f"test.{uid}")
    assert await reader.round_trip(10)  # the server has the subscription before the publish
    await bus.nc.publish(f"test.{uid}", b"one")
    await bus.nc.publish(f"test.{uid}", b"two")
    assert (await unread.next_msg(timeout=10)).data == b"one"
    closing = asyncio.create_task(reader.close())
    done, _ = await asyncio.wait({closing}, timeout=10)  # not cancelled: it would give up
    await closing
    assert closing in done and reader.nc.is_closed
