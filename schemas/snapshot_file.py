"""The snapshot buffer file: one shard of a job's state at one step, never torn.

A buffer is a file on a tmpfs (shared memory) that the node agent creates and
sizes, and a rank writes. It holds a fixed :data:`HEADER_BYTES` header, then
a *meta* section (opaque bytes: the runtime pickles the step's non-tensor
state into it), then the shard's bytes. The header names the job, the step,
the generation, the shard and the shard count, the total state size, the
shard's offset and length, the meta length, an xxh3-64 checksum of meta and
shard bytes, the *column* (a replica group's rank ``s`` of ``S``: every column
of a job of replica groups is a state of its own, rank ``s``'s model shard,
snapshotted and restored apart; 0 of 1 with one rank per replica), and ends
with a CRC-32 of itself.

Writing (:func:`write`) marks the header *writing* first, then writes meta
and bytes, then the checksum, and the header marked *committed* last: that
header is the commit marker. A process killed at any point leaves a buffer
that is either the previous commit intact (it was not touched yet), or not
committed (the mark says writing, or the header's CRC fails when the kill hit
the header write itself). A shard keeps a ring of buffers and overwrites the
oldest (:func:`pick_buffer`), so its newest commit is never the one being
written. A reader trusts a buffer only after :func:`read_header` (CRC, magic,
committed mark) and :func:`verify` (checksum of the contents).

Torch-free on purpose: the agent reads headers (what it holds, for the
catalog and retention) and takes replicas without importing torch. The format is
shared by the runtime (which writes buffers) and the agent (which reads, replicates
and retains them), so it lives here, in the contract both sides import, and neither
side imports the other.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import xxhash

#: A buffer file named with this prefix is a replica of another node's buffer, kept by
#: this node's agent for its buddy (``buddy.<node>.<ring buffer name>``).
REPLICA_PREFIX = "buddy."
MAGIC = b"PHXSNAP3"  # 2: tensors start at multiples of ALIGN; 3: the column
HEADER_BYTES = 4096
#: Bytes the flat state's tensors and the shares' cuts are aligned to (the widest element).
ALIGN = 16
_WRITING, _COMMITTED = 1, 2
# magic, mark, job (64 bytes), step, generation, shard, shards, total, offset, length,
# meta length, checksum, column, columns; then the CRC-32 of all of that.
_LAYOUT = struct.Struct("<8sI64sqqiiqqqqQii")
_CRC = struct.Struct("<I")


class SnapshotFileError(ValueError):
    """A buffer file is not a committed, intact snapshot (the reason says which part)."""


@dataclasses.dataclass(frozen=True)
class Header:
    """What a buffer's header says about the shard it holds."""

    job_id: str
    step: int
    generation: int
    shard: int
    shards: int
    total: int  # bytes of the whole flat state
    offset: int  # where this shard starts in it
    length: int  # this shard's bytes
    meta_length: int
    checksum: int  # xxh3-64 of meta + shard bytes
    #: A replica group's rank whose state this is (its column), of ``columns`` (S).
    column: int = 0
    columns: int = 1

    def pack(self, mark: int) -> bytes:
        job = self.job_id.encode()
        if len(job) > 64:
            raise SnapshotFileError(f"job id {self.job_id!r} longer than 64 bytes")
        body = _LAYOUT.pack(MAGIC, mark, job, self.step, self.generation, self.shard,
                            self.shards, self.total, self.offset, self.length,
                            self.meta_length, self.checksum, self.column, self.columns)
        return body + _CRC.pack(zlib.crc32(body))

    @property
    def share_length(self) -> int:
        """Bytes of this shard's share of the flat state; a sharded optimizer's owned
        extent follows them, up to :attr:`length`."""
        return share(self.total, self.shard, self.shards)[1]

    @property
    def nbytes(self) -> int:
        """The buffer size this header's contents need."""
        return HEADER_BYTES + self.meta_length + self.length


def share(total: int, shard: int, shards: int) -> tuple[int, int]:
    """Shard ``shard`` of ``shards`` of a ``total``-byte state: ``(offset, length)``.

    Shard r covers ``[cut(r), cut(r + 1))`` with ``cut(r)`` = ``r * total // shards``
    rounded down to a multiple of :data:`ALIGN` (``cut(shards)`` = ``total``): the shares
    tile the state exactly, whatever the sizes, and since every tensor of the flat state
    starts at a multiple of :data:`ALIGN` (:func:`layout`), no share cuts an element in two
    (the durable tier writes each share's elements as tensor chunks).
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range for {shards} shards")

    def cut(r: int) -> int:
        return total if r == shards else r * total // shards // ALIGN * ALIGN

    start = cut(shard)
    return start, cut(shard + 1) - start


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of the tensors of ``sizes`` bytes starts in the flat state (each at a
    multiple of :data:`ALIGN`, the widest element), and the state's total bytes."""
    offsets, at = [], 0
    for size in sizes:
        at = -(-at // ALIGN) * ALIGN
        offsets.append(at)
        at += size
    return offsets, at


def read_header(buffer: bytes | bytearray | memoryview | mmap.mmap) -> Header:
    """The committed header at the start of ``buffer``.

    Raises:
        SnapshotFileError: too short, not a snapshot, the header damaged (CRC), or not
            committed (a write in progress or cut short).
    """
    if len(buffer) < _LAYOUT.size + _CRC.size:
        raise SnapshotFileError(f"{len(buffer)} bytes: shorter than a header")
    body = bytes(buffer[:_LAYOUT.size])
    (crc,) = _CRC.unpack(bytes(buffer[_LAYOUT.size:_LAYOUT.size + _CRC.size]))
    fields = _LAYOUT.unpack(body)
    if fields[0] != MAGIC:
        raise SnapshotFileError("no snapshot header (never written)")
    if zlib.crc32(body) != crc:
        raise SnapshotFileError("header damaged (CRC mismatch)")
    if fields[1] != _COMMITTED:
        raise SnapshotFileError("not committed (a write was in progress)")
    return Header(fields[2].rstrip(b"\0").decode(), *fields[3:])


def checksum(meta: memoryview | bytes, data: memoryview | bytes) -> int:
    digest = xxhash.xxh3_64()
    digest.update(meta)
    digest.update(data)
    return digest.intdigest()


def verify(buffer: memoryview, header: Header) -> tuple[memoryview, memoryview]:
    """The meta and shard bytes of a committed ``buffer``, checked against the header.

    Raises:
        SnapshotFileError: the buffer is shorter than its header says, or its contents
            do not match the checksum (bytes flipped since the commit).
    """
    if len(buffer) < header.nbytes:
        raise SnapshotFileError(f"{len(buffer)} bytes, the header says {header.nbytes}")
    meta = buffer[HEADER_BYTES:HEADER_BYTES + header.meta_length]
    data = buffer[HEADER_BYTES + header.meta_length:header.nbytes]
    if checksum(meta, data) != header.checksum:
        raise SnapshotFileError(f"checksum mismatch: shard {header.shard} of step "
                                f"{header.step} is damaged")
    return meta, data


def write(buffer: memoryview, header: Header, meta: bytes,
          fill: Callable[[memoryview], None]) -> Header:
    """Write a snapshot into ``buffer``: header marked writing, meta, ``fill(data)`` (the
    caller copies the shard's bytes into the view it is given), checksum, committed header
    last. Returns the header as committed (with its checksum).

    Raises:
        SnapshotFileError: ``buffer`` is too small for the header's contents.
    """
    header = dataclasses.replace(header, meta_length=len(meta), checksum=0)
    begin(buffer, header)
    meta_view = buffer[HEADER_BYTES:HEADER_BYTES + len(meta)]
    meta_view[:] = meta
    data = buffer[HEADER_BYTES + len(meta):header.nbytes]
    fill(data)
    header = dataclasses.replace(header, checksum=checksum(meta_view, data))
    commit(buffer, header)
    return header


def begin(buffer: memoryview | mmap.mmap, header: Header) -> None:
    """Mark ``buffer`` as being written with ``header``'s contents: the previous commit in
    it is void from here (:func:`write`, and a replica arriving, do this first).

    Raises:
        SnapshotFileError: ``buffer`` is too small for the header's contents.
    """
    if len(buffer) < header.nbytes:
        raise SnapshotFileError(f"buffer of {len(buffer)} bytes, the snapshot needs "
                                f"{header.nbytes}")
    writing = header.pack(_WRITING)
    buffer[:len(writing)] = writing


def commit(buffer: memoryview | mmap.mmap, header: Header) -> None:
    """Write ``header`` marked committed: the commit marker, written last, once the
    contents match its checksum."""
    committed = header.pack(_COMMITTED)
    buffer[:len(committed)] = committed


def open_buffer(path: Path) -> mmap.mmap:
    """Map the buffer file at ``path`` (created and sized by the agent) for writing."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def committed_header(path: Path) -> Header | None:
    """The committed header of the buffer file at ``path`` (None: unreadable or not a
    committed snapshot). Reads the header only."""
    try:
        with path.open("rb") as f:
            return read_header(f.read(HEADER_BYTES))
    except (OSError, SnapshotFileError):
        return None


def is_replica(path: Path) -> bool:
    """Is the buffer file at ``path`` a replica of another node's (not a rank's own)?"""
    return path.name.startswith(REPLICA_PREFIX)


def pick_buffer(headers: list[Header | None]) -> int:
    """Which of a shard's ring of buffers to overwrite: one never committed, else the one
    holding the oldest step (never the newest commit)."""
    steps = []
    for i, header in enumerate(headers):
        if header is None:
            return i
        steps.append(header.step)
    return min(range(len(steps)), key=steps.__getitem__)
