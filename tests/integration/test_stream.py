"""The job-events stream on a real nats-server: events kept, read from a cursor, in order,
once each, across a restart of the server on the same store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js.api import StorageType, StreamConfig

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.stream import KINDS, EventReader, StreamEvent, ensure_job_events, last_seq
from phalanx.schemas import subjects
from phalanx.schemas.messages import ExitCause, GenerationGivenUp, RankExited, ReplicaReady
from phalanx.services.natsd import NatsServer
from phalanx.services.ports import free_port


def exited(job_id: str, rank: int) -> RankExited:
    return RankExited(job_id=job_id, rank=rank, node_id="n0", pid=100 + rank,
                      cause=ExitCause.EXITED, exited_at=1.0, exit_code=1, replica_id=f"r{rank}-0")


async def take(events, n: int) -> list[StreamEvent]:
    got = []
    async for event in events:
        got.append(event)
        if len(got) == n:
            return got
    return got


async def test_a_reader_from_a_cursor_sees_only_later_events_of_its_kinds(bus: Bus,
                                                                         uid: str) -> None:
    await ensure_job_events(bus)
    await ensure_job_events(bus)  # idempotent
    # Stored before the cursor is taken: a plain publish, even flushed, may reach the
    # stream after a stream-info request answered on the same connection.
    cursor = await bus.publish_event(subjects.rank_exited(uid), exited(uid, 0),
                                     event_id=f"{uid}-exited-0")
    await bus.publish(subjects.replica_ready(uid), ReplicaReady(
        job_id=uid, replica_id="r1-0", slot=1, node_id="n0", endpoint="127.0.0.1:1"))
    await bus.publish(subjects.rank_exited(uid), exited(uid, 1))
    await bus.publish(subjects.rank_exited(uid), exited(uid, 2))
    reader = await EventReader(bus, cursor + 1, frozenset({"exited"})).start()
    try:
        events = await asyncio.wait_for(take(reader, 2), 10)
    finally:
        await reader.close()
    assert [(e.kind, e.message.rank) for e in events] == [("exited", 1), ("exited", 2)]
    assert events[0].seq > cursor and events[1].seq > events[0].seq
    assert reader.delivered == events[1].seq



async def test_events_published_around_a_server_restart_arrive_once_in_order(
        tmp_path: Path, uid: str) -> None:
    port = free_port()
    server = NatsServer(tmp_path / "js", port=port).start()
    config = BusConfig.load(env={}, servers=[server.url])
    reader_bus = await Bus.connect(config, name="reader")
    writer_bus = await Bus.connect(config, name="writer")
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    reader_bus.on_reconnect(on_reconnect)
    try:
        await ensure_job_events(reader_bus)
        reader = await EventReader(reader_bus, await last_seq(reader_bus) + 1).start()
        events = aiter(reader)
        for rank in range(3):
            await writer_bus.publish(subjects.rank_exited(uid), exited(uid, rank))
        assert [e.message.rank for e in [await anext(events) for _ in range(3)]] == [0, 1, 2]
        server.process.kill()
        server.process.wait()
        # Published as the server dies, before the writer has noticed: a plain publish
        # would go to the dead socket; these are retried until the stream stores them.
        stored = [asyncio.create_task(writer_bus.publish_event(
            subjects.rank_exited(uid), exited(uid, rank), event_id=f"{uid}-{rank}"))
            for rank in range(3, 6)]
        server = NatsServer(tmp_path / "js", port=port).start()
        await asyncio.wait_for(reconnected.wait(), 15)
        await asyncio.wait_for(asyncio.gather(*stored), 15)
        assert reader_bus.connected and reader_bus.connected_since is not None
        for rank in range(6, 8):
            await writer_bus.publish(subjects.rank_exited(uid), exited(uid, rank))
        got = [await asyncio.wait_for(anext(events), 20) for _ in range(5)]
        ranks = [e.message.rank for e in got]
        assert sorted(ranks[:3]) == [3, 4, 5] and ranks[3:] == [6, 7]  # each once
        seqs = [e.seq for e in got]
        assert seqs == sorted(set(seqs))
        await reader.close()
    finally:
        await reader_bus.close()
        await writer_bus.close()
        server.stop()


async def test_a_stream_made_by_a_build_with_fewer_kinds_is_given_the_new_ones(
        own_nats: NatsServer, uid: str) -> None:
    async with await Bus.connect(BusConfig.load(env={}, servers=[own_nats.url])) as bus:
        await bus.js.add_stream(StreamConfig(
            name=subjects.JOB_EVENTS_STREAM, subjects=[subjects.job_events("exited")],
            storage=StorageType.FILE))
        await ensure_job_events(bus)
        info = await bus.js.stream_info(subjects.JOB_EVENTS_STREAM)
        assert set(info.config.subjects or []) == {subjects.job_events(k) for k in KINDS}
        seq = await bus.publish_event(subjects.generation_given_up(uid), GenerationGivenUp(
            job_id=uid, generation=3, replica_id="r1-0", reason="timed out"),
            event_id=f"{uid}-given-up")
        reader = await EventReader(bus, seq, frozenset({"given_up"})).start()
        try:
            [event] = await asyncio.wait_for(take(reader, 1), 10)
        finally:
            await reader.close()
        assert event.kind == "given_up" and event.message.generation == 3
