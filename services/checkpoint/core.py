"""The checkpoint catalog's rules: which step of a job is held where, and where to resume.

A job's catalog (:class:`~phalanx.schemas.messages.CheckpointCatalog`) lists
steps ascending; each step names its shard count and state size and every
copy of every shard seen (node, tier, bytes, checksum, generation, corrupt).
The rules, each a pure function of the catalog and one input:

* **A snapshot** (:func:`add_snapshot`) adds or replaces its copy (one per
  shard, tier and place: the node for a memory copy, the step's directory for
  a durable one) under its step and shard count. A copy reported *corrupt* (it
  failed its checksum when read) stays listed as corrupt, so it is never
  offered again, even when the same step is announced again.
* **Complete**: a step is complete when every shard ``0..n-1`` has a copy
  that is not corrupt; of a job of replica groups, every shard of every column
  (each column, a group rank's model shard, is a state of its own).
* **Retention**, each kind of copy apart (:func:`retain`): memory copies
  (own node, buddy) of the newest ``keep`` steps complete in memory stay, with
  those of newer steps (being written); durable copies likewise for the newest
  ``durable_keep`` steps complete on storage. Older copies are dropped, and a
  step left with none. ``keep`` is the job's ``checkpoint.memory_keep``, the
  size of the agents' rings, so the catalog forgets a memory copy when the
  ring overwrites it; ``durable_keep`` is what the durable writers' own
  retention leaves on storage. So steps snapshotted to memory every step never
  push a durable step out.
* **A job ends** (:func:`ended`): its agents delete its memory snapshots, so
  its memory copies go; its durable steps stay on storage and in the catalog (a
  later job resumes from them, ``phalanx ckpt ls`` lists them), and durable
  copies announced after the end (a write finishing, a damaged copy found by a
  resuming job) are still taken. The catalog goes when no copy is left.
* **Buddies** (:func:`place_buddies`): every live node gets one buddy, a live
  node in another failure domain, which keeps replicas of its memory snapshots.
  A placement is stable: it stays while its buddy is live and in another
  domain, so a node joining or leaving moves only the placements it must.
  A node without one (new, its buddy lost, or its buddy now in its own
  domain) takes the candidate holding the fewest wards, lowest id among
  equals; a node with no live node outside its domain has no buddy, and says
  so. Liveness is the registry's rule (:func:`phalanx.schemas.registry.view`).
* **Where to resume** (:func:`resume_answer`): the newest complete step, each
  shard from its nearest healthy copy: own node's memory, then a buddy's,
  then durable storage (lowest node id, or location, among equals). The state is split
  flat (shard r of n is bytes ``[r·N/n, (r+1)·N/n)``), so a step taken at any
  world size can be restored at any other: the world size asked for does not
  narrow the answer. Asked by the members of a generation about to restore
  (``at_nodes``, ``memory_only``), a copy in their nodes' memory comes first,
  and every node holding each shard in memory is listed: a shard none of them
  holds is fetched from one of those (:mod:`phalanx.runtime.fetch`). A job of
  replica groups asks for one column at a time: its steps complete in that column.

:class:`CheckpointCore` keeps the catalogs of every job and says which ones
changed (to store) or lost every copy (to delete); its state is nothing but the stored
catalogs, so a restarted service restores it from KV as it was written.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Collection, Mapping

import msgspec

from phalanx.schemas.messages import (
    BuddyPlacement,
    BuddyReason,
    CatalogStep,
    CheckpointCatalog,
    NodeRecord,
    ResumeAnswer,
    ShardCopy,
    SnapshotRecord,
    SnapshotTier,
)
from phalanx.schemas.registry import NodeState, view

#: Nearest first.
TIER_ORDER = {SnapshotTier.LOCAL: 0, SnapshotTier.BUDDY: 1, SnapshotTier.DURABLE: 2}


def durable(copy: ShardCopy) -> bool:
    return copy.tier is SnapshotTier.DURABLE


def in_memory(copy: ShardCopy) -> bool:
    return copy.tier is not SnapshotTier.DURABLE


def place(copy: ShardCopy) -> str:
    """Where the copy is: its node's memory, or its durable step's directory."""
    return copy.location if durable(copy) else copy.node_id


def complete(step: CatalogStep, kind: Callable[[ShardCopy], bool] | None = None,
             column: int | None = None) -> bool:
    """Every shard of ``step`` has a copy that is not corrupt (of ``kind``, if given), in
    every column (in ``column`` only, if given)."""
    healthy = {(c.column, c.shard) for c in step.copies
               if not c.corrupt and (kind is None or kind(c))}
    columns = range(step.columns) if column is None else (column,)
    return healthy >= {(g, s) for g in columns for s in range(step.shards)}


def add_snapshot(catalog: CheckpointCatalog | None, record: SnapshotRecord,
                 keep: int, durable_keep: int) -> CheckpointCatalog:
    """``catalog`` with ``record``'s copy added (or marked corrupt), then retention."""
    catalog = catalog or CheckpointCatalog(job_id=record.job_id, keep=keep,
                                           durable_keep=durable_keep)
    copy = ShardCopy(shard=record.shard, node_id=record.node_id, tier=record.tier,
                     nbytes=record.nbytes, checksum=record.checksum,
                     generation=record.generation, corrupt=record.corrupt,
                     location=record.location, column=record.column)
    steps = list(catalog.steps)
    at = next((i for i, s in enumerate(steps)
               if (s.step, s.shards) == (record.step, record.num_shards)), None)
    if at is None:
        steps.append(CatalogStep(step=record.step, shards=record.num_shards,
                                 total_bytes=record.total_bytes, columns=record.columns))
        at = len(steps) - 1
    entry = steps[at]

    def same(c: ShardCopy) -> bool:
        return (c.column, c.shard, c.tier, place(c)) == (copy.column, copy.shard, copy.tier,
                                                         place(copy))

    previous = [c for c in entry.copies if same(c)]
    if previous and previous[0].corrupt and previous[0].checksum == copy.checksum:
        copy = previous[0]  # the same damaged bytes announced again: still corrupt
    copies = [c for c in entry.copies if not same(c)] + [copy]
    copies.sort(key=lambda c: (c.column, c.shard, TIER_ORDER[c.tier], place(c)))
    steps[at] = msgspec.structs.replace(entry, copies=copies)
    steps.sort(key=lambda s: (s.step, s.shards))
    return msgspec.structs.replace(catalog, keep=keep, durable_keep=durable_keep,
                                   steps=retain(steps, keep, durable_keep))


def _retained(steps: list[CatalogStep], keep: int,
              kind: Callable[[ShardCopy], bool]) -> set[int]:
    """Which of ``steps`` (ascending) keep their copies of ``kind``: the newest ``keep``
    complete in that kind, and any newer (being written). Counted by entry, not by step
    number: one step can be complete at two shard counts (written again after a restore
    at another world size), and each counts toward ``keep``."""
    done = [i for i, s in enumerate(steps) if complete(s, kind)]
    if not done:
        return set(range(len(steps)))
    newest = steps[done[-1]].step
    return set(done[max(0, len(done) - keep):]) | {
        i for i, s in enumerate(steps) if s.step > newest}


def retain(steps: list[CatalogStep], keep: int, durable_keep: int) -> list[CatalogStep]:
    """Memory copies of the steps :func:`_retained` keeps for ``keep``, durable ones of
    those it keeps for ``durable_keep``; a step left without a copy is dropped."""
    memory = _retained(steps, keep, in_memory)
    stored = _retained(steps, durable_keep, durable)
    kept = []
    for i, step in enumerate(steps):
        copies = [c for c in step.copies if i in (stored if durable(c) else memory)]
        if copies:
            kept.append(msgspec.structs.replace(step, copies=copies))
    return kept


def ended(catalog: CheckpointCatalog) -> CheckpointCatalog | None:
    """``catalog`` once its job ended: its durable copies only (None: there are none)."""
    steps = [msgspec.structs.replace(s, copies=[c for c in s.copies if durable(c)])
             for s in catalog.steps]
    steps = [s for s in steps if s.copies]
    return msgspec.structs.replace(catalog, steps=steps) if steps else None


def resume_answer(catalog: CheckpointCatalog | None, job_id: str, world_size: int, *,
                  at_nodes: Collection[str] = (), memory_only: bool = False,
                  column: int = 0) -> ResumeAnswer:
    """From which step, and which copy of each shard, ``job_id`` can resume.

    ``at_nodes``: the nodes that will restore; a copy in their memory comes first.
    ``memory_only``: durable copies do not count (neither for completeness nor as
    sources). ``column``: of a job of replica groups, the column asked about."""
    kind = in_memory if memory_only else None
    steps = [] if catalog is None else [s for s in catalog.steps
                                        if column < s.columns and complete(s, kind, column)]
    if not steps:
        seen = 0 if catalog is None else len(catalog.steps)
        where = "in memory " if memory_only else ""
        return ResumeAnswer(job_id=job_id, detail=(
            f"no step of {job_id} is known complete {where}({seen} incomplete)" if seen
            else f"no snapshot of {job_id} is known"))
    best = max(steps, key=lambda s: (s.step, -s.shards))
    here = set(at_nodes)

    def nearness(c: ShardCopy) -> tuple[bool, int, str]:
        return (not (in_memory(c) and c.node_id in here), TIER_ORDER[c.tier], place(c))

    sources, held_by = [], []
    for shard in range(best.shards):
        healthy = sorted((c for c in best.copies if (c.column, c.shard) == (column, shard)
                          and not c.corrupt and (kind is None or kind(c))), key=nearness)
        sources.append(healthy[0])
        held_by.append(list(dict.fromkeys(
            c.node_id for c in sorted(healthy, key=lambda c: (nearness(c)[0], c.node_id))
            if in_memory(c))))
    return ResumeAnswer(job_id=job_id, step=best.step, shards=best.shards, sources=sources,
                        held_by=held_by,
                        detail=f"step {best.step}: {best.shards} shards of "
                               f"{best.total_bytes} B, restorable at world size {world_size}")


def place_buddies(domains: Mapping[str, str], current: Mapping[str, BuddyPlacement],
                  now: float) -> dict[str, BuddyPlacement]:
    """Every live node's placement, given the live nodes' failure domains (node id ->
    domain) and the placements so far; a placement that still holds is returned as is."""
    wards: Counter[str] = Counter()
    placed: dict[str, BuddyPlacement] = {}
    for node_id in sorted(domains):  # first what stays: stable placements
        old = current.get(node_id)
        if old is not None and old.buddy_id in domains \
                and domains[old.buddy_id] != domains[node_id]:
            placed[node_id] = old if (old.failure_domain, old.buddy_domain) == (
                domains[node_id], domains[old.buddy_id]) else msgspec.structs.replace(
                old, failure_domain=domains[node_id], buddy_domain=domains[old.buddy_id])
            wards[old.buddy_id] += 1
    for node_id in sorted(domains.keys() - placed.keys()):
        domain, old = domains[node_id], current.get(node_id)
        others = [n for n in domains if domains[n] != domain]
        if not others:
            placed[node_id] = old if old is not None and not old.buddy_id \
                and old.failure_domain == domain else BuddyPlacement(
                node_id=node_id, failure_domain=domain,
                reason=BuddyReason.NO_OTHER_DOMAIN, placed_at=now)
            continue
        buddy = min(others, key=lambda n: (wards[n], n))
        wards[buddy] += 1
        reason = BuddyReason.PLACED if old is None or not old.buddy_id else \
            BuddyReason.BUDDY_LOST if old.buddy_id not in domains else BuddyReason.SAME_DOMAIN
        placed[node_id] = BuddyPlacement(node_id=node_id, failure_domain=domain,
                                          buddy_id=buddy, buddy_domain=domains[buddy],
                                          reason=reason, placed_at=now)
    return placed


@dataclasses.dataclass(frozen=True)
class SnapshotAnnounced:
    record: SnapshotRecord


@dataclasses.dataclass(frozen=True)
class JobSeen:
    """A job's record: how many complete steps it keeps in memory and on storage."""

    job_id: str
    keep: int
    durable_keep: int


@dataclasses.dataclass(frozen=True)
class JobEnded:
    """A job's record is terminal or gone: its memory snapshots are deleted."""

    job_id: str


@dataclasses.dataclass(frozen=True)
class NodesSeen:
    """The node registry as read at ``now`` by a reader watching it since
    ``watching_since`` (a node is lost only after silence it could have heard), which
    first read each node's newest heartbeat at ``heard_at`` by its own clock (a node
    not in it: by the heartbeat's stamp, which needs the clocks to agree)."""

    records: tuple[NodeRecord, ...]
    now: float
    lost_after_s: float
    watching_since: float = float("-inf")
    heard_at: Mapping[str, float] = dataclasses.field(default_factory=dict)


Event = SnapshotAnnounced | JobSeen | JobEnded | NodesSeen


@dataclasses.dataclass(frozen=True)
class StoreCatalog:
    catalog: CheckpointCatalog


@dataclasses.dataclass(frozen=True)
class ForgetCatalog:
    job_id: str


@dataclasses.dataclass(frozen=True)
class StoreBuddy:
    placement: BuddyPlacement


@dataclasses.dataclass(frozen=True)
class ForgetBuddy:
    """The node is lost or gone: it holds no snapshots to replicate."""

    node_id: str


Decision = StoreCatalog | ForgetCatalog | StoreBuddy | ForgetBuddy


class CheckpointCore:
    """Every job's catalog. ``handle`` applies an event; the catalogs it changed are
    stored by the shell (at once or batched: the newest catalog is what counts)."""

    def __init__(self, default_keep: int = 2, default_durable_keep: int = 2) -> None:
        self.default_keep = (default_keep, default_durable_keep)
        self.catalogs: dict[str, CheckpointCatalog] = {}
        self.keep: dict[str, tuple[int, int]] = {}  # memory_keep, durable_keep
        self.ended: set[str] = set()
        self.buddies: dict[str, BuddyPlacement] = {}

    def restore(self, catalog: CheckpointCatalog) -> None:
        """Take a stored catalog back (a restarted service)."""
        self.catalogs[catalog.job_id] = catalog
        self.keep.setdefault(catalog.job_id, (catalog.keep, catalog.durable_keep))

    def restore_buddy(self, placement: BuddyPlacement) -> None:
        """Take a stored placement back (a restarted service keeps it if it still holds)."""
        self.buddies[placement.node_id] = placement

    def handle(self, event: Event) -> list[Decision]:
        match event:
            case SnapshotAnnounced(record=record):
                if record.job_id in self.ended and record.tier is not SnapshotTier.DURABLE:
                    return []  # a late announcement of a memory copy that is gone
                keep, durable_keep = self.keep.get(record.job_id, self.default_keep)
                added = add_snapshot(self.catalogs.get(record.job_id), record, keep,
                                     durable_keep)
                return self._set(record.job_id, added)
            case JobSeen(job_id=job_id, keep=keep, durable_keep=durable_keep):
                self.keep[job_id] = (keep, durable_keep)
                return []
            case JobEnded(job_id=job_id):
                self.ended.add(job_id)
                catalog = self.catalogs.get(job_id)
                return [] if catalog is None else self._set(job_id, ended(catalog))
            case NodesSeen(records=records, now=now):
                domains = {r.node.node_id: r.node.failure_domain for r in records
                           if view(r, now, event.lost_after_s,
                                   watching_since=event.watching_since,
                                   heard_at=event.heard_at.get(r.node.node_id)).state
                           is NodeState.ALIVE}
                placed = place_buddies(domains, self.buddies, now)
                decisions: list[Decision] = [ForgetBuddy(n) for n in sorted(
                    self.buddies.keys() - placed.keys())]
                decisions += [StoreBuddy(p) for n, p in sorted(placed.items())
                              if self.buddies.get(n) != p]
                self.buddies = placed
                return decisions
        raise TypeError(f"unknown event {event!r}")

    def _set(self, job_id: str, catalog: CheckpointCatalog | None) -> list[Decision]:
        """Keep ``catalog`` as ``job_id``'s (None: forget it); the decision if it changed."""
        if catalog == self.catalogs.get(job_id):
            return []
        if catalog is None:
            del self.catalogs[job_id]
            return [ForgetCatalog(job_id)]
        self.catalogs[job_id] = catalog
        return [StoreCatalog(catalog)]

    def resume(self, job_id: str, world_size: int) -> ResumeAnswer:
        return resume_answer(self.catalogs.get(job_id), job_id, world_size)
