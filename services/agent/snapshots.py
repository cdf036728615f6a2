"""The node's snapshot store: shared-memory buffers the agent owns and ranks write.

Ranks snapshot their share of a job's state after committed steps
(:mod:`phalanx.runtime.snapshot`) into buffer files this store creates on a
tmpfs (``/dev/shm`` by default). The files belong to the agent, not the rank:
they outlive the rank that wrote them, so a job whose ranks all died resumes
from them, and the agent is what bounds and frees them.

* **Reservation.** A rank asks once per membership for a ring of buffers for
  its shard (:meth:`SnapshotStore.reserve`): ``<root>/<job>/w<shards>-s<shard>.<i>``
  (``w<shards>-s<shard>-c<column>.<i>`` for column ``s`` > 0 of a job of replica
  groups: each group rank's shard of the model is a state of its own), sized with
  ``ftruncate`` (tmpfs pages are taken only as they are written). A file that
  exists is kept and only grown, never shrunk or cleared, so the snapshots it
  holds stay readable for the restore that comes first.
* **Bound.** The bytes of every buffer file count against ``limit`` (default:
  half the tmpfs); a reservation that would pass it is refused with
  :class:`SnapshotRefused` naming the numbers, and the rank trains on without
  snapshots. The agent reports the bytes held, the bound and the last refusal
  in its node record.
* **Retention.** A ring overwrites its oldest buffer, so each shard keeps its
  last ``buffers`` snapshots. Rings of an earlier membership (another shard
  count) are deleted once the current membership's rings here hold two
  committed steps (:meth:`prune`, every heartbeat): a member commits its
  second snapshot only after every member took its first (they are
  separated by a step's all-reduce), and no ring overwrites its newest commit,
  so from then on a step of the current membership is complete across the
  members' nodes and a restore never reaches back to an older membership.
  Everything of a job is deleted when it ends (:meth:`drop`), and the whole
  store when the agent stops cleanly. A crashed agent leaves the store to the
  agent restarted with the same work directory (which prunes nothing of a job
  until one of its ranks reserves again), and so does a stop for a restart
  (``phalanx down``: the memory tier outlives the cluster).
* **Abandoned stores.** A store in the default place names the work directory
  it belongs to (:data:`OWNER_FILE`). Its own agent is the only one that could
  use it again, and only from that directory: once the directory is gone (a
  local cluster's data directory deleted after ``phalanx down``, a test's temporary
  one), an agent starting on the host deletes the store (:func:`collect_abandoned`),
  so tmpfs memory, which is RAM, does not leak until the next boot.
* **Ownership.** Where jobs run as users of their own (:mod:`.identity`), a job's
  directory here is its user's, mode 0700, and so is every buffer in it, its buddies'
  replicas included: its ranks write and restore them, no other job's can even list
  them. The agent, root, reads and replicates them all.
* **Replicas.** The agent also keeps its buddies' snapshots
  (:mod:`.replication`): a replica of another node's ring buffer ``<name>`` is
  ``<root>/<job>/buddy.<node>.<name>``, beside this node's own rings, so a
  rank's restore lists it as it lists its own node's buffers. Replicas count
  against the same bound (:meth:`make_room`), go with their job, and a node's
  replicas of an earlier membership are pruned by the rule above, the
  membership being that of the newest step replicated from it
  (:meth:`prune_replicas`).
* **Departed sources.** A node that runs no member of the job's newest generation
  sends no newer replica, so that rule never prunes what came from it: a node
  lost, a buddy re-placed, or the copies a restore fetched from a holder
  (:mod:`phalanx.runtime.fetch`). The agent follows each job's generations
  (:meth:`SnapshotStore.generation_seen`); once this node's own rings hold two
  committed steps written in the newest one since the agent saw it, every
  replica from a node outside that generation is deleted
  (:meth:`SnapshotStore.prune_departed`), by the rule above's argument: from
  then on a step of that generation is complete on its members' nodes.
  Commits the rings held before the agent saw the generation are not counted:
  generation numbers start over when a job is admitted again, and what the
  earlier admission left may be the very state the new one restores.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

from phalanx.schemas import snapshot_file
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import SnapshotReserve
from phalanx.schemas.snapshot_file import Header
from phalanx.services.agent.core import JobUser

log = logging.getLogger("phalanx.agent.snapshots")
_RING_FILE = re.compile(
    r"^w(?P<shards>\d+)-s(?P<shard>\d+)(?:-c(?P<column>[1-9]\d*))?\.(?P<i>\d+)$")
_REPLICA_FILE = re.compile(rf"^{re.escape(snapshot_file.REPLICA_PREFIX)}"
                           r"(?P<source>[A-Za-z0-9_\-]+)\.(?P<ring>w\d+-s\d+(?:-c\d+)?\.\d+)$")


def ring_name(shards: int, shard: int, column: int, i: int) -> str:
    """The name of buffer ``i`` of the ring of shard ``shard`` of ``shards`` (of replica
    group column ``column``)."""
    return f"w{shards}-s{shard}{f'-c{column}' if column else ''}.{i}"

class SnapshotRefused(PhalanxError, OSError):
    """A reservation would take the node's snapshot memory past its bound."""


#: In a store's root: the work directory of the agent it belongs to.
OWNER_FILE = ".owner"
#: Beside the stores: held while an agent collects abandoned stores and claims its own.
LOCK_FILE = ".lock"


def default_root(node_id: str, work_dir: Path) -> Path:
    """``/dev/shm/phalanx-<uid>/<node>-<hash of the work dir>``: one store per agent, even
    with several agents (a local cluster) on one host."""
    tag = f"{zlib.crc32(str(work_dir.resolve()).encode()):08x}"
    return Path("/dev/shm") / f"phalanx-{os.getuid()}" / f"{node_id}-{tag}"


def claim(root: Path, work_dir: Path) -> None:
    """Mark ``root`` as the store of the agent working in ``work_dir``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / OWNER_FILE).write_text(str(work_dir.resolve()))


def claim_in_default_place(root: Path, work_dir: Path) -> list[tuple[Path, int]]:
    """Claim ``root`` (:func:`default_root`) for the agent working in ``work_dir``, made
    first, and delete the abandoned stores beside it (:func:`collect_abandoned`), all
    under one lock of the host's stores.

    Agents of several clusters start on one host at once (the suite's): one that named a
    work directory not made yet, or claimed while another was collecting, had its store
    deleted under it as abandoned and failed to start.
    """
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        deleted = collect_abandoned(root)
        work_dir.mkdir(parents=True, exist_ok=True)
        claim(root, work_dir)
    return deleted


def collect_abandoned(root: Path) -> list[tuple[Path, int]]:
    """Delete the stores beside ``root`` (this agent's, in the default place) whose
    agent's work directory no longer exists; each one deleted, with the bytes it held.
    A store that names no owner (made before owners were written) is left alone."""
    deleted = []
    for store in root.parent.iterdir() if root.parent.is_dir() else []:
        owner_file = store / OWNER_FILE
        if store == root or not owner_file.is_file():
            continue
        try:
            owner = Path(owner_file.read_text())
        except OSError:
            continue  # being deleted meanwhile
        if not owner.is_absolute() or owner.exists():
            continue
        held = sum(f.stat().st_size for f in store.glob("*/*") if f.is_file())  # buffers
        shutil.rmtree(store, ignore_errors=True)
        log.info("deleted an abandoned snapshot store", extra={
            "store": str(store), "work_dir": str(owner), "bytes": held})
        deleted.append((store, held))
    return deleted


def default_limit(root: Path) -> int:
    """Half of the tmpfs ``root`` is on."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    stat = os.statvfs(probe)
    return stat.f_blocks * stat.f_frsize // 2


def _grow(path: Path, nbytes: int, owner: JobUser | None = None) -> None:
    """Create the buffer file at ``path`` or grow it to ``nbytes`` (sparse: tmpfs pages are
    taken as they are written); never shrunk, so what it holds stays readable. With
    ``owner`` (the job's user), the file and its job's directory are that user's, and
    the directory mode 0700: no other job's process may read or write them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(path.parent, owner.uid, owner.gid)
        os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if owner is not None:
            os.fchown(fd, owner.uid, owner.gid)
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class NewestGeneration:
    """A job's newest generation as this agent saw it, and the commits its own rings
    held then (none of them evidence that the generation trains)."""

    generation: int
    nodes: frozenset[str]
    before: frozenset[tuple[str, Header]]


class SnapshotStore:
    """The snapshot buffers of one node, under ``root``, at most ``limit`` bytes; with
    ``owner`` (job id -> its user, :mod:`.identity`), each job's directory and buffers
    are its user's alone."""

    def __init__(self, root: Path, limit: int,
                 owner: Callable[[str], JobUser | None] | None = None) -> None:
        if limit < 0:
            raise ValueError(f"the snapshot limit must be >= 0 bytes, got {limit}")
        self.root = root
        self.owner = owner
        self.limit = limit
        self.refused = ""  # why the last reservation was refused ("" while none was)
        self.current: dict[str, int] = {}  # job -> the shard count last reserved for
        self.newest: dict[str, NewestGeneration] = {}  # job -> its newest generation seen

    def _owner(self, job_id: str) -> JobUser | None:
        return None if self.owner is None else self.owner(job_id)

    def job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def used(self) -> int:
        """Bytes of every buffer file held."""
        return sum(size for _, size in self._files())

    def _files(self) -> list[tuple[Path, int]]:
        found = []
        if self.root.is_dir():
            for job in self.root.iterdir():
                for path in job.iterdir() if job.is_dir() else []:
                    try:
                        found.append((path, path.stat().st_size))
                    except FileNotFoundError:  # deleted meanwhile
                        continue
        return found

    def reserve(self, request: SnapshotReserve) -> list[Path]:
        """Create (or grow) the ring of buffers ``request`` asks for; their paths.

        Raises:
            SnapshotRefused: the buffers would take the store past its limit.
        """
        directory = self.job_dir(request.job_id)
        paths = [directory / ring_name(request.shards, request.shard, request.column, i)
                 for i in range(request.buffers)]
        sizes = {path: size for path, size in self._files()}
        more = sum(max(0, request.nbytes - sizes.get(path, 0)) for path in paths)
        used = sum(sizes.values())
        if used + more > self.limit:
            self.refused = (
                f"{request.replica_id} of {request.job_id} asked for {request.buffers} x "
                f"{request.nbytes} B of snapshot memory: {more} B more than held would make "
                f"{used + more} B, over this node's limit of {self.limit} B")
            raise SnapshotRefused(self.refused)
        owner = self._owner(request.job_id)
        for path in paths:
            _grow(path, request.nbytes, owner)
        self.current[request.job_id] = request.shards
        return paths

    def steps_held(self, job_id: str, source: str | None = None) -> dict[int, set[int]]:
        """Per shard count (a membership's ring set), the committed steps held: of this
        node's own rings, or of the replicas of node ``source``'s."""
        held: dict[int, set[int]] = {}
        for path in self._rings(job_id, source):
            steps = held.setdefault(self._shards_of(path), set())
            header = snapshot_file.committed_header(path)
            if header is not None:
                steps.add(header.step)
        return held

    def _rings(self, job_id: str, source: str | None) -> list[Path]:
        directory = self.job_dir(job_id)
        found = []
        for path in directory.iterdir() if directory.is_dir() else []:
            replica = _REPLICA_FILE.match(path.name)
            if (replica["source"] if replica else None) == source and \
                    _RING_FILE.match(self.ring_of(path)):
                found.append(path)
        return found

    @staticmethod
    def ring_of(path: Path) -> str:
        """The ring buffer's name of a file of the store (a replica's name adds its source)."""
        replica = _REPLICA_FILE.match(path.name)
        return replica["ring"] if replica else path.name

    @classmethod
    def _shards_of(cls, path: Path) -> int:
        """The shard count of the ring buffer file at ``path`` (one :meth:`_rings` found)."""
        ring = _RING_FILE.match(cls.ring_of(path))
        if ring is None:
            raise ValueError(f"{path.name} is not a ring buffer file")
        return int(ring["shards"])

    def copy_of(self, job_id: str, step: int, shards: int, shard: int, column: int = 0
                ) -> tuple[Path, Header, str | None] | None:
        """A committed copy held here of shard ``shard`` of ``shards`` (of replica group
        column ``column``) of ``job_id``'s snapshot of ``step``: its file, its header, and
        whose ring it is a replica of (None: this node's own ring); None if this node
        holds none."""
        directory = self.job_dir(job_id)
        for path in sorted(directory.iterdir()) if directory.is_dir() else []:
            ring = _RING_FILE.match(self.ring_of(path))
            if ring is None or (int(ring["shards"]), int(ring["shard"]),
                                int(ring["column"] or 0)) != (shards, shard, column):
                continue
            header = snapshot_file.committed_header(path)
            if header is not None and header.step == step:
                replica = _REPLICA_FILE.match(path.name)
                return path, header, replica["source"] if replica else None
        return None

    def own_rings(self) -> list[Path]:
        """Every ring buffer file of this node's own ranks, of every job."""
        return [path for job_id in sorted(self.jobs()) for path in self._rings(job_id, None)]

    def replica_path(self, job_id: str, source: str, ring: str) -> Path:
        """Where the replica of node ``source``'s ring buffer ``ring`` of ``job_id`` is.

        Raises:
            ValueError: ``ring`` is not a ring buffer's name or ``source`` not a node id
                (a name from the network never names another path).
        """
        path = self.job_dir(job_id) / f"{snapshot_file.REPLICA_PREFIX}{source}.{ring}"
        if not _RING_FILE.match(ring) or not _REPLICA_FILE.match(path.name):
            raise ValueError(f"{source!r} / {ring!r}: not a node id and a ring buffer name")
        return path

    def make_room(self, path: Path, nbytes: int, why: str) -> None:
        """Create (or grow) the file at ``path`` to ``nbytes`` within the node's bound.

        Raises:
            SnapshotRefused: the file would take the store past its limit (``why`` names
                what asked).
        """
        sizes = {p: size for p, size in self._files()}
        more = max(0, nbytes - sizes.get(path, 0))
        used = sum(sizes.values())
        if used + more > self.limit:
            self.refused = (f"{why}: {more} B more than held would make {used + more} B, "
                            f"over this node's limit of {self.limit} B")
            raise SnapshotRefused(self.refused)
        _grow(path, nbytes, self._owner(path.parent.name))

    def prune_replicas(self, job_id: str) -> int:
        """Delete each source's replicas of ``job_id`` from earlier memberships once the
        membership of the newest step replicated from it holds two committed steps there
        (the rule of :meth:`prune`); returns the files deleted."""
        deleted = 0
        directory = self.job_dir(job_id)
        sources = {m["source"] for p in (directory.iterdir() if directory.is_dir() else [])
                   if (m := _REPLICA_FILE.match(p.name))}
        for source in sources:
            newest: tuple[int, int] | None = None  # step, shards
            for path in self._rings(job_id, source):
                header = snapshot_file.committed_header(path)
                if header is not None and (newest is None or header.step > newest[0]):
                    newest = (header.step, header.shards)
            held = self.steps_held(job_id, source)
            if newest is None or len(held.get(newest[1], ())) < 2:
                continue
            for path in self._rings(job_id, source):
                if self._shards_of(path) != newest[1]:
                    path.unlink(missing_ok=True)
                    deleted += 1
        return deleted

    def prune(self, job_id: str) -> int:
        """Delete the rings of ``job_id``'s earlier memberships (shard counts other than the
        one last reserved here) once the current one's rings hold two committed steps (the
        module docstring says why that is safe); returns the files deleted."""
        current = self.current.get(job_id)
        held = self.steps_held(job_id)
        if current is None or len(held.get(current, ())) < 2:
            return 0
        deleted = 0
        for path in self._rings(job_id, None):
            if self._shards_of(path) != current:
                path.unlink(missing_ok=True)
                deleted += 1
        return deleted

    def generation_seen(self, job_id: str, generation: int, nodes: Iterable[str]) -> None:
        """``job_id``'s newest generation is ``generation``, its members on ``nodes``."""
        seen = self.newest.get(job_id)
        if seen is None or seen.generation != generation:
            self.newest[job_id] = NewestGeneration(generation, frozenset(nodes),
                                                   self._own_commits(job_id))

    def _own_commits(self, job_id: str) -> frozenset[tuple[str, Header]]:
        commits = set()
        for path in self._rings(job_id, None):
            header = snapshot_file.committed_header(path)
            if header is not None:
                commits.add((path.name, header))
        return frozenset(commits)

    def prune_departed(self, job_id: str) -> int:
        """Delete ``job_id``'s replicas from nodes outside its newest generation once one
        of this node's own rings holds two steps committed in it since it was seen (the
        module docstring says why that is safe); returns the files deleted."""
        newest = self.newest.get(job_id)
        if newest is None:
            return 0
        steps: dict[str, set[int]] = {}  # ring (without its buffer index) -> new steps
        for name, header in self._own_commits(job_id) - newest.before:
            if header.generation == newest.generation:
                steps.setdefault(name.rpartition(".")[0], set()).add(header.step)
        if not any(len(held) >= 2 for held in steps.values()):
            return 0
        deleted = 0
        directory = self.job_dir(job_id)
        for path in list(directory.iterdir()) if directory.is_dir() else []:
            replica = _REPLICA_FILE.match(path.name)
            if replica is not None and replica["source"] not in newest.nodes:
                path.unlink(missing_ok=True)
                deleted += 1
        return deleted

    def jobs(self) -> set[str]:
        return {p.name for p in self.root.iterdir() if p.is_dir()} if self.root.is_dir() \
            else set()

    def drop(self, job_id: str) -> None:
        """Delete every buffer of ``job_id`` (its job ended)."""
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)
        self.current.pop(job_id, None)
        self.newest.pop(job_id, None)

    def clear(self) -> None:
        """Delete the whole store (the agent stops cleanly)."""
        shutil.rmtree(self.root, ignore_errors=True)
