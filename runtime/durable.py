"""The durable checkpoint tier: a step in PyTorch Distributed Checkpoint format on storage.

Every ``checkpoint.durable_every_steps`` committed steps each rank persists the
share it just snapshotted into its node's memory (:mod:`.snapshot`) to
``checkpoint.durable_url`` — a directory (a shared path for multi-node) or any
fsspec URL (``s3://bucket/prefix``). The rank does it on a background thread
(:class:`DurableWriter`), reading its own snapshot buffer, so the training
thread pays nothing beyond handing over the buffer's path; the buffer stays
pinned (the ring does not overwrite it) until the write is over.

**Layout.** One directory a step attempt:
``<url>/<job>/step-<step>-g<generation>-w<shards>/``, holding a plain DCP
checkpoint (``.metadata`` and one ``__<shard>_0.distcp`` per shard) of the
state dict ``{"model": ..., "optimizer": ..., "extra": {name: ...},
"phalanx": {"step": ...}}``, so ``torch.distributed.checkpoint.load`` reads it
with no phalanx code. The flat state's shares cut no element
(:func:`~.snapshot_file.share`), so shard ``r`` writes the elements of its byte
range as tensor chunks (:func:`boxes`: contiguous boxes of each tensor); shard
0 also writes the non-tensor leaves (learning rates, betas, ...). A sharded
optimizer's owner also writes the entries it owns (its snapshot's second
extent), whole, under the keys a plain optimizer's would have
(``optimizer.state.<index>.<name>``): the committer lays the step out as the
consolidated state (:func:`consolidated_meta`), which loads into a plain
optimizer as well as into a sharded one at any world size.

**Commit.** Shard ``r``'s writer writes its data file, then a marker
``shard-<r>.done`` (its storage entries and the file's xxh3-64), then lists the
markers; the writer that sees all of them (the last one to finish always
does: the stores are read-after-write consistent, local file systems and S3
alike) writes ``.metadata`` and then the commit record ``.phalanx-commit``
(every file's size and checksum and the state's meta), each as one atomic
write (a rename on a file system, a single PUT on an object store). Two
writers that both see every marker write the same bytes. A step without its
commit record does not exist: a rank killed mid-write leaves an attempt that is
never loaded and that retention deletes. Retention (by every committer): the
newest ``durable_keep`` committed steps of the job stay; older steps and
abandoned attempts older than the newest committed step are deleted.

**Loading** (:func:`load`, path 4 of docs/architecture.md, Checkpoints): every
file's checksum is checked against the commit record before anything is
loaded; a mismatch raises :class:`DurableCorrupt` and the caller goes on to the
next older step. The state is then read with ``torch.distributed.checkpoint``
itself (``FsspecReader``), into tensors laid out as the commit record's meta
says.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import math
import mmap
import pickle
import queue
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from phalanx.runtime import snapshot_file
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.snapshot import load_tensors
from phalanx.runtime.snapshot_file import Header, SnapshotFileError
from phalanx.runtime.state import _fill, _TensorRef, tensor_refs
from phalanx.schemas.messages import DETAIL_CHARS, SnapshotRecord, SnapshotTier

log = logging.getLogger("phalanx.runtime.durable")
COMMIT = ".phalanx-commit"
METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(?P<step>\d{10})-g(?P<generation>\d+)-w(?P<shards>\d+)$")
_DATA_FILE = re.compile(r"^__(?P<shard>\d+)_0\.distcp$")


class DurableCorrupt(SnapshotFileError):
    """A durable step's file does not match its commit record (or the record is unreadable).

    ``shard`` is the shard whose data file is damaged, and ``checksum`` what the record
    says it must hash to; None when the step as a whole is (its commit record or
    ``.metadata``): then no shard of it can be loaded.
    """

    def __init__(self, problem: str, shard: int | None = None,
                 checksum: str | None = None) -> None:
        super().__init__(problem)
        self.shard, self.checksum = shard, checksum


Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first element


def boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements ``[start, end)`` of a row-major tensor of ``shape`` as contiguous boxes:
    ``(offsets, sizes, first element)``, each a DCP chunk."""
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    found: list[Box] = []
    row = start // inner
    if start % inner:  # the head: part of one row
        stop = min(end, (row + 1) * inner)
        for offsets, sizes, first in boxes(shape[1:], start - row * inner, stop - row * inner):
            found.append(((row, *offsets), (1, *sizes), row * inner + first))
        start = stop
    whole = (end - start) // inner
    if whole > 0 and start < end:  # whole rows
        row = start // inner
        found.append(((row, *(0,) * (len(shape) - 1)), (whole, *shape[1:]), start))
        start += whole * inner
    if start < end:  # the tail: the start of one row
        row = start // inner
        for offsets, sizes, first in boxes(shape[1:], 0, end - start):
            found.append(((row, *offsets), (1, *sizes), row * inner + first))
    return found


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _element_size(name: str) -> int:
    return torch.empty((), dtype=_dtype(name)).element_size()


def state_dict_of(meta: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The nested state dict a durable step holds, its tensors ``tensors`` (in
    :func:`~.snapshot.flat_state`'s order)."""
    n = meta["model_tensors"]
    rest = tensors[n:]
    return {"model": dict(zip(meta["model_names"], tensors[:n], strict=True)),
            "optimizer": _fill(meta["optimizer"], rest),
            "extra": {name: _fill(skeleton, rest) for name, skeleton in meta["extra"].items()},
            "phalanx": {"step": meta["step"]}}


def consolidated_meta(meta: dict[str, Any], owned: list[dict[str, Any]]) -> dict[str, Any]:
    """A sharded step's meta as a plain optimizer's: ``meta``'s tensors, then every owner's
    entries (``owned``: each shard's ``meta["owned"]``, in shard order), the optimizer's
    state their union. The replicated tensors keep their ``offsets``; the owned ones have
    none (each is written whole by its owner)."""
    tensors = list(meta["tensors"])
    optimizer = dict(meta["optimizer"])
    state: dict[int, Any] = {}
    for extent in owned:
        base = len(tensors) - meta["model_tensors"]  # refs count from the first non-model
        refs = [_TensorRef(base + j) for j in range(len(extent["tensors"]))]
        state.update(_fill(extent["state"], refs))
        tensors.extend(extent["tensors"])
    optimizer["state"] = dict(sorted(state.items()))
    rest = {key: value for key, value in meta.items() if key != "owned"}
    return {**rest, "optimizer": optimizer, "tensors": tensors}


def owned_plan(extent: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The DCP keys of an owner's entries (``meta["owned"]``): each tensor's, and the
    non-tensor leaves with their values."""
    placeholders = [torch.empty(0) for _ in extent["tensors"]]
    flat, _ = flatten_state_dict({"optimizer": {"state": _fill(extent["state"],
                                                              placeholders)}})
    return _names(flat, placeholders)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every part of the state goes in DCP: each tensor's name, and the non-tensor
    leaves (written as byte items by shard 0)."""

    names: list[str]
    objects: dict[str, Any]
    mappings: dict[str, Any]

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Plan:
        placeholders = [torch.empty(0) for _ in meta["tensors"]]
        flat, mappings = flatten_state_dict(state_dict_of(meta, placeholders))
        names, objects = _names(flat, placeholders)
        return cls(names, objects, mappings)


def _names(flat: dict[str, Any], placeholders: list[torch.Tensor]
           ) -> tuple[list[str], dict[str, Any]]:
    """Each placeholder tensor's key in the flattened state dict ``flat``, and the
    non-tensor leaves."""
    index = {id(t): i for i, t in enumerate(placeholders)}
    names = [""] * len(placeholders)
    objects = {}
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            names[index[id(value)]] = fqn
        else:
            objects[fqn] = value
    return names, objects


def shard_boxes(meta: dict[str, Any], shard: int, shards: int) -> list[tuple[int, Box]]:
    """The chunks shard ``shard`` of ``shards`` writes: (tensor index, box)."""
    offset, length = snapshot_file.share(meta["total"], shard, shards)
    found = []
    for i, ((shape, dtype), at) in enumerate(zip(meta["tensors"], meta["offsets"],
                                                 strict=True)):
        size = _element_size(dtype)
        nbytes = math.prod(shape) * size
        lo, hi = max(offset, at), min(offset + length, at + nbytes)
        if lo < hi:
            found.extend((i, box) for box in boxes(tuple(shape), (lo - at) // size,
                                                   (hi - at) // size))
    return found


# --- storage --------------------------------------------------------------------------------


def step_dir(root: str, job_id: str, step: int, generation: int, shards: int) -> str:
    return f"{root.rstrip('/')}/{job_id}/step-{step:010d}-g{generation}-w{shards}"


def _put(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``path`` at once: a rename on a file system, one PUT on an object store."""
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, data)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """What makes a durable step exist: its files' sizes and checksums, and the meta."""

    job_id: str
    step: int
    generation: int
    shards: int
    total: int
    files: dict[str, tuple[int, str]]  # name -> (bytes, xxh3-64 hex)
    meta: bytes

    def encode(self) -> bytes:
        row = dataclasses.asdict(self)
        row["meta"] = base64.b64encode(self.meta).decode()
        return json.dumps(row, indent=1).encode()

    @classmethod
    def decode(cls, data: bytes) -> CommitRecord:
        try:
            row = json.loads(data)
            row["meta"] = base64.b64decode(row["meta"])
            row["files"] = {k: (int(v[0]), str(v[1])) for k, v in row["files"].items()}
            return cls(**row)
        except (ValueError, KeyError, TypeError) as exc:
            raise DurableCorrupt(f"unreadable commit record: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Committed:
    """A committed durable step found on storage."""

    directory: str
    step: int
    generation: int
    shards: int

    @property
    def job_id(self) -> str:
        """The job that wrote it (its directory's parent is ``<url>/<job>``)."""
        return self.directory.rsplit("/", 2)[-2]


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` on ``fs`` as a URL another process can open (a plain path if local)."""
    if isinstance(fs, LocalFileSystem):
        return path
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple) else fs.protocol
    return f"{protocol}://{path}"


def committed_steps(fs: fsspec.AbstractFileSystem, job_root: str) -> list[Committed]:
    """The committed steps under ``<url>/<job>``, newest first."""
    found = []
    try:
        entries = fs.ls(job_root, detail=False)
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match and fs.exists(f"{entry.rstrip('/')}/{COMMIT}"):
            found.append(Committed(entry.rstrip("/"), int(match["step"]),
                                   int(match["generation"]), int(match["shards"])))
    return sorted(found, key=lambda c: (-c.step, -c.generation))


def retain(fs: fsspec.AbstractFileSystem, job_root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` committed steps, and attempts that never
    committed older than the newest committed step; the directories deleted."""
    committed = committed_steps(fs, job_root)
    if not committed:
        return []
    kept = {c.directory for c in committed[:keep]}
    newest = committed[0].step
    deleted = []
    for entry in fs.ls(job_root, detail=False):
        entry = entry.rstrip("/")
        match = _STEP_DIR.match(entry.rsplit("/", 1)[-1])
        if not match or entry in kept:
            continue
        is_committed = any(c.directory == entry for c in committed)
        if is_committed or int(match["step"]) <= newest:
            fs.rm(entry, recursive=True)
            deleted.append(entry)
    return deleted


# --- writing --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Persisted:
    """One shard written, and the step committed if this writer committed it."""

    step: int
    shard: int
    nbytes: int
    checksum: str
    committed: CommitRecord | None
    directory: str
    location: str  # the directory as a URL (:func:`url_of`)
    seconds: float


def write_shard(fs: fsspec.AbstractFileSystem, root: str, header: Header, meta_bytes: bytes,
                data: memoryview, keep: int) -> Persisted:
    """Persist shard ``header.shard`` (its bytes ``data``, verified by the caller), then
    commit the step if every shard's marker is there, then apply retention."""
    started = time.perf_counter()
    meta = pickle.loads(meta_bytes)
    plan = Plan.of(meta)
    directory = step_dir(root, header.job_id, header.step, header.generation, header.shards)
    fs.makedirs(directory, exist_ok=True)
    name = f"__{header.shard}_0.distcp"
    storage: dict[MetadataIndex, _StorageInfo] = {}
    digest, at = xxhash.xxh3_64(), 0
    with fs.open(f"{directory}/{name}", "wb") as out:
        def item(index: MetadataIndex, payload: bytes) -> None:
            nonlocal at
            out.write(payload)
            digest.update(payload)
            storage[index] = _StorageInfo(name, at, len(payload))
            at += len(payload)

        def saved(index: MetadataIndex, value: Any) -> None:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            item(index, buffer.getvalue())

        if header.shard == 0:
            for fqn, value in plan.objects.items():
                saved(MetadataIndex(fqn), value)
        for i, (offsets, sizes, first) in shard_boxes(meta, header.shard, header.shards):
            dtype = meta["tensors"][i][1]
            size = _element_size(dtype)
            lo = meta["offsets"][i] + first * size - header.offset
            chunk = torch.frombuffer(data[lo:lo + math.prod(sizes) * size],
                                     dtype=_dtype(dtype)).reshape(sizes)
            saved(MetadataIndex(plan.names[i], torch.Size(offsets)), chunk)
        extent = meta.get("owned")
        if extent is not None:  # a sharded optimizer's entries this shard's owner holds
            names, objects = owned_plan(extent)
            for fqn, value in objects.items():
                saved(MetadataIndex(fqn), value)
            for j, ((shape, dtype), start) in enumerate(zip(extent["tensors"],
                                                            extent["offsets"], strict=True)):
                lo, numel = header.share_length + start, math.prod(shape)
                whole = torch.frombuffer(data[lo:lo + numel * _element_size(dtype)],
                                         dtype=_dtype(dtype)).reshape(shape) if numel \
                    else torch.empty(shape, dtype=_dtype(dtype))
                saved(MetadataIndex(names[j], torch.Size((0,) * len(shape))), whole)
    checksum = f"{digest.intdigest():016x}"
    _put(fs, f"{directory}/shard-{header.shard}.done", pickle.dumps(
        {"file": name, "bytes": at, "xxh3": checksum, "storage": storage,
         "owned": meta.get("owned")}))
    record = _commit(fs, directory, header, meta, meta_bytes, plan)
    if record is not None:
        for gone in retain(fs, f"{root.rstrip('/')}/{header.job_id}", keep):
            log.info("durable step deleted (retention): %s", gone)
    return Persisted(header.step, header.shard, at, checksum, record, directory,
                     url_of(fs, directory), time.perf_counter() - started)


def _commit(fs: fsspec.AbstractFileSystem, directory: str, header: Header,
            meta: dict[str, Any], meta_bytes: bytes, plan: Plan) -> CommitRecord | None:
    """Write ``.metadata`` and the commit record if every shard's marker is there."""
    markers = []
    for shard in range(header.shards):
        try:
            markers.append(pickle.loads(fs.cat_file(f"{directory}/shard-{shard}.done")))
        except FileNotFoundError:
            return None  # a shard still being written: its writer commits
    storage = {index: info for marker in markers for index, info in marker["storage"].items()}
    chunks: dict[int, list[ChunkStorageMetadata]] = {}
    for shard in range(header.shards):
        for i, (offsets, sizes, _) in shard_boxes(meta, shard, header.shards):
            chunks.setdefault(i, []).append(ChunkStorageMetadata(torch.Size(offsets),
                                                                 torch.Size(sizes)))
    if "owned" in meta:  # a sharded optimizer: the step is laid out as the consolidated state
        replicated = len(meta["tensors"])
        meta = consolidated_meta(meta, [marker["owned"] for marker in markers])
        meta_bytes, plan = pickle.dumps(meta), Plan.of(meta)
        for i, (shape, _) in enumerate(meta["tensors"][replicated:], replicated):
            chunks[i] = [ChunkStorageMetadata(torch.Size((0,) * len(shape)),
                                              torch.Size(shape))]
    described: dict[str, Any] = {fqn: BytesStorageMetadata() for fqn in plan.objects}
    for i, (shape, dtype) in enumerate(meta["tensors"]):
        described[plan.names[i]] = TensorStorageMetadata(
            TensorProperties(dtype=_dtype(dtype)), torch.Size(shape), chunks.get(i, []))
    metadata = pickle.dumps(Metadata(state_dict_metadata=described, planner_data=plan.mappings,
                                     storage_data=storage, version=CURRENT_DCP_VERSION))
    _put(fs, f"{directory}/{METADATA}", metadata)
    files = {m["file"]: (m["bytes"], m["xxh3"]) for m in markers}
    files[METADATA] = (len(metadata), f"{xxhash.xxh3_64_intdigest(metadata):016x}")
    record = CommitRecord(header.job_id, header.step, header.generation, header.shards,
                          header.total, files, meta_bytes)
    _put(fs, f"{directory}/{COMMIT}", record.encode())  # the step exists from here
    return record


class DurableWriter:
    """Persists one snapshot at a time on a background thread.

    Args:
        url: the durable root (a directory or an fsspec URL).
        keep: committed steps kept per job.
        done: called on the writer's thread with each :class:`Persisted` (announce it).
    """

    def __init__(self, url: str, keep: int, done: Callable[[Persisted], None]) -> None:
        self.url, self.keep, self.done = url, keep, done
        self.fs, self.root = fsspec.core.url_to_fs(url)
        if isinstance(self.fs, LocalFileSystem):
            self.root = str(Path(self.root).resolve())
        self._work: queue.SimpleQueue[tuple[Path, Header] | None] = queue.SimpleQueue()
        self._busy: Path | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="phalanx-durable", daemon=True)
        self._thread.start()

    @property
    def busy_with(self) -> Path | None:
        """The snapshot buffer being persisted (not to be overwritten), if any."""
        return self._busy

    def submit(self, path: Path, header: Header) -> bool:
        """Persist the snapshot ``header`` names, held in the buffer file at ``path``;
        False (nothing done) while an earlier one is still being written."""
        if self._busy is not None:
            return False
        self._idle.clear()
        self._busy = path
        self._work.put((path, header))
        return True

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        self._work.put(None)

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            path, header = work
            try:
                self.done(self._persist(path, header))
            except Exception as exc:  # storage trouble must never stop training
                log.error("durable write of step %d shard %d failed: %r", header.step,
                          header.shard, exc)
            finally:
                self._busy = None
                self._idle.set()

    def _persist(self, path: Path, header: Header) -> Persisted:
        with path.open("rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            return self._persist_from(buffer, header)
        finally:
            # The views of the buffer died with _persist_from's frame, unless an error's
            # traceback holds them: then the mapping goes with the traceback, and closing
            # it now would replace that error by a BufferError.
            with contextlib.suppress(BufferError):
                buffer.close()

    def _persist_from(self, buffer: mmap.mmap, header: Header) -> Persisted:
        now = snapshot_file.read_header(buffer)
        if (now.step, now.generation, now.shard) != (header.step, header.generation,
                                                      header.shard):
            raise SnapshotFileError(f"the buffer holds step {now.step} now")
        meta, data = snapshot_file.verify(memoryview(buffer), now)
        return write_shard(self.fs, self.root, now, bytes(meta), data, self.keep)


# --- restoring ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DurablePolicy:
    """A job's durable tier as its ranks see it (from the agent's environment)."""

    url: str
    every: int
    keep: int
    resume_from: str | None  # an earlier job whose durable steps this one may start from

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DurablePolicy | None:
        """None when the job persists nothing and resumes from no other job."""
        url = env.get("PHALANX_CHECKPOINT_DURABLE_URL", "")
        every = int(env.get("PHALANX_CHECKPOINT_DURABLE_EVERY", "0"))
        resume_from = env.get("PHALANX_CHECKPOINT_RESUME_FROM") or None
        if not url or not (every or resume_from):
            return None
        return cls(url, every, int(env.get("PHALANX_CHECKPOINT_DURABLE_KEEP", "2")),
                   resume_from)

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
            keep: Callable[[int], bool] | None = None) -> tuple[int, int] | None:
    """Load the newest committed durable step newer than ``newer_than`` on every member of
    ``pg``: ``(step, state bytes)``, or None when there is none. A collective.

    Every member lists the storage and checks every file of a candidate step; the members
    agree (sums over ``pg``) on the candidates and on each one's health, so a step one
    member finds damaged is skipped by all (``report`` is called where it was found) and
    the next older one tried. ``keep``: as for :func:`load`.
    """
    fs, roots = policy.sources(job_id)
    candidates = sorted((c for root in roots for c in committed_steps(fs, root)
                         if c.step > newer_than), key=lambda c: (-c.step, -c.generation))
    agree = torch.tensor([len(candidates), candidates[0].step if candidates else -1],
                         dtype=torch.int64)
    wait(pg.allreduce([agree]))
    if agree.tolist() != [len(candidates) * world_size,
                          (candidates[0].step if candidates else -1) * world_size]:
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
        if int(healthy) != world_size or record is None:
            continue
        load(fs, candidate, record, model, optimizer, extra, keep)
        return candidate.step, record.total
    return None


# --- the catalog's view -------------------------------------------------------------------


def committed_records(record: CommitRecord, location: str, node_id: str,
                      now: float) -> list[SnapshotRecord]:
    """The catalog's announcements of a step ``node_id``'s rank committed at ``location``:
    one durable copy per shard, with its data file's size and checksum."""
    records = []
    for shard in range(record.shards):
        nbytes, checksum = record.files[f"__{shard}_0.distcp"]
        records.append(SnapshotRecord(
            job_id=record.job_id, step=record.step, shard=shard, num_shards=record.shards,
            node_id=node_id, tier=SnapshotTier.DURABLE, nbytes=nbytes, checksum=checksum,
            created_at=now, generation=record.generation, total_bytes=record.total,
            location=location))
    return records


def corrupt_records(step: Committed, problem: DurableCorrupt, location: str, node_id: str,
                    now: float) -> list[SnapshotRecord]:
    """The catalog's announcements of a damaged durable step (found by ``node_id``'s rank):
    the damaged shard's copy, or every shard's when the step as a whole is unreadable."""
    shards = range(step.shards) if problem.shard is None else [problem.shard]
    # A shard's checksum is in the commit record; with the record unreadable it is not
    # known, and the copy is listed by a checksum it can never have.
    checksum = problem.checksum if problem.shard is not None and problem.checksum \
        else "0" * 16
    return [SnapshotRecord(job_id=step.job_id, step=step.step, shard=shard,
                           num_shards=step.shards, node_id=node_id, tier=SnapshotTier.DURABLE,
                           nbytes=0, checksum=checksum, created_at=now,
                           generation=step.generation, corrupt=True,
                           detail=str(problem)[:DETAIL_CHARS], location=location)
            for shard in shards]


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
        data_file = _DATA_FILE.match(name)
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
         extra: Mapping[str, Any], keep: Callable[[int], bool] | None = None) -> None:
    """Load the verified durable ``step`` into ``model``, ``optimizer``, ``extra`` (and
    the RNG), read with ``torch.distributed.checkpoint``; ``keep``: a sharded optimizer's
    new partition (only the optimizer entries of the indices it accepts are read)."""
    meta = pickle.loads(record.meta)
    skipped = [index for index in meta["optimizer"]["state"]
               if keep is not None and not keep(index)]
    unread = {meta["model_tensors"] + ref
              for ref in tensor_refs([meta["optimizer"]["state"][index] for index in skipped])}
    tensors = [torch.empty(0) if i in unread else torch.empty(shape, dtype=_dtype(dtype))
               for i, (shape, dtype) in enumerate(meta["tensors"])]
    wanted = state_dict_of(meta, tensors)
    for index in skipped:
        del wanted["optimizer"]["state"][index]
    reader = dcp.FileSystemReader(step.directory) if isinstance(fs, LocalFileSystem) \
        else _fsspec_reader(fs, step.directory)
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
