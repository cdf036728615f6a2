"""What a node's snapshot store holds, read as a restore would read it: the committed
buffers of a job, and the newest step complete among them."""

from __future__ import annotations

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
