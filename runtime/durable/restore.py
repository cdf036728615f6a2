"""Reading the durable tier back: the policy, a job's restore from its newest intact step,
verifying and loading a step, the catalog's records of it, and ``phalanx ckpt export``.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import torch
import xxhash
from fsspec.implementations.local import LocalFileSystem

from phalanx.runtime.durable.layout import (
    COMMIT,
    DATA_FILE,
    CommitRecord,
    Committed,
    DurableCorrupt,
    committed_steps,
    dtype_of,
    state_dict_of,
    url_of,
)
from phalanx.runtime.durable.resharding import load_sharded
from phalanx.runtime.flat_state import load_tensors
from phalanx.runtime.replica_group import Agree, is_sharded
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.state import tensor_refs
from phalanx.schemas.environment import CheckpointEnvironment
from phalanx.schemas.messages import DETAIL_CHARS, SnapshotRecord, SnapshotTier

log = logging.getLogger("phalanx.runtime.durable")

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp


@dataclasses.dataclass(frozen=True)
class DurablePolicy:
    """A job's durable tier as its ranks see it (from the agent's environment)."""

    url: str
    every: int
    keep: int
    resume_from: str | None  # an earlier job whose durable steps this one may start from

    @classmethod
    def of(cls, checkpoint: CheckpointEnvironment) -> DurablePolicy | None:
        """None when the job persists nothing and resumes from no other job."""
        if not checkpoint.durable_url or not (checkpoint.durable_every
                                              or checkpoint.resume_from):
            return None
        return cls(checkpoint.durable_url, checkpoint.durable_every, checkpoint.durable_keep,
                   checkpoint.resume_from)

    def sources(self, job_id: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
        """The storage, and the job directories this job may resume from."""
        fs, root = fsspec.core.url_to_fs(self.url)
        root = root.rstrip("/")
        jobs = [job_id] + ([self.resume_from] if self.resume_from else [])
        return fs, [f"{root}/{job}" for job in jobs]

    def location(self, step: Committed) -> str:
        """Where ``step`` (found under :meth:`sources`) is, as a URL."""
        return url_of(fsspec.core.url_to_fs(self.url)[0], step.directory)


Wait = Callable[[Any], None]


def restore(pg: Any, wait: Wait, world_size: int, policy: DurablePolicy, job_id: str,
            newer_than: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Sharded,
            extra: Mapping[str, Any], report: Callable[[Committed, DurableCorrupt], None],
            keep: Callable[[int], bool] | None = None,
            agree: Agree | None = None, column: int = 0) -> tuple[int, int] | None:
    """Load the newest committed durable step newer than ``newer_than`` on every member of
    ``pg``: ``(step, state bytes)``, or None when there is none. A collective.

    Every member lists the storage and checks every file of a candidate step; the members
    agree (sums over ``pg``) on the candidates and on each one's health, so a step one
    member finds damaged is skipped by all (``report`` is called where it was found) and
    the next older one tried. ``keep``: as for :func:`load`.

    In a replica group ``pg`` is this rank's column's group (``column``: the rank's in
    its group) and ``agree`` the sum over the group's ranks: the columns take a step only
    if every column finds it healthy, so every rank of a group loads the same step (its
    own part of it, :mod:`.resharding`).

    Raises:
        DurableLayoutError: the step found cannot be loaded into this model (nothing is
            loaded): another model, or another group layout that cannot be resharded.
    """
    fs, roots = policy.sources(job_id)
    candidates = sorted((c for root in roots for c in committed_steps(fs, root)
                         if c.step > newer_than), key=lambda c: (-c.step, -c.generation))
    seen = torch.tensor([len(candidates), candidates[0].step if candidates else -1],
                        dtype=torch.int64)
    wait(pg.allreduce([seen]))
    newest = candidates[0].step if candidates else -1
    if not _in_every_column(seen.tolist() == [len(candidates) * world_size,
                                              newest * world_size],
                            agree, len(candidates), newest):
        log.error("durable restore skipped: the members see different committed steps")
        return None
    for candidate in candidates:
        record = None
        try:
            record = verify(fs, candidate)
        except DurableCorrupt as exc:
            report(candidate, exc)
        healthy = torch.tensor([0 if record is None else 1], dtype=torch.int64)
        wait(pg.allreduce([healthy]))
        if not _in_every_column(int(healthy) == world_size, agree) or record is None:
            continue
        load(fs, candidate, record, model, optimizer, extra, keep, column)
        return candidate.step, record.total
    return None


def _in_every_column(holds: bool, agree: Agree | None, *same: int) -> bool:
    """Whether ``holds`` is true, and the numbers ``same`` the same, in every column of
    this rank's replica group (``agree``: the group's sum; None: a replica of one rank,
    its own column)."""
    if agree is None:
        return holds
    summed = agree(torch.tensor([float(holds), 1.0, *map(float, same)],
                                dtype=torch.float64)).tolist()
    columns = summed[1]
    return summed[0] == columns and all(total == columns * value
                                        for total, value in zip(summed[2:], same, strict=True))


# --- the catalog's view -------------------------------------------------------------------


def committed_records(record: CommitRecord, location: str, node_id: str,
                      now: float) -> list[SnapshotRecord]:
    """The catalog's announcements of a step ``node_id``'s rank committed at ``location``:
    one durable copy per shard, with its data file's size and checksum."""
    records = []
    for index in range(record.shards * record.columns):
        nbytes, checksum = record.files[f"__{index}_0.distcp"]
        column, shard = divmod(index, record.shards)
        records.append(SnapshotRecord(
            job_id=record.job_id, step=record.step, shard=shard, num_shards=record.shards,
            node_id=node_id, tier=SnapshotTier.DURABLE, nbytes=nbytes, checksum=checksum,
            created_at=now, generation=record.generation, total_bytes=record.total,
            location=location, column=column, columns=record.columns))
    return records


def corrupt_records(step: Committed, problem: DurableCorrupt, location: str, node_id: str,
                    now: float) -> list[SnapshotRecord]:
    """The catalog's announcements of a damaged durable step (found by ``node_id``'s rank):
    the damaged shard's copy, or every shard's when the step as a whole is unreadable."""
    files = range(step.shards * step.columns) if problem.shard is None else [problem.shard]
    # A shard's checksum is in the commit record; with the record unreadable it is not
    # known, and the copy is listed by a checksum it can never have.
    checksum = problem.checksum if problem.shard is not None and problem.checksum \
        else "0" * 16
    return [SnapshotRecord(job_id=step.job_id, step=step.step, shard=index % step.shards,
                           num_shards=step.shards, node_id=node_id, tier=SnapshotTier.DURABLE,
                           nbytes=0, checksum=checksum, created_at=now,
                           generation=step.generation, corrupt=True,
                           detail=str(problem)[:DETAIL_CHARS], location=location,
                           column=index // step.shards, columns=step.columns)
            for index in files]


# --- loading --------------------------------------------------------------------------------


def read_commit(fs: fsspec.AbstractFileSystem, step: Committed) -> CommitRecord:
    try:
        return CommitRecord.decode(fs.cat_file(f"{step.directory}/{COMMIT}"))
    except FileNotFoundError:  # deleted since it was listed (retention by a writer)
        raise DurableCorrupt(f"{step.directory}/{COMMIT} is gone") from None


def verify(fs: fsspec.AbstractFileSystem, step: Committed) -> CommitRecord:
    """The commit record of ``step``, every file checked against it.

    Raises:
        DurableCorrupt: a file is missing, of another size or fails its checksum.
    """
    record = read_commit(fs, step)
    for name, (nbytes, checksum) in sorted(record.files.items()):
        data_file = DATA_FILE.match(name)
        shard = int(data_file["shard"]) if data_file else None
        try:
            data = fs.cat_file(f"{step.directory}/{name}")
        except FileNotFoundError:
            raise DurableCorrupt(f"{step.directory}/{name} is missing", shard,
                                 checksum) from None
        if len(data) != nbytes or f"{xxhash.xxh3_64_intdigest(data):016x}" != checksum:
            raise DurableCorrupt(f"{step.directory}/{name}: checksum mismatch (step "
                                 f"{step.step} is damaged)", shard, checksum)
    return record


def load(fs: fsspec.AbstractFileSystem, step: Committed, record: CommitRecord,
         model: torch.nn.Module, optimizer: torch.optim.Optimizer | Sharded,
         extra: Mapping[str, Any], keep: Callable[[int], bool] | None = None,
         column: int = 0) -> None:
    """Load the verified durable ``step`` into ``model``, ``optimizer``, ``extra`` (and
    the RNG), read with ``torch.distributed.checkpoint``; ``keep``: a sharded optimizer's
    new partition (only the optimizer entries of the indices it accepts are read). A model
    sharded over a replica group reads its own part of each tensor, whatever group layout
    wrote the step (:func:`~.resharding.load_sharded`; ``column``: the rank's in its group).

    Raises:
        DurableLayoutError: the step does not fit this model (nothing is loaded).
    """
    import torch.distributed.checkpoint as dcp  # not with the runtime: layout._flatten

    reader = dcp.FileSystemReader(step.directory) if isinstance(fs, LocalFileSystem) \
        else _fsspec_reader(fs, step.directory)
    meta = pickle.loads(record.meta)
    if is_sharded(model):
        assert keep is None, "a replica group's optimizer steps its own shards"
        load_sharded(reader, meta, model, optimizer, extra, column)
        return
    meta.pop("shards", None)  # a group's step, loaded whole into a model held whole
    skipped = [index for index in meta["optimizer"]["state"]
               if keep is not None and not keep(index)]
    unread = {meta["model_tensors"] + ref
              for ref in tensor_refs([meta["optimizer"]["state"][index] for index in skipped])}
    tensors = [torch.empty(0) if i in unread else torch.empty(shape, dtype=dtype_of(dtype))
               for i, (shape, dtype) in enumerate(meta["tensors"])]
    wanted = state_dict_of(meta, tensors)
    for index in skipped:
        del wanted["optimizer"]["state"][index]
    with warnings.catch_warnings():
        # Each rank reads the files it needs by itself, on purpose: DCP's notice that it
        # assumes a single process would land in every rank's log at every restore.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    load_tensors(tensors, meta, model, optimizer, extra, keep=keep)


def _fsspec_reader(fs: fsspec.AbstractFileSystem, directory: str) -> dcp.StorageReader:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return FsspecReader(f"{protocol}://{directory}", **fs.storage_options)


def export(fs: fsspec.AbstractFileSystem, step: Committed, target: Path) -> list[str]:
    """Copy the DCP files of the committed ``step`` (each checked against its commit
    record) into the local directory ``target``: a plain DCP checkpoint. The files copied.

    Raises:
        DurableCorrupt: a file does not match the commit record.
    """
    record = verify(fs, step)
    target.mkdir(parents=True, exist_ok=True)
    for name in record.files:
        (target / name).write_bytes(fs.cat_file(f"{step.directory}/{name}"))
    return sorted(record.files)
