"""The catalog of a job of replica groups: each column (a group rank's model shard) is a
state of its own, so a step is complete when every column's shards are, and members
asking about their column are answered from that column's copies."""

from __future__ import annotations

from phalanx.schemas.messages import SnapshotRecord, SnapshotTier
from phalanx.services.checkpoint import core


def copy(step: int, shard: int, column: int, node: str) -> SnapshotRecord:
    return SnapshotRecord(job_id="j", step=step, shard=shard, num_shards=2, node_id=node,
                          tier=SnapshotTier.LOCAL, nbytes=10, checksum=f"{column:016x}",
                          created_at=0.0, total_bytes=20, column=column, columns=2)


def test_a_step_is_complete_once_every_column_holds_every_shard() -> None:
    catalog = None
    for record in [copy(5, 0, 0, "a"), copy(5, 1, 0, "b"), copy(5, 0, 1, "a")]:
        catalog = core.add_snapshot(catalog, record, 2, 2)
    assert catalog is not None
    (step,) = catalog.steps
    assert (step.shards, step.columns, len(step.copies)) == (2, 2, 3)  # not mixed up
    assert not core.complete(step) and core.complete(step, column=0)
    assert core.resume_answer(catalog, "j", 2, column=1).step is None
    answer = core.resume_answer(catalog, "j", 2, memory_only=True, column=0)
    assert (answer.step, answer.held_by) == (5, [["a"], ["b"]])
    catalog = core.add_snapshot(catalog, copy(5, 1, 1, "c"), 2, 2)
    assert core.complete(catalog.steps[0])
    answer = core.resume_answer(catalog, "j", 2, memory_only=True, column=1)
    assert [(c.shard, c.column, c.node_id) for c in answer.sources] == [(0, 1, "a"),
                                                                        (1, 1, "c")]
