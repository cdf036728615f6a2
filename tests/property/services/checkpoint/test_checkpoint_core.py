"""Property tests of the checkpoint catalog: every answer names a complete step from
healthy copies, retention keeps the newest complete steps of each kind apart (memory
announcements never push a durable step out, nor the reverse), a corrupt copy is never
offered, an ended job keeps exactly its durable copies, and a core restored from its
stored catalogs answers as one that never stopped."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import SnapshotRecord, SnapshotTier
from phalanx.services.checkpoint import core

JOB = "j"


def snapshot(step: int, shards: int, shard: int, node: int, tier: SnapshotTier,
             corrupt: bool, checksum: int) -> SnapshotRecord:
    durable = tier is SnapshotTier.DURABLE
    return SnapshotRecord(
        job_id=JOB, step=step, shard=min(shard, shards - 1), num_shards=shards,
        node_id=f"n{node}", tier=tier, nbytes=10, checksum=f"{checksum:016x}",
        created_at=0.0, total_bytes=40, corrupt=corrupt,
        # A durable step's place is its directory, whichever node announces it.
        location=f"/ckpt/{JOB}/step-{step}-w{shards}" if durable else "")


records = st.builds(snapshot, st.integers(0, 12), st.integers(1, 3), st.integers(0, 2),
                    st.integers(0, 2), st.sampled_from(list(SnapshotTier)),
                    st.sampled_from([False, False, False, True]), st.integers(0, 3))


def check(catalog, keep: int, durable_keep: int) -> None:
    steps = catalog.steps
    assert steps == sorted(steps, key=lambda s: (s.step, s.shards))
    assert all(s.copies for s in steps)
    assert len([s for s in steps if core.complete(s, core.in_memory)]) <= keep
    assert len([s for s in steps if core.complete(s, core.durable)]) <= durable_keep
    answer = core.resume_answer(catalog, JOB, 4)
    if answer.step is not None:
        entry = next(s for s in steps if s.step == answer.step and s.shards == answer.shards)
        assert core.complete(entry)
        assert [c.shard for c in answer.sources] == list(range(entry.shards))
        assert not any(c.corrupt for c in answer.sources)
        newer = [s for s in steps if core.complete(s) and s.step > answer.step]
        assert newer == []
    else:
        assert not any(core.complete(s) for s in steps)


def copies_of(catalog, kind) -> list:
    return [] if catalog is None else [(s.step, s.shards, c) for s in catalog.steps
                                       for c in s.copies if kind(c)]


def replay(events: list[SnapshotRecord], keep: int, durable_keep: int):
    the_core = core.CheckpointCore()
    the_core.handle(core.JobSeen(JOB, keep, durable_keep))
    for record in events:
        the_core.handle(core.SnapshotAnnounced(record))
    return the_core.catalogs.get(JOB)


DURABLE, LOCAL = SnapshotTier.DURABLE, SnapshotTier.LOCAL


@settings(max_examples=200, deadline=None)
@given(st.lists(records, max_size=40), st.integers(1, 3), st.integers(1, 3),
       st.integers(0, 40))
# One step complete at two shard counts (written again after a restore at another world
# size): both counted toward keep, in either kind (found by this test).
@example([snapshot(1, 2, 0, 0, LOCAL, False, 0), snapshot(1, 2, 1, 0, LOCAL, False, 0),
          snapshot(1, 1, 0, 0, LOCAL, False, 0)], 1, 1, 0)
@example([snapshot(0, 2, 0, 0, DURABLE, False, 0), snapshot(0, 2, 1, 0, DURABLE, False, 0),
          snapshot(0, 1, 0, 0, DURABLE, False, 0)], 1, 1, 0)
def test_the_catalog_answers_from_healthy_complete_steps_and_restores(
        events, keep, durable_keep, cut) -> None:
    live = core.CheckpointCore()
    live.handle(core.JobSeen(JOB, keep, durable_keep))
    stored = {}
    restarted = None
    for i, record in enumerate(events):
        if i == cut:  # the service restarts from what it stored
            restarted = core.CheckpointCore()
            restarted.handle(core.JobSeen(JOB, keep, durable_keep))
            for catalog in stored.values():
                restarted.restore(catalog)
        for decision in live.handle(core.SnapshotAnnounced(record)):
            assert isinstance(decision, core.StoreCatalog)
            stored[JOB] = decision.catalog
            check(decision.catalog, keep, durable_keep)
        if restarted is not None:
            restarted.handle(core.SnapshotAnnounced(record))
            assert restarted.resume(JOB, 2) == live.resume(JOB, 2)
    final = live.catalogs.get(JOB)
    # Each kind is retained apart: the copies of one kind are those the announcements of
    # that kind alone leave.
    for kind in (core.durable, core.in_memory):
        alone = replay([r for r in events if kind(core.ShardCopy(
            shard=0, node_id="n", tier=r.tier, nbytes=0, checksum="0" * 8))],
            keep, durable_keep)
        assert copies_of(final, kind) == copies_of(alone, kind)
    # The job ends: its memory copies go, its durable ones stay (and later durable
    # announcements are still taken); the catalog goes only with its last copy.
    kept = copies_of(final, core.durable)
    decisions = live.handle(core.JobEnded(JOB))
    if final is None:
        assert decisions == []
    elif kept:
        assert copies_of(live.catalogs[JOB], core.in_memory) == []
        assert copies_of(live.catalogs[JOB], core.durable) == kept
        assert decisions in ([], [core.StoreCatalog(live.catalogs[JOB])])
    else:
        assert decisions == [core.ForgetCatalog(JOB)]
        assert live.resume(JOB, 2).step is None
    late = snapshot(13, 1, 0, 0, SnapshotTier.DURABLE, False, 1)
    assert live.handle(core.SnapshotAnnounced(snapshot(13, 1, 0, 0, SnapshotTier.LOCAL,
                                                       False, 1))) == []
    assert live.handle(core.SnapshotAnnounced(late)) != []
    assert live.resume(JOB, 2).step == 13


@settings(max_examples=200, deadline=None)
@given(st.lists(records, max_size=40), st.sets(st.integers(0, 2)), st.booleans())
def test_members_asking_from_their_nodes_get_their_own_copies_first_and_every_holder(
        events, members, memory_only) -> None:
    """Asked from the nodes of a generation's members (what to fetch before a restore):
    a shard one of them holds in memory is sourced there, ``held_by`` lists exactly
    the nodes holding each shard in memory (members' first), and with ``memory_only``
    the step is the newest complete in memory, from memory copies only."""
    catalog = replay(events, 3, 3)
    at_nodes = [f"n{m}" for m in sorted(members)]
    answer = core.resume_answer(catalog, JOB, 2, at_nodes=at_nodes, memory_only=memory_only)
    kind = core.in_memory if memory_only else None
    complete = [] if catalog is None else [s for s in catalog.steps if core.complete(s, kind)]
    if answer.step is None:
        assert complete == []
        return
    assert answer.step == max(s.step for s in complete)
    entry = next(s for s in complete if (s.step, s.shards) == (answer.step, answer.shards))
    assert len(answer.sources) == len(answer.held_by) == entry.shards
    for shard, (source, holders) in enumerate(zip(answer.sources, answer.held_by,
                                                  strict=True)):
        healthy = [c for c in entry.copies if c.shard == shard and not c.corrupt]
        in_memory = {c.node_id for c in healthy if core.in_memory(c)}
        assert source.shard == shard and not source.corrupt
        assert not memory_only or core.in_memory(source)
        assert sorted(holders) == sorted(in_memory) and len(set(holders)) == len(holders)
        ours = [n for n in holders if n in at_nodes]
        assert holders[:len(ours)] == ours  # the members' nodes first
        if ours:
            assert core.in_memory(source) and source.node_id in at_nodes
