"""The agent's snapshot store: rings created and grown in place, the node's bound refused
with its numbers, an ended job's buffers deleted."""

from __future__ import annotations

import pytest

from phalanx.schemas.messages import SnapshotReserve
from phalanx.services.agent.snapshots import SnapshotRefused, SnapshotStore


def ask(shard: int = 0, shards: int = 2, nbytes: int = 1000, job: str = "j") -> SnapshotReserve:
    return SnapshotReserve(job_id=job, replica_id=f"r{shard}-0", shard=shard, shards=shards,
                           nbytes=nbytes)


def test_a_ring_is_created_grown_in_place_and_counted(tmp_path) -> None:
    store = SnapshotStore(tmp_path / "shm", limit=10_000)
    paths = store.reserve(ask())
    assert [p.name for p in paths] == ["w2-s0.0", "w2-s0.1"]
    paths[0].write_bytes(b"x" * 1000)
    assert store.reserve(ask(nbytes=1500)) == paths
    assert paths[0].read_bytes()[:1000] == b"x" * 1000  # grown, what it held kept
    assert store.used() == 3000
    assert store.reserve(ask(nbytes=10)) == paths and store.used() == 3000  # never shrunk


def test_a_reservation_past_the_bound_is_refused_with_its_numbers(tmp_path) -> None:
    store = SnapshotStore(tmp_path / "shm", limit=3000)
    store.reserve(ask(shard=0))
    with pytest.raises(SnapshotRefused, match="over this node's limit of 3000 B"):
        store.reserve(ask(shard=1))
    assert "r1-0 of j asked for 2 x 1000 B" in store.refused
    assert store.used() == 2000


def test_an_ended_job_leaves_nothing(tmp_path) -> None:
    store = SnapshotStore(tmp_path / "shm", limit=100_000)
    store.reserve(ask(job="a"))
    store.reserve(ask(job="b"))
    store.drop("a")
    assert store.jobs() == {"b"}
    store.clear()
    assert store.used() == 0 and store.jobs() == set()
