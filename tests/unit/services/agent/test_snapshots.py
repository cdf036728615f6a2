"""The agent's snapshot store: rings created and grown in place, the node's bound refused
with its numbers, an earlier membership's rings pruned once the current one holds two
steps, an ended job's buffers deleted."""

from __future__ import annotations

import pytest

from phalanx.schemas import snapshot_file
from phalanx.schemas.messages import SnapshotReserve
from phalanx.services.agent.snapshots import (
    OWNER_FILE,
    SnapshotRefused,
    SnapshotStore,
    claim,
    claim_in_default_place,
    collect_abandoned,
)


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


def commit(path, step: int, shard: int, shards: int, generation: int = 0) -> None:
    """Write a committed snapshot of ``step`` into the buffer file at ``path``."""
    with path.open("r+b") as f:
        data = bytearray(f.read())
        header = snapshot_file.Header("j", step, generation, shard, shards, 8 * shards,
                                      8 * shard, 8, 0, 0)
        snapshot_file.write(memoryview(data), header, b"m", lambda view: None)
        f.seek(0)
        f.write(data)


def test_an_earlier_membership_is_pruned_once_the_current_one_holds_two_steps(
        tmp_path) -> None:
    store = SnapshotStore(tmp_path / "shm", limit=100_000)
    old = store.reserve(ask(shard=1, shards=4, nbytes=5000))
    commit(old[0], 60, 1, 4)
    new = store.reserve(ask(shard=0, shards=2, nbytes=5000))
    assert store.prune("j") == 0  # nothing of the new membership yet: step 60 is needed
    commit(new[0], 61, 0, 2)
    assert store.prune("j") == 0  # one step: the others may not have taken it
    commit(new[1], 62, 0, 2)
    assert store.prune("j") == 2
    assert sorted(p.name for p in store.job_dir("j").iterdir()) == ["w2-s0.0", "w2-s0.1"]
    assert store.steps_held("j") == {2: {61, 62}}
    assert store.prune("other") == 0


def replica(store: SnapshotStore, source: str, ring: str, step: int, generation: int):
    path = store.replica_path("j", source, ring)
    store.make_room(path, 5000, "test")
    shards, shard = (int(part[1:]) for part in ring.split(".")[0].split("-"))
    commit(path, step, shard, shards, generation)
    return path


def test_the_replicas_of_nodes_the_job_left_go_once_its_generation_holds_two_steps(
        tmp_path) -> None:
    """Node "a" was lost: the job's generation 3 runs on this node ("b") and "c". What
    "a" replicated here, or a restore fetched from it, is never pruned by a newer replica
    of "a"; it goes once this node's own ring committed two steps in generation 3."""
    store = SnapshotStore(tmp_path / "shm", limit=100_000)
    own = store.reserve(ask(shard=0, shards=2, nbytes=5000))
    commit(own[0], 40, 0, 2, generation=3)  # before the agent saw generation 3: no evidence
    gone = [replica(store, "a", "w2-s1.0", 40, 2), replica(store, "a", "w2-s1.1", 39, 2)]
    kept = replica(store, "c", "w2-s1.0", 40, 3)
    assert store.prune_departed("j") == 0  # no generation seen
    store.generation_seen("j", 3, ["b", "c"])
    assert store.prune_departed("j") == 0
    commit(own[1], 41, 0, 2, generation=3)
    assert store.prune_departed("j") == 0  # one new step: the others may not have it
    commit(own[0], 42, 0, 2, generation=4)
    assert store.prune_departed("j") == 0  # another generation's: not evidence for 3
    commit(own[0], 42, 0, 2, generation=3)
    assert store.prune_departed("j") == 2
    assert not any(path.exists() for path in gone) and kept.exists()
    assert store.prune_departed("j") == 0
    store.generation_seen("j", 3, ["b"])  # the same generation again: nothing restarts
    assert store.prune_departed("j") == 0 and kept.exists()


def test_a_job_admitted_again_keeps_what_its_earlier_admission_left_until_it_trains(
        tmp_path) -> None:
    """Generation numbers start over: the earlier admission's rings here hold steps of
    generation 0 too. They are not evidence; the new admission's restore may read the
    replicas of the old nodes (or fetch from them) first."""
    store = SnapshotStore(tmp_path / "shm", limit=100_000)
    own = store.reserve(ask(shard=0, shards=2, nbytes=5000))
    commit(own[0], 80, 0, 2)
    commit(own[1], 81, 0, 2)
    old = replica(store, "a", "w2-s1.0", 81, 0)
    store.generation_seen("j", 0, ["b", "c"])  # the new admission, on other nodes
    assert store.prune_departed("j") == 0 and old.exists()
    commit(own[0], 82, 0, 2)
    commit(own[1], 83, 0, 2)
    assert store.prune_departed("j") == 1 and not old.exists()
    store.drop("j")
    assert "j" not in store.newest


def test_an_agent_claiming_its_store_beside_another_never_loses_it(tmp_path) -> None:
    """Two agents starting at once: the store one claims is never the other's abandoned
    one, though its work directory did not exist before the claim."""
    stores, work = tmp_path / "phalanx-0", tmp_path / "work"
    assert claim_in_default_place(stores / "n0-aaaa", work / "n0") == []
    assert (work / "n0").is_dir()
    assert claim_in_default_place(stores / "n1-bbbb", work / "n1") == []
    assert sorted(p.name for p in stores.iterdir() if p.is_dir()) == ["n0-aaaa", "n1-bbbb"]
    # Once its work directory is gone, another agent's claim deletes it.
    (work / "n0").rmdir()
    assert claim_in_default_place(stores / "n2-cccc", work / "n2") == [(stores / "n0-aaaa", 0)]


def test_a_store_whose_agents_work_dir_is_gone_is_deleted_and_no_other(tmp_path) -> None:
    stores, work = tmp_path / "phalanx-0", tmp_path / "work"
    mine = stores / "n0-aaaa"
    claim(mine, work / "n0")  # this agent's: never touched, whatever it names
    (work / "live").mkdir(parents=True)
    claim(stores / "n1-bbbb", work / "live")  # another agent's, still there
    claim(stores / "n2-cccc", work / "gone")  # a cluster's data directory deleted since
    (stores / "n2-cccc" / "job").mkdir()
    (stores / "n2-cccc" / "job" / "w2-s0.0").write_bytes(b"x" * 1000)
    (stores / "n3-dddd" / "job").mkdir(parents=True)  # no owner named: left alone
    (stores / "n4-eeee").mkdir()
    (stores / "n4-eeee" / OWNER_FILE).write_text("relative/path")  # not ours: left alone

    assert collect_abandoned(mine) == [(stores / "n2-cccc", 1000)]
    assert sorted(p.name for p in stores.iterdir()) == ["n0-aaaa", "n1-bbbb", "n3-dddd",
                                                         "n4-eeee"]
    # The owner marker is no job of the store.
    assert SnapshotStore(mine, 10_000).jobs() == set()


def test_each_column_of_a_replica_group_keeps_a_ring_of_its_own(tmp_path) -> None:
    """Rank s of a group of ranks holds the model's shard s: its share of a step is column
    s's, in its own ring, and a fetch asks for a column's copy by name."""
    store = SnapshotStore(tmp_path / "shm", limit=100_000)
    column_0 = store.reserve(ask(nbytes=5000))
    column_1 = store.reserve(SnapshotReserve(job_id="j", replica_id="r0-0", shard=0,
                                             shards=2, nbytes=5000, column=1))
    assert [p.name for p in column_1] == ["w2-s0-c1.0", "w2-s0-c1.1"]
    commit(column_0[0], 7, 0, 2)
    commit(column_1[0], 7, 0, 2)
    found = store.copy_of("j", 7, 2, 0, column=1)
    assert found is not None and found[0] == column_1[0]
    assert store.copy_of("j", 7, 2, 0)[0] == column_0[0]  # type: ignore[index]
    assert store.steps_held("j") == {2: {7}}
    replica = store.replica_path("j", "n1", "w2-s0-c1.0")
    assert store.ring_of(replica) == "w2-s0-c1.0"
