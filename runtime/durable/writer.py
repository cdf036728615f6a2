"""Writing a step to the durable tier: each rank's shard on a background thread, and the
commit by the writer that sees every shard done (:class:`DurableWriter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import mmap
import pickle
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import torch
import xxhash
from fsspec.implementations.local import LocalFileSystem

from phalanx.runtime.durable.layout import (
    COMMIT,
    METADATA,
    CommitRecord,
    Plan,
    consolidated_meta,
    dtype_of,
    element_size,
    file_index,
    global_meta,
    owned_plan,
    put_at_once,
    retain,
    shard_boxes,
    step_dir,
    url_of,
)
from phalanx.schemas import snapshot_file
from phalanx.schemas.snapshot_file import Header, SnapshotFileError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

log = logging.getLogger("phalanx.runtime.durable")


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
    commit the step if every shard's marker is there, then apply retention.

    A replica group's rank (``header.column`` of ``header.columns``) writes data file
    :func:`~.layout.file_index`: the step has a file per shard of every column, and is
    committed once all of them are written.
    """
    # DCP is imported when a shard is first written, not with the runtime (layout._flatten).
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    started = time.perf_counter()
    meta = pickle.loads(meta_bytes)
    plan = Plan.of(meta)
    directory = step_dir(root, header.job_id, header.step, header.generation, header.shards,
                         header.columns)
    fs.makedirs(directory, exist_ok=True)
    index = file_index(header.shard, header.shards, header.column)
    name = f"__{index}_0.distcp"
    storage: dict[MetadataIndex, _StorageInfo] = {}
    chunks: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
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

        if index == 0:
            for fqn, value in plan.objects.items():
                saved(MetadataIndex(fqn), value)
        for i, (offsets, sizes, first) in shard_boxes(meta, header.shard, header.shards,
                                                      header.column):
            dtype = meta["tensors"][i][1]
            size = element_size(dtype)
            lo = meta["offsets"][i] + first * size - header.offset
            chunk = torch.frombuffer(data[lo:lo + math.prod(sizes) * size],
                                     dtype=dtype_of(dtype)).reshape(sizes)
            saved(MetadataIndex(plan.names[i], torch.Size(offsets)), chunk)
            chunks.append((i, offsets, sizes))
        extent = meta.get("owned")
        if extent is not None:  # a sharded optimizer's entries this shard's owner holds
            names, objects = owned_plan(extent)
            for fqn, value in objects.items():
                saved(MetadataIndex(fqn), value)
            for j, ((shape, dtype), start) in enumerate(zip(extent["tensors"],
                                                            extent["offsets"], strict=True)):
                lo, numel = header.share_length + start, math.prod(shape)
                whole = torch.frombuffer(data[lo:lo + numel * element_size(dtype)],
                                         dtype=dtype_of(dtype)).reshape(shape) if numel \
                    else torch.empty(shape, dtype=dtype_of(dtype))
                saved(MetadataIndex(names[j], torch.Size((0,) * len(shape))), whole)
    checksum = f"{digest.intdigest():016x}"
    put_at_once(fs, f"{directory}/shard-{index}.done", pickle.dumps(
        {"file": name, "bytes": at, "xxh3": checksum, "storage": storage,
         "owned": meta.get("owned"), "chunks": chunks, "rng": meta["rng"]}))
    record = _commit(fs, directory, header, meta, meta_bytes, plan)
    if record is not None:
        for gone in retain(fs, f"{root.rstrip('/')}/{header.job_id}", keep):
            log.info("durable step deleted (retention): %s", gone)
    return Persisted(header.step, header.shard, at, checksum, record, directory,
                     url_of(fs, directory), time.perf_counter() - started)


def _commit(fs: fsspec.AbstractFileSystem, directory: str, header: Header,
            meta: dict[str, Any], meta_bytes: bytes, plan: Plan) -> CommitRecord | None:
    """Write ``.metadata`` and the commit record if every shard's marker (of every column)
    is there."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    markers = []
    for index in range(header.shards * header.columns):
        try:
            markers.append(pickle.loads(fs.cat_file(f"{directory}/shard-{index}.done")))
        except FileNotFoundError:
            return None  # a shard still being written: its writer commits
    storage = {index: info for marker in markers for index, info in marker["storage"].items()}
    chunks: dict[int, list[ChunkStorageMetadata]] = {}
    for marker in markers:
        for i, offsets, sizes in marker["chunks"]:
            chunks.setdefault(i, []).append(ChunkStorageMetadata(torch.Size(offsets),
                                                                 torch.Size(sizes)))
    if "global" in meta:  # a replica group's step: global shapes, and each column's RNG
        meta = {**global_meta(meta), "rngs": [markers[file_index(0, header.shards, column)]
                                              ["rng"] for column in range(header.columns)]}
        meta_bytes = pickle.dumps(meta)
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
            TensorProperties(dtype=dtype_of(dtype)), torch.Size(shape), chunks.get(i, []))
    metadata = pickle.dumps(Metadata(state_dict_metadata=described, planner_data=plan.mappings,
                                     storage_data=storage, version=CURRENT_DCP_VERSION))
    put_at_once(fs, f"{directory}/{METADATA}", metadata)
    files = {m["file"]: (m["bytes"], m["xxh3"]) for m in markers}
    files[METADATA] = (len(metadata), f"{xxhash.xxh3_64_intdigest(metadata):016x}")
    record = CommitRecord(header.job_id, header.step, header.generation, header.shards,
                          header.total, files, meta_bytes, header.columns)
    put_at_once(fs, f"{directory}/{COMMIT}", record.encode())  # the step exists from here
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
