"""In-memory snapshots of a rank's state, and restoring a job from them.

**Taking.** The state (the tensors and skeletons :mod:`.state` copies: the model's
``state_dict``, the optimizer's, every registered object's, the RNG, the step)
is one flat byte sequence of ``N`` bytes: the tensors in that order
(:mod:`.flat_state`). Data-parallel replicas hold the same state, so rank ``r`` of
``W`` snapshots only bytes ``[r·N/W, (r+1)·N/W)`` (:func:`~.snapshot_file.share`):
every unique byte is copied once per snapshot. :class:`Snapshotter` does it after
the committed steps its schedule names (:mod:`.snapshot_interval`: a fixed interval,
or one the members agree on from the measured cost), straight into a buffer file its
node agent created in shared memory (the agent owns the memory, so the snapshot
outlives the rank): one memcpy of this rank's share and its checksum
(:mod:`.snapshot_file`), then an announcement to the checkpoint service's catalog.

**A state on a GPU** is copied off the device first, into a pinned host buffer
on a side CUDA stream (:class:`~.device_staging.DeviceStaging`), which the step's
forward and backward overlap; a writer thread then waits for that copy, copies it into the
agent's buffer, checksums it there (on the host) and announces it. The next
optimizer step, and anything else that writes the state (a restore, a received
copy), first makes the training stream wait for the side stream
(:meth:`Snapshotter.fence`), so the snapshot is the committed step's bytes; the
next snapshot first waits for the writer (:meth:`Snapshotter.settle`), so it is
at most one behind. The buffers are asked for once per
membership; an agent that refuses (its node's bound) leaves the rank training
without snapshots until its next membership, with the reason logged. An agent
that does not answer (down, restarting) is asked again at the first snapshot
due :data:`RESERVE_RETRY_S` later (one that does not answer in time is not: each try
would hold the training thread that long).

**Restoring.** When a generation's members hold no state as new as what their
nodes' memory holds (every rank of the job died, the agents lived),
:func:`restore` runs over the generation's process group: every member lists
the committed buffers of its own node's store (headers only), the lists are
summed in one all-reduce, :func:`plan_restore` names the candidate steps
(newest first) whose shards are all present on the members' nodes, the holders
check their copies' checksums, the members agree on one good copy per shard,
and each shard is broadcast to everyone, who then loads the whole state. A
copy that fails its checksum is never loaded: it is reported and the next copy
of the shard, or the next older step, is used.

**Replica groups.** Rank ``s`` of a group of ``S`` holds shard ``s`` of the model:
its state is column ``s``'s, snapshotted in rings of its own (the header's column),
and restored over the column's process group from column ``s``'s buffers only, so
rank ``s`` of each restored group loads shard ``s``, and nothing is gathered whole.
The columns restore together: a group's ranks must hold one step, so each column's
candidates are summed over the group (:data:`Agree`, the group's own all-reduce) and
only steps complete in every column count (:func:`in_every_column`), newest first;
a step one column cannot read (a checksum failed) is given up by every column.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from phalanx.bus.errors import BusUnavailable, NoResponders
from phalanx.runtime.bus_thread import BusThread
from phalanx.runtime.device_staging import DeviceStaging
from phalanx.runtime.flat_state import FlatState, copy_range, flat_state, load_flat, tensors_in
from phalanx.runtime.group import Group
from phalanx.runtime.replica_group import Agree
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.snapshot_interval import SnapshotSchedule
from phalanx.runtime.state import (
    Wait,
    _fill,
    broadcast_bytes,
    broadcast_tensor,
    tensor_refs,
)
from phalanx.schemas import snapshot_file, subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    SnapshotRecord,
    SnapshotReservation,
    SnapshotReserve,
    SnapshotTier,
)
from phalanx.schemas.snapshot_file import Header, SnapshotFileError

log = logging.getLogger("phalanx.runtime.snapshot")
#: Rows one member can report of its node's store in the restore all-reduce.
MAX_HELD = 64
META_SLACK = 64 * 1024  # room for the meta section to grow without a new reservation
RESERVE_TIMEOUT_S = 10.0
#: After the agent did not answer a reservation (down, restarting), ask again no sooner.
RESERVE_RETRY_S = 2.0


class Snapshotter:
    """Takes this rank's share of the state into its agent's shared memory.

    Args:
        bus: the rank's bus thread (reservations go to the agent, records to the catalog).
        job_id / replica_id / node_id: who this rank is.
        schedule: which committed steps are snapshotted (:mod:`.snapshot_interval`).
        keep: buffers in each share's ring (2: double-buffered).
        durable: every ``schedule.policy.durable_every``-th committed step (always
            snapshotted), the snapshot is handed to ``durable`` (a
            :class:`~.durable.DurableWriter`) to persist; the ring gets one buffer more, so
            the one being persisted is never overwritten and the newest commit still is
            not either.
        clock: seconds, for when to ask an agent that did not answer again.
        column: ``(s, S)``: this rank is rank ``s`` of a replica group of ``S``; its
            state (shard ``s`` of the model) is column ``s``'s, snapshotted apart.
    """

    def __init__(self, bus: BusThread, job_id: str, replica_id: str, node_id: str, *,
                 schedule: SnapshotSchedule, keep: int = 2, durable: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 column: tuple[int, int] = (0, 1)) -> None:
        self.bus, self.job_id, self.replica_id, self.node_id = bus, job_id, replica_id, node_id
        self.column = column
        self.clock = clock
        # When to ask an agent that did not answer again: a refusal (the node's bound)
        # holds for the generation, an agent restarting for a moment only.
        self._ask_again_at = -math.inf
        self.schedule, self.durable = schedule, durable
        self.durable_every = schedule.policy.durable_every
        self.keep = min(16, keep + 1) if durable is not None and self.durable_every else keep
        self._buffers: list[mmap.mmap] = []
        self._paths: list[Path] = []
        self._reserved: tuple[int, int, int] | None = None  # shard, shards, bytes per buffer
        self._refused_in: int | None = None  # the generation whose reservation was refused
        #: The last snapshot's time in the training thread (its reservation left out), and
        #: whether it was the first write of its buffer in this mapping: that one also
        #: pays the page faults, once a buffer and membership, not once a snapshot.
        self.last_copy_s = 0.0
        self.last_was_first = False
        self._written: set[int] = set()  # buffers written since the reservation
        # A state on a GPU: its copy off the device, and the writer thread that finishes it.
        self._staging: DeviceStaging | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def due(self, committed: int) -> bool:
        return self.schedule.due(committed)

    def fence(self) -> None:
        """Before the state is written (an optimizer step, a restore): a snapshot still
        being copied off the device is not overwritten (no-op on a CPU state)."""
        if self._staging is not None:
            self._staging.fence()

    def settle(self) -> None:
        """Wait until the snapshot the writer thread is finishing is written (no-op on a
        CPU state); one that failed is logged and skipped."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except (OSError, SnapshotFileError, RuntimeError) as exc:
            log.error("snapshot not written: %s", exc)

    def take(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Sharded,
             extra: Mapping[str, Any], step: int, generation: int, rank: int,
             world_size: int) -> bool:
        """Snapshot the state at ``step`` (steps committed) as shard ``rank`` of
        ``world_size``; False if this membership has no buffers (refused). A state on a
        GPU is written and announced by the writer thread once copied off the device
        (:class:`DeviceStaging`); this call waits for the previous one first."""
        if self._refused_in == generation or self.clock() < self._ask_again_at:
            return False
        started = time.perf_counter()
        self.settle()
        state = flat_state(model, optimizer, extra, step)
        meta = pickle.dumps(state.meta)
        _, length = state.extent(rank, world_size)
        need = snapshot_file.HEADER_BYTES + len(meta) + length
        fits = self._reserved is not None and self._reserved[:2] == (rank, world_size) \
            and self._reserved[2] >= need
        if not fits:
            asked = time.perf_counter()
            if not self._reserve(rank, world_size, need + len(meta) + META_SLACK, generation,
                                 step):
                return False
            started += time.perf_counter() - asked  # once a membership: not the snapshot's
        pinned = None if self.durable is None else self.durable.busy_with
        free = [i for i, path in enumerate(self._paths) if path != pinned]
        at = free[snapshot_file.pick_buffer([_committed_in(self._buffers[i]) for i in free])]
        device = state.device
        if device.type == "cpu":
            self._write(at, state, meta, step, generation, rank, world_size)
        else:
            if self._staging is None or self._staging.device != device:
                self._staging = DeviceStaging(device)
                self._writer = self._writer or ThreadPoolExecutor(
                    1, thread_name_prefix="phalanx-snapshot")
            staged = self._staging.start(state, rank, world_size)
            copied = self._staging.copied
            assert self._writer is not None and copied is not None

            def finish() -> None:
                copied.synchronize()
                self._write(at, state, meta, step, generation, rank, world_size, staged)

            self._pending = self._writer.submit(finish)
        self.last_copy_s = time.perf_counter() - started
        self.last_was_first = at not in self._written
        self._written.add(at)
        return True

    def _write(self, at: int, state: FlatState, meta: bytes, step: int, generation: int,
               rank: int, world_size: int, staged: torch.Tensor | None = None) -> None:
        """Write the share into buffer ``at`` (from ``staged``, its bytes copied off the
        device, if given), hand it to the durable tier when due, announce it."""
        header = write_share(memoryview(self._buffers[at]), state, meta, self.job_id, step,
                             generation, rank, world_size, staged, self.column)
        if self.durable_every and step % self.durable_every == 0 and self.durable is not None \
                and not self.durable.submit(self._paths[at], header):
            log.warning("durable step %d skipped: the previous one is still being written "
                        "(raise checkpoint.durable_every_steps)", step)
        self.bus.publish(subjects.ckpt_snapshot(self.job_id), SnapshotRecord(
            job_id=self.job_id, step=step, shard=rank, num_shards=world_size,
            node_id=self.node_id, tier=SnapshotTier.LOCAL, nbytes=header.length,
            checksum=f"{header.checksum:016x}", created_at=time.time(), generation=generation,
            total_bytes=state.total, column=header.column, columns=header.columns))

    def _reserve(self, shard: int, shards: int, nbytes: int, generation: int,
                 step: int) -> bool:
        assert self.bus.bus is not None
        request = SnapshotReserve(job_id=self.job_id, replica_id=self.replica_id, shard=shard,
                                  shards=shards, nbytes=nbytes, buffers=self.keep,
                                  column=self.column[0])
        try:
            reply = self.bus.run(self.bus.bus.request(
                subjects.agent_snapshot(self.node_id), request, SnapshotReservation,
                timeout_s=RESERVE_TIMEOUT_S), RESERVE_TIMEOUT_S + 1)
        except (NoResponders, BusUnavailable) as exc:
            # Not a refusal: the agent is down or restarting (said at once, not after a
            # timeout: asking again costs the training thread nothing). Before, the whole
            # generation went without snapshots (176 steps in a chaos run), and a fault
            # then restored a step that old. An agent that does not answer in time (held
            # up, stopped) is not asked again: each try would stall training that long.
            log.warning("no snapshot of step %d yet: %s; asking again in %g s", step, exc,
                        RESERVE_RETRY_S)
            self._ask_again_at = self.clock() + RESERVE_RETRY_S
            return False
        except (PhalanxError, OSError) as exc:
            log.warning("no snapshots in generation %d: %s", generation, exc)
            self._refused_in = generation
            return False
        for buffer in self._buffers:
            buffer.close()
        self._paths = [Path(p) for p in reply.paths]
        self._buffers = [snapshot_file.open_buffer(p) for p in self._paths]
        self._written = set()
        self._reserved = (shard, shards, nbytes)
        return True


def write_share(buffer: memoryview, state: FlatState, meta: bytes, job_id: str, step: int,
                generation: int, shard: int, shards: int,
                staged: torch.Tensor | None = None, column: tuple[int, int] = (0, 1)) -> Header:
    """Write shard ``shard`` of ``shards`` of ``state`` (and its pickled ``meta``) into
    ``buffer``, committed last (:func:`~.snapshot_file.write`): one copy of the share, and
    of the owned extent after it if the state has one; ``staged``: those bytes, already
    copied off the device (:class:`DeviceStaging`), copied from there instead;
    ``column``: the replica group column ``(s, S)`` whose state it is."""
    offset, length = state.extent(shard, shards)
    header = Header(job_id, step, generation, shard, shards, state.total, offset, length, 0, 0,
                    *column)
    owned = state.owned

    def fill(data: memoryview) -> None:
        if not len(data):
            return
        out = torch.frombuffer(data, dtype=torch.uint8)
        if staged is not None:
            out.copy_(staged)
            return
        shared = length - (0 if owned is None else owned.total)
        copy_range(state, offset, out[:shared])
        if owned is not None:
            copy_range(owned, 0, out[shared:])

    return snapshot_file.write(buffer, header, meta, fill)


def _committed_in(buffer: mmap.mmap) -> Header | None:
    try:
        return snapshot_file.read_header(memoryview(buffer)[:snapshot_file.HEADER_BYTES])
    except SnapshotFileError:
        return None


# --- restoring -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Held:
    """A committed buffer in a node's store: which shard of which step it holds."""

    step: int
    shard: int
    shards: int
    total: int
    generation: int = 0  # the generation that committed the step
    path: Path | None = None  # only known on the member whose node holds it

    def row(self) -> list[int]:
        return [1, self.step, self.shard, self.shards, self.total, self.generation]


def held_in(store: Path, job_id: str, column: tuple[int, int] = (0, 1)) -> list[Held]:
    """The committed buffers of ``job_id`` in a node's store directory (headers only), of
    replica group column ``column`` (``(s, S)``)."""
    found = []
    for path in sorted(store.glob("*")) if store.is_dir() else []:
        header = snapshot_file.committed_header(path)
        if header is not None and header.job_id == job_id \
                and (header.column, header.columns) == column:
            found.append(Held(header.step, header.shard, header.shards, header.total,
                              header.generation, path))
    return found


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step every shard of which some member's node holds, as one generation committed
    it: ``holders[s]`` are the ranks whose node holds shard ``s`` (lowest first)."""

    step: int
    shards: int
    total: int
    generation: int
    holders: tuple[tuple[int, ...], ...]


def plan_restore(held: Sequence[Sequence[Held]], newer_than: int) -> list[Candidate]:
    """The steps the members can restore from, newest first.

    Args:
        held: per member (rank order), the buffers its node's store holds.
        newer_than: the newest step a member holds in memory; only newer steps count.

    Pure: a step counts when every shard of one shard count (and state size), committed
    by one generation, is held on some member's node. Shards of one step from two
    generations are never mixed: a rank fenced out of its job (its node cut off) may go
    on committing steps of its old generation that the job's new one commits too,
    differently. Of one step, the newest generation's comes first (the one the job went
    on in).
    """
    by_step: dict[tuple[int, int, int, int], dict[int, set[int]]] = {}
    for rank, rows in enumerate(held):
        for h in rows:
            if h.step > newer_than:
                by_step.setdefault((h.step, h.shards, h.total, h.generation), {}).setdefault(
                    h.shard, set()).add(rank)
    candidates = [Candidate(step, shards, total, generation,
                            tuple(tuple(sorted(holders[s])) for s in range(shards)))
                  for (step, shards, total, generation), holders in by_step.items()
                  if len(holders) == shards]
    return sorted(candidates, key=lambda c: (-c.step, -c.generation, c.shards))


def in_every_column(columns: Sequence[Sequence[tuple[int, int]]]) -> set[tuple[int, int]]:
    """The ``(step, generation)`` pairs every column's candidates name (pure): the steps a
    replica group can restore, each of its ranks its own column's shard of one step."""
    if not columns:
        return set()
    common = set(columns[0])
    for candidates in columns[1:]:
        common &= set(candidates)
    return common


def _agreed(candidates: list[Candidate], agree: Agree, column: tuple[int, int]
            ) -> list[Candidate]:
    """Of this column's ``candidates``, those every column of the group holds: each rank
    puts its column's in its row, the group sums the rows."""
    rows = torch.zeros(column[1], MAX_HELD, 3, dtype=torch.float64)
    for i, c in enumerate(candidates[:MAX_HELD]):
        rows[column[0], i] = torch.tensor([1.0, c.step, c.generation], dtype=torch.float64)
    summed = agree(rows).to(torch.int64).tolist()
    common = in_every_column([[(step, generation) for present, step, generation in row
                               if present] for row in summed])
    return [c for c in candidates if (c.step, c.generation) in common]


@dataclasses.dataclass(frozen=True)
class SnapshotRestored:
    """What a restore from the nodes' memory brought back."""

    step: int
    nbytes: int
    corrupt: list[str]  # what failed its checksum, one line each
    from_replicas: int  # shards this member read from a buddy's replica, not its own


def restore(pg: Group, wait: Wait, rank: int, world_size: int, store: Path,
            job_id: str, newer_than: int, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | Sharded, extra: Mapping[str, Any],
            report: Callable[[Header, str, bool], None],
            keep: Callable[[int], bool] | None = None, column: tuple[int, int] = (0, 1),
            agree: Agree | None = None) -> SnapshotRestored | None:
    """Restore the newest step the members' nodes hold, newer than ``newer_than``, into
    every member's ``model``, ``optimizer`` and ``extra`` (and RNG); None when there is
    none. A collective: every member of ``pg`` calls it with the same ``newer_than``.

    ``report(header, problem, replica)`` is called for each copy that fails its checksum
    on this member (it is skipped; another copy or an older step is used); ``replica``:
    the copy is a buddy's replica on this node, not a rank's own snapshot. ``keep``: a
    sharded optimizer's new partition (:meth:`~.sharded.Sharded.keeps`): only the entries
    of the global parameter indices it accepts are built and loaded. ``column``: this
    rank is rank ``s`` of a replica group of ``S`` (``(s, S)``) and ``pg`` its column's
    group: column ``s``'s buffers are restored, at a step every column restores (the
    group's ranks sum what they hold with ``agree``; see the module docstring).
    """
    mine = held_in(store, job_id, column)[:MAX_HELD]
    rows = torch.zeros(world_size, MAX_HELD, len(Held(0, 0, 0, 0).row()), dtype=torch.int64)
    for i, h in enumerate(mine):
        rows[rank, i] = torch.tensor(h.row())
    wait(pg.allreduce([rows]))
    held = [[Held(*row[1:]) for row in member.tolist() if row[0]] for member in rows]
    corrupt: list[str] = []
    candidates = plan_restore(held, newer_than)
    if agree is not None:
        candidates = _agreed(candidates, agree, column)
    for candidate in candidates:
        # Each member checks the copies its node holds; all agree on one good copy a shard.
        good = torch.zeros(world_size, candidate.shards, dtype=torch.int64)
        verified: dict[int, tuple[mmap.mmap, Header]] = {}
        replicas: set[int] = set()  # shards whose verified copy here is a buddy's replica
        for h in mine:
            if (h.step, h.shards, h.total, h.generation) != (
                    candidate.step, candidate.shards, candidate.total, candidate.generation) \
                    or h.shard in verified:
                continue
            assert h.path is not None
            try:
                buffer, header = _verified(h.path)
            except (OSError, SnapshotFileError) as exc:
                corrupt.append(f"{h.path.name}: {exc}")
                damaged = snapshot_file.committed_header(h.path)
                if damaged is not None:  # the header holds; the contents do not
                    report(damaged, str(exc), snapshot_file.is_replica(h.path))
                continue
            verified[h.shard] = (buffer, header)
            if snapshot_file.is_replica(h.path):
                replicas.add(h.shard)
            good[rank, h.shard] = 1
        wait(pg.allreduce([good]))
        holders = [next((r for r in range(world_size) if good[r, s]), None)
                   for s in range(candidate.shards)]
        readable = None not in holders
        if agree is not None:  # the group's columns restore one step or none of them
            lacking = agree(torch.tensor([0.0 if readable else 1.0], dtype=torch.float64))
            readable = float(lacking[0]) == 0.0
        if not readable:
            for buffer, _ in verified.values():
                buffer.close()
            continue  # a shard with no good copy: the next older step
        sources = [r for r in holders if r is not None]  # each shard's, none missing
        flat = torch.empty(candidate.total, dtype=torch.uint8)
        # A shard every member's node holds is read there: no bytes cross the network (the
        # usual case when the agents lived: a node holds its ranks' shards and its buddy's).
        everywhere = [bool(good[:, s].all()) for s in range(candidate.shards)]
        read = {shard for shard, source in enumerate(sources)
                if shard in verified and (rank == source or everywhere[shard])}
        meta = _meta(verified[0]) if everywhere[0] else broadcast_bytes(
            pg, wait, rank, sources[0], _meta(verified[0]) if rank == sources[0] else None)
        for shard, source in enumerate(sources):
            offset, length = snapshot_file.share(candidate.total, shard, candidate.shards)
            part = flat[offset:offset + length]
            if not length:
                continue
            if shard in read:
                buffer, header = verified[shard]
                start = snapshot_file.HEADER_BYTES + header.meta_length
                part.copy_(torch.frombuffer(memoryview(buffer)[start:start + length],
                                            dtype=torch.uint8))
            if not everywhere[shard]:
                wait(pg.broadcast(part, source))
        common = pickle.loads(meta)
        owned: dict[int, Any] | None = None
        if "owned" in common:  # a sharded optimizer: every owner's entries, from its shard
            owned = {}
            for shard, source in enumerate(sources):
                owned.update(_owned_entries(pg, wait, rank, source, verified.get(shard),
                                            everywhere[shard], keep))
        for buffer, _ in verified.values():
            buffer.close()
        load_flat(flat, common, model, optimizer, extra, owned, keep)
        owned_bytes = sum(t.numel() * t.element_size() for entries in (owned or {}).values()
                          for t in entries.values() if isinstance(t, torch.Tensor))
        return SnapshotRestored(candidate.step, candidate.total + owned_bytes, corrupt,
                        len(read & replicas))
    return None


def _verified(path: Path) -> tuple[mmap.mmap, Header]:
    with path.open("rb") as f:
        # Copy-on-write: readable as a writable buffer for torch, never written back.
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header = snapshot_file.read_header(buffer)
    snapshot_file.verify(memoryview(buffer), header)
    return buffer, header


def _meta(held: tuple[mmap.mmap, Header]) -> bytes:
    """The meta section of a verified copy of shard 0."""
    buffer, header = held
    return bytes(buffer[snapshot_file.HEADER_BYTES:snapshot_file.HEADER_BYTES
                        + header.meta_length])


def _owned_entries(pg: Group, wait: Wait, rank: int, source: int,
                   held: tuple[mmap.mmap, Header] | None, local: bool,
                   keep: Callable[[int], bool] | None) -> dict[int, Any]:
    """The sharded optimizer's entries one shard's owner wrote (its extent after its
    share), read from this member's copy ``held`` when every member holds one (``local``),
    else broadcast from ``source``'s; only those ``keep`` accepts, if given."""
    meta, extent = None, None
    if local or rank == source:
        assert held is not None
        buffer, header = held
        start = snapshot_file.HEADER_BYTES + header.meta_length + header.share_length
        meta, length = _meta(held), header.length - header.share_length
        # A view of the (copy-on-write) mapping: the entries are copied out of it once.
        extent = torch.frombuffer(memoryview(buffer)[start:start + length],
                                  dtype=torch.uint8) if length \
            else torch.empty(0, dtype=torch.uint8)
    if not local:
        meta = broadcast_bytes(pg, wait, rank, source, meta)
        # Sent from a copy: gloo's work item may outlive the wait, and a view of the
        # mapping it still held would keep the mapping from being closed.
        extent = broadcast_tensor(pg, wait, rank, source,
                                   None if extent is None else extent.clone())
    assert meta is not None and extent is not None
    owned = pickle.loads(meta)["owned"]
    entries = {index: entry for index, entry in owned["state"].items()
               if keep is None or keep(index)}
    filled: dict[int, Any] = _fill(entries, tensors_in(extent, owned, tensor_refs(entries)))
    return filled
