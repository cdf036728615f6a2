"""The durable tier's layout on storage: a step's directory, its DCP files, its commit
record, and which steps are committed (and retention of the others).

See :mod:`phalanx.runtime.durable` for the format as a whole.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import uuid
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from phalanx.runtime.state import _fill, _TensorRef
from phalanx.schemas import snapshot_file
from phalanx.schemas.snapshot_file import SnapshotFileError

COMMIT = ".phalanx-commit"
METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(?P<step>\d{10})-g(?P<generation>\d+)-w(?P<shards>\d+)"
                       r"(?:-c(?P<columns>\d+))?$")
DATA_FILE = re.compile(r"^__(?P<shard>\d+)_0\.distcp$")


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


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a meta's dtype name (``torch.float32`` or ``float32``) names."""
    dtype = getattr(torch, name.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


def element_size(name: str) -> int:
    """Bytes per element of the dtype ``name``."""
    return torch.empty((), dtype=dtype_of(name)).element_size()


def state_dict_of(meta: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The nested state dict a durable step holds, its tensors ``tensors`` (in
    :func:`~phalanx.runtime.flat_state.flat_state`'s order)."""
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


def _flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flattening of a nested state dict: its flat entries and their mappings.

    DCP (and FSDP, which it imports) is imported here, when the durable tier is first
    used: importing it costs every rank's start about 0.3 s of CPU.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    return flat, mappings


def owned_plan(extent: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The DCP keys of an owner's entries (``meta["owned"]``): each tensor's, and the
    non-tensor leaves with their values."""
    placeholders = [torch.empty(0) for _ in extent["tensors"]]
    flat, _ = _flatten({"optimizer": {"state": _fill(extent["state"],
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
        flat, mappings = _flatten(state_dict_of(meta, placeholders))
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


def shard_boxes(meta: dict[str, Any], shard: int, shards: int,
                column: int = 0) -> list[tuple[int, Box]]:
    """The chunks shard ``shard`` of ``shards`` writes: (tensor index, box), the box's
    offsets in the global tensor, its first element in the local one.

    A replica group's rank (``meta["global"]``, :mod:`.flat_state`) holds its column's
    local part of each DTensor: its boxes are moved to where that part lies in the global
    tensor. A tensor every rank of a group holds whole (not a DTensor: an optimizer's step
    count, a buffer) is written by column 0 alone.
    """
    offset, length = snapshot_file.share(meta["total"], shard, shards)
    placed: list[Any] | None = meta.get("global")
    found: list[tuple[int, Box]] = []
    for i, ((shape, dtype), at) in enumerate(zip(meta["tensors"], meta["offsets"],
                                                 strict=True)):
        where = None if placed is None else placed[i]
        if placed is not None and where is None and column != 0:
            continue
        size = element_size(dtype)
        nbytes = math.prod(shape) * size
        lo, hi = max(offset, at), min(offset + length, at + nbytes)
        if lo < hi:
            for offsets, sizes, first in boxes(tuple(shape), (lo - at) // size,
                                               (hi - at) // size):
                if where is not None:
                    offsets = tuple(o + g for o, g in zip(offsets, where[1], strict=True))
                found.append((i, (offsets, sizes, first)))
    return found


def global_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with each tensor's global shape (a replica group rank's meta names its local
    parts' shapes); ``meta`` itself for a rank that holds its tensors whole."""
    placed: list[Any] | None = meta.get("global")
    if placed is None:
        return meta
    tensors = [(tuple(where[0]), dtype) if where is not None else (tuple(shape), dtype)
               for (shape, dtype), where in zip(meta["tensors"], placed, strict=True)]
    return {**meta, "tensors": tensors}


def file_index(shard: int, shards: int, column: int) -> int:
    """The data file of shard ``shard`` of ``shards`` of column ``column``: the columns'
    shards one after another (one column, a plain job's: the shard itself)."""
    return column * shards + shard


# --- storage --------------------------------------------------------------------------------


def step_dir(root: str, job_id: str, step: int, generation: int, shards: int,
             columns: int = 1) -> str:
    """A step attempt's directory; ``columns``: a job of replica groups' S (its ``shards``
    are each column's, R), named when more than 1."""
    suffix = f"-c{columns}" if columns > 1 else ""
    return f"{root.rstrip('/')}/{job_id}/step-{step:010d}-g{generation}-w{shards}{suffix}"


def put_at_once(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write ``path`` at once: a rename on a file system, one PUT on an object store."""
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, data)


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """What makes a durable step exist: its files' sizes and checksums, and the meta.

    A job of replica groups wrote ``shards`` (R) data files per column, ``columns`` (S)
    columns: every one of the S·R files is in ``files``, and ``meta`` holds the tensors'
    global shapes and each column's RNG state (``rngs``).
    """

    job_id: str
    step: int
    generation: int
    shards: int
    total: int
    files: dict[str, tuple[int, str]]  # name -> (bytes, xxh3-64 hex)
    meta: bytes
    columns: int = 1

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
    columns: int = 1

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
                                   int(match["generation"]), int(match["shards"]),
                                   int(match["columns"] or 1)))
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
