"""Property tests of the checkpoint catalog: every answer names a complete step from
healthy copies, retention keeps the newest complete steps, a corrupt copy is never offered,
and a core restored from its stored catalogs answers as one that never stopped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import SnapshotRecord, SnapshotTier
from phalanx.services.checkpoint import core

JOB = "j"

records = st.builds(
    lambda step, shards, shard, node, tier, corrupt, checksum: SnapshotRecord(
        job_id=JOB, step=step, shard=min(shard, shards - 1), num_shards=shards,
        node_id=f"n{node}", tier=tier, nbytes=10, checksum=f"{checksum:016x}",
        created_at=0.0, total_bytes=40, corrupt=corrupt),
    st.integers(0, 12), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2),
    st.sampled_from(list(SnapshotTier)), st.sampled_from([False, False, False, True]),
    st.integers(0, 3))


def check(catalog, keep: int) -> None:
    steps = catalog.steps
    assert steps == sorted(steps, key=lambda s: (s.step, s.shards))
    assert len([s for s in steps if core.complete(s)]) <= keep
    answer = core.resume_answer(catalog, JOB, 4)
    if answer.step is not None:
        entry = next(s for s in steps if s.step == answer.step and s.shards == answer.shards)
        assert core.complete(entry)
        assert [c.shard for c in answer.sources] == list(range(entry.shards))
        assert not any(c.corrupt for c in answer.sources)
        newer = [s for s in steps if core.complete(s) and s.step > answer.step]
        assert newer == []


@settings(max_examples=200, deadline=None)
@given(st.lists(records, max_size=40), st.integers(1, 3), st.integers(0, 40))
def test_the_catalog_answers_from_healthy_complete_steps_and_restores(
        events, keep, cut) -> None:
    live = core.CheckpointCore()
    live.handle(core.JobSeen(JOB, keep))
    stored = {}
    restarted = None
    for i, record in enumerate(events):
        if i == cut:  # the service restarts from what it stored
            restarted = core.CheckpointCore()
            restarted.handle(core.JobSeen(JOB, keep))
            for catalog in stored.values():
                restarted.restore(catalog)
        for decision in live.handle(core.SnapshotAnnounced(record)):
            assert isinstance(decision, core.StoreCatalog)
            stored[JOB] = decision.catalog
            check(decision.catalog, keep)
        if restarted is not None:
            restarted.handle(core.SnapshotAnnounced(record))
            assert restarted.resume(JOB, 2) == live.resume(JOB, 2)
    if stored:
        assert live.handle(core.JobSeen(JOB, keep, ended=True)) == [core.ForgetCatalog(JOB)]
        assert live.resume(JOB, 2).step is None
