"""Values past one payload, stored in chunks on a real nats-server (phalanx.bus.spill).

A generation of 16,384 members (1.1 MiB) and the elasticity leader's state of that
job (2.9 MiB) are each stored as a pointer and chunks: read back whole from another
connection, published as the pointer and delivered whole, a value replaced while a
reader holds its pointer read as the newer one, chunks of a writer that died before
its pointer never read, chunks that do not hash to their pointer refused, and every
chunk set removed once its value is replaced or deleted, and only then.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from phalanx.bus import spill
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, encode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import (
    MAX_REPLICAS,
    MAX_SPILLED_BYTES,
    Generation,
    GenerationReason,
    JobSnapshot,
    Member,
)
from phalanx.services.elasticity import core as elasticity

N = MAX_REPLICAS


def generation(job: str, number: int, n: int = N) -> Generation:
    return Generation(
        job_id=job, generation=number, world_size=n, rendezvous=f"{job}-g{number}",
        resume_step=number * 10, reason=GenerationReason.START,
        members=[Member(replica_id=f"r{i}-{number}", rank=i, node_id=f"node-{i // 8:05d}",
                        endpoint=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:29500")
                 for i in range(n)])


async def chunk_sets(bus: Bus, bucket: str, key: str) -> set[str]:
    """The digests of the chunk sets stored for ``key`` of ``bucket``."""
    prefix = f"$KV.{subjects.CHUNKS_BUCKET}.{bucket}.{key}."
    info = await bus.js.stream_info(subjects.kv_stream(subjects.CHUNKS_BUCKET),
                                    subjects_filter=f"{prefix}*.*")
    return {s.removeprefix(prefix).split(".")[0] for s in (info.state.subjects or {})}


@pytest.fixture
async def reader(bus_config: BusConfig) -> Bus:
    async with await Bus.connect(bus_config, name="reader") as connected:
        yield connected


async def test_a_generation_of_16384_members_is_stored_in_chunks_and_read_whole(
        bus: Bus, reader: Bus, uid: str) -> None:
    bucket, job = f"gens_{uid}", f"big{uid}"
    value = generation(job, 1)
    size = len(encode(value, limit=MAX_SPILLED_BYTES))
    assert size > MAX_PAYLOAD_BYTES  # the reason for all this
    kv = await TypedKV.open(bus.js, bucket, Generation)
    began = time.perf_counter()
    await kv.put(job, value)
    stored_s = time.perf_counter() - began
    raw = await kv._raw(job)
    assert raw is not None and len(raw.data) < 1024
    pointer = spill.pointer(raw.data)
    assert pointer is not None and pointer == kv.pointer(job)
    assert pointer.size == size and pointer.chunks == -(-size // spill.CHUNK_BYTES)
    began = time.perf_counter()
    entry = await (await TypedKV.open(reader.js, bucket, Generation)).get(job)
    read_s = time.perf_counter() - began
    assert entry is not None and entry.value == value
    print({"members": N, "bytes": size, "pointer_bytes": len(raw.data),
           "chunks": pointer.chunks, "store_s": round(stored_s, 3), "read_s": round(read_s, 3)})


async def test_the_pointer_published_delivers_the_value_or_the_newer_one(
        bus: Bus, reader: Bus, uid: str) -> None:
    bucket, job = f"gens_{uid}", f"big{uid}"
    kv = await TypedKV.open(bus.js, bucket, Generation)
    got: asyncio.Queue[Generation] = asyncio.Queue()

    async def on_generation(g: Generation, _: Delivery) -> None:
        got.put_nowait(g)

    await reader.subscribe(subjects.job_generation(job), Generation, on_generation)
    await reader.nc.flush()
    first = generation(job, 1)
    await kv.put(job, first)
    old = kv.pointer(job)
    assert old is not None
    await bus.publish(subjects.job_generation(job), old)
    assert await asyncio.wait_for(got.get(), 10) == first
    # Replaced: the first value's chunks are removed, and its pointer, delivered late,
    # brings the value the key holds now.
    second = generation(job, 2)
    await kv.put(job, second)
    assert await chunk_sets(bus, bucket, job) == {kv.pointer(job).digest}  # type: ignore[union-attr]
    with pytest.raises(spill.Superseded):
        await kv.chunks.load(old)
    await bus.publish(subjects.job_generation(job), old)
    assert await asyncio.wait_for(got.get(), 10) == second


async def test_chunks_without_their_pointer_are_never_read(bus: Bus, uid: str) -> None:
    """A writer that dies between its chunks and its pointer leaves the previous value
    readable; chunks that do not hash to their pointer are refused, not decoded."""
    bucket, job = f"gens_{uid}", f"big{uid}"
    kv = await TypedKV.open(bus.js, bucket, Generation)
    first = generation(job, 1)
    await kv.put(job, first)
    half = generation(job, 2)
    await kv.chunks.spill(bucket, job, Generation.wire_name(),
                          encode(half, limit=MAX_SPILLED_BYTES))
    entry = await kv.get(job)
    assert entry is not None and entry.value == first
    # A chunk overwritten with other bytes: refused by the digest, counted as bad.
    pointer = kv.pointer(job)
    assert pointer is not None
    chunks = await bus.js.key_value(subjects.CHUNKS_BUCKET)
    await chunks.put(spill.chunk_key(bucket, job, pointer.digest, 0), b"x" * spill.CHUNK_BYTES)
    with pytest.raises(WireError, match="do not hash"):
        await kv.get(job)
    assert kv.counters.bad_messages == 1


async def test_a_write_removes_only_the_chunks_of_the_value_it_replaced(
        bus: Bus, reader: Bus, uid: str) -> None:
    """Two writers of one key (a deposed leader's put racing its successor's): the chunks
    one has stored and not yet pointed to survive the other's write, so whichever
    pointer lands last is read whole."""
    bucket, job = f"gens_{uid}", f"big{uid}"
    first = await TypedKV.open(bus.js, bucket, Generation)
    second = await TypedKV.open(reader.js, bucket, Generation)
    await first.put(job, generation(job, 1))
    late = generation(job, 3)
    in_flight = await first.chunks.spill(bucket, job, Generation.wire_name(),
                                         encode(late, limit=MAX_SPILLED_BYTES))
    await second.put(job, generation(job, 2))  # removes generation 1's chunks, only them
    assert await chunk_sets(bus, bucket, job) == {
        in_flight.digest, second.pointer(job).digest}  # type: ignore[union-attr]
    await first.kv.put(job, encode(in_flight))  # the late writer's pointer lands
    entry = await second.get(job)
    assert entry is not None and entry.value == late


async def test_a_smaller_value_or_a_delete_removes_the_chunks(bus: Bus, uid: str) -> None:
    bucket, job = f"gens_{uid}", f"big{uid}"
    kv = await TypedKV.open(bus.js, bucket, Generation)
    await kv.put(job, generation(job, 1))
    await kv.update(job, generation(job, 2), (await kv.current(job))[1])
    assert len(await chunk_sets(bus, bucket, job)) == 1
    small = generation(job, 3, n=8)
    await kv.put(job, small)
    assert await chunk_sets(bus, bucket, job) == set()
    entry = await kv.get(job)
    assert entry is not None and entry.value == small and kv.pointer(job) is None
    await kv.put(job, generation(job, 4))
    await kv.delete(job)
    assert await chunk_sets(bus, bucket, job) == set() and await kv.get(job) is None


async def test_the_elasticity_state_of_a_16384_replica_job_is_restored_from_chunks(
        bus: Bus, reader: Bus, uid: str) -> None:
    """The leader's state of a job of 16,384 members, stored as a successor finds it."""
    job = f"big{uid}"
    core = elasticity.ElasticityCore(wait_timeout_s=60.0)
    now = time.time()
    nodes = {slot: f"node-{slot // 8:05d}" for slot in range(N)}
    core.handle(elasticity.JobAdmitted(job, nodes, 1, N, max_replacements=100), now)
    for slot in range(N):
        core.handle(elasticity.ReplicaReadySeen(job, f"r{slot}-0", nodes[slot], slot,
                                                f"h{slot}:29500"), now)
    decisions = core.handle(elasticity.MemberFailed(job, "r7-0", "Traceback: boom"), now)
    assert any(isinstance(d, elasticity.PublishGeneration) for d in decisions)
    state = elasticity.snapshot(core.jobs[job])
    assert len(state) > MAX_PAYLOAD_BYTES
    snapshots = await TypedKV.open(bus.js, f"elastic_{uid}", JobSnapshot)
    await snapshots.create(job, JobSnapshot(job_id=job, seq=42, format=1, state=state))
    [entry], bad = await (await TypedKV.open(reader.js, f"elastic_{uid}", JobSnapshot)).entries()
    assert not bad and entry.value.seq == 42
    successor = elasticity.ElasticityCore(wait_timeout_s=60.0)
    assert successor.restore(entry.value.state) == job
    restored = successor.jobs[job]
    assert restored.current == core.jobs[job].current
    assert restored.current is not None and restored.current.world_size == N - 1
    assert msgspec.structs.asdict(restored.current) == msgspec.structs.asdict(
        core.jobs[job].current)
