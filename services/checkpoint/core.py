"""The checkpoint catalog's rules: which step of a job is held where, and where to resume.

A job's catalog (:class:`~phalanx.schemas.messages.CheckpointCatalog`) lists
steps ascending; each step names its shard count and state size and every
copy of every shard seen (node, tier, bytes, checksum, generation, corrupt).
The rules, each a pure function of the catalog and one input:

* **A snapshot** (:func:`add_snapshot`) adds or replaces its copy (one per
  shard, node and tier) under its step and shard count. A copy reported
  *corrupt* (it failed its checksum when read) stays listed as corrupt, so it
  is never offered again, even when the same step is announced again.
* **Complete**: a step is complete when every shard ``0..n-1`` has a copy
  that is not corrupt.
* **Retention**: the newest ``keep`` complete steps stay, with anything newer
  (steps being written); older steps, complete or not, are dropped. ``keep``
  is the job's ``checkpoint.memory_keep``, the size of the agents' rings, so
  the catalog forgets a step when the ring overwrites it.
* **Where to resume** (:func:`resume_answer`): the newest complete step, each
  shard from its nearest healthy copy: own node's memory, then a buddy's,
  then durable storage (lowest node id among equals). The state is split
  flat (shard r of n is bytes ``[r·N/n, (r+1)·N/n)``), so a step taken at any
  world size can be restored at any other: the world size asked for does not
  narrow the answer.

:class:`CheckpointCore` keeps the catalogs of every job and says which ones
changed (to store) or ended (to delete); its state is nothing but the stored
catalogs, so a restarted service restores it from KV as it was written.
"""

from __future__ import annotations

import dataclasses

import msgspec

from phalanx.schemas.messages import (
    CatalogStep,
    CheckpointCatalog,
    ResumeAnswer,
    ShardCopy,
    SnapshotRecord,
    SnapshotTier,
)

#: Nearest first.
TIER_ORDER = {SnapshotTier.LOCAL: 0, SnapshotTier.BUDDY: 1, SnapshotTier.DURABLE: 2}


def complete(step: CatalogStep) -> bool:
    """Every shard of ``step`` has a copy that is not corrupt."""
    healthy = {c.shard for c in step.copies if not c.corrupt}
    return healthy >= set(range(step.shards))


def add_snapshot(catalog: CheckpointCatalog | None, record: SnapshotRecord,
                 keep: int) -> CheckpointCatalog:
    """``catalog`` with ``record``'s copy added (or marked corrupt), then retention."""
    catalog = catalog or CheckpointCatalog(job_id=record.job_id, keep=keep)
    copy = ShardCopy(shard=record.shard, node_id=record.node_id, tier=record.tier,
                     nbytes=record.nbytes, checksum=record.checksum,
                     generation=record.generation, corrupt=record.corrupt)
    steps = list(catalog.steps)
    at = next((i for i, s in enumerate(steps)
               if (s.step, s.shards) == (record.step, record.num_shards)), None)
    if at is None:
        steps.append(CatalogStep(step=record.step, shards=record.num_shards,
                                 total_bytes=record.total_bytes))
        at = len(steps) - 1
    entry = steps[at]
    same = (copy.shard, copy.node_id, copy.tier)
    previous = [c for c in entry.copies if (c.shard, c.node_id, c.tier) == same]
    if previous and previous[0].corrupt and previous[0].checksum == copy.checksum:
        copy = previous[0]  # the same damaged bytes announced again: still corrupt
    copies = [c for c in entry.copies if (c.shard, c.node_id, c.tier) != same] + [copy]
    copies.sort(key=lambda c: (c.shard, TIER_ORDER[c.tier], c.node_id))
    steps[at] = msgspec.structs.replace(entry, copies=copies)
    steps.sort(key=lambda s: (s.step, s.shards))
    return msgspec.structs.replace(catalog, keep=keep, steps=retain(steps, keep))


def retain(steps: list[CatalogStep], keep: int) -> list[CatalogStep]:
    """The newest ``keep`` complete steps and anything newer (ascending input)."""
    done = [s for s in steps if complete(s)]
    if not done:
        return steps
    oldest = done[max(0, len(done) - keep)].step
    return [s for s in steps if s.step >= oldest and (complete(s) or s.step > done[-1].step)]


def resume_answer(catalog: CheckpointCatalog | None, job_id: str,
                  world_size: int) -> ResumeAnswer:
    """From which step, and which copy of each shard, ``job_id`` can resume."""
    steps = [] if catalog is None else [s for s in catalog.steps if complete(s)]
    if not steps:
        seen = 0 if catalog is None else len(catalog.steps)
        return ResumeAnswer(job_id=job_id, detail=(
            f"no complete step of {job_id} is known ({seen} incomplete)" if seen
            else f"no snapshot of {job_id} is known"))
    best = max(steps, key=lambda s: (s.step, -s.shards))
    sources = []
    for shard in range(best.shards):
        healthy = [c for c in best.copies if c.shard == shard and not c.corrupt]
        sources.append(min(healthy, key=lambda c: (TIER_ORDER[c.tier], c.node_id)))
    return ResumeAnswer(job_id=job_id, step=best.step, shards=best.shards, sources=sources,
                        detail=f"step {best.step}: {best.shards} shards of "
                               f"{best.total_bytes} B, restorable at world size {world_size}")


@dataclasses.dataclass(frozen=True)
class SnapshotAnnounced:
    record: SnapshotRecord


@dataclasses.dataclass(frozen=True)
class JobSeen:
    """A job's record: its ring size, or that it ended (its memory snapshots are gone)."""

    job_id: str
    keep: int
    ended: bool = False


Event = SnapshotAnnounced | JobSeen


@dataclasses.dataclass(frozen=True)
class StoreCatalog:
    catalog: CheckpointCatalog


@dataclasses.dataclass(frozen=True)
class ForgetCatalog:
    job_id: str


Decision = StoreCatalog | ForgetCatalog


class CheckpointCore:
    """Every job's catalog. ``handle`` applies an event; the catalogs it changed are
    stored by the shell (at once or batched: the newest catalog is what counts)."""

    def __init__(self, default_keep: int = 2) -> None:
        self.default_keep = default_keep
        self.catalogs: dict[str, CheckpointCatalog] = {}
        self.keep: dict[str, int] = {}
        self.ended: set[str] = set()

    def restore(self, catalog: CheckpointCatalog) -> None:
        """Take a stored catalog back (a restarted service)."""
        self.catalogs[catalog.job_id] = catalog
        self.keep.setdefault(catalog.job_id, catalog.keep)

    def handle(self, event: Event) -> list[Decision]:
        match event:
            case SnapshotAnnounced(record=record):
                if record.job_id in self.ended:
                    return []  # a late announcement of a job whose snapshots are gone
                keep = self.keep.get(record.job_id, self.default_keep)
                catalog = add_snapshot(self.catalogs.get(record.job_id), record, keep)
                if catalog == self.catalogs.get(record.job_id):
                    return []
                self.catalogs[record.job_id] = catalog
                return [StoreCatalog(catalog)]
            case JobSeen(job_id=job_id, keep=keep, ended=True):
                self.keep.pop(job_id, None)
                self.ended.add(job_id)
                if self.catalogs.pop(job_id, None) is None:
                    return []
                return [ForgetCatalog(job_id)]
            case JobSeen(job_id=job_id, keep=keep):
                self.ended.discard(job_id)
                self.keep[job_id] = keep
                return []
        raise TypeError(f"unknown event {event!r}")

    def resume(self, job_id: str, world_size: int) -> ResumeAnswer:
        return resume_answer(self.catalogs.get(job_id), job_id, world_size)
