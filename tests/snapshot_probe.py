"""What a node's snapshot store holds, read as a restore would read it: the committed
buffers of a job, and the newest step complete among them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from phalanx.schemas import snapshot_file


def committed(store: Path, prefix: str = "") -> dict[tuple[int, int, int], tuple[int, int]]:
    """The committed buffers in a node's store directory for a job whose name starts with
    ``prefix``: (step, shards, shard) -> (checksum, generation)."""
    found = {}
    for path in store.glob(f"{prefix}*") if store.is_dir() else []:
        header = snapshot_file.committed_header(path)
        if header is not None:
            found[(header.step, header.shards, header.shard)] = (header.checksum,
                                                                 header.generation)
    return found


def newest_complete(held: set[tuple[int, int, int]]) -> int | None:
    """The newest step all of whose shards (of one shard count) are in ``held``."""
    steps = {(step, shards) for step, shards, _ in held}
    complete = [step for step, shards in steps
                if {(step, shards, s) for s in range(shards)} <= held]
    return max(complete, default=None)


async def until_replicated(store: Path, replicated: set[tuple[int, int, int, str]],
                           arrived: asyncio.Event) -> dict[tuple[int, int, int], tuple[int, int]]:
    """Wait until a buddy announced a replica of every buffer ``store`` (a job's directory
    in the lost node's store, its ranks frozen) has committed; those buffers.

    ``replicated`` holds (step, shards, shard, checksum) of each announced replica and
    ``arrived`` is set at each announcement: the store is read again then, so none is
    missed that was still being committed as its rank stopped.
    """
    while True:
        arrived.clear()
        own = committed(store, "w")
        if {(*key, f"{checksum:016x}") for key, (checksum, _) in own.items()} <= replicated:
            return own
        await asyncio.wait_for(arrived.wait(), 60)
