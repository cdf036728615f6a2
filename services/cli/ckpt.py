"""``phalanx ckpt``: a job's checkpoints. ``ls`` lists its steps from the checkpoint
catalog (tiers, locations, sizes, checksums; an ended job's durable steps included);
``export`` writes a committed durable step, checked, as a plain DCP checkpoint (with the
runtime's reader of the durable tier, which only the command line may import).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from phalanx.services.cli.common import (
    EXIT_FAILED,
    Parents,
    Subparsers,
    bus_config,
    msgspec_to_builtins,
    with_client,
)


def cmd_ckpt(args: argparse.Namespace) -> int:
    """``phalanx ckpt ls JOB``: the job's snapshots from the checkpoint catalog (an ended
    job's durable steps included)."""
    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import CheckpointCatalog
    from phalanx.services.checkpoint.core import complete

    async def read() -> CheckpointCatalog | None:
        async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
            kv = await TypedKV.open(bus.js, subjects.CHECKPOINTS_BUCKET, CheckpointCatalog)
            entry = await kv.get(args.job)
            return None if entry is None else entry.value

    catalog = asyncio.run(read())
    if catalog is None:
        print(f"phalanx ckpt: no snapshot of {args.job!r} is known", file=sys.stderr)
        return EXIT_FAILED
    rows = [{"step": s.step, "shards": s.shards, "columns": s.columns,
             "total_bytes": s.total_bytes, "complete": complete(s),
             "copies": msgspec_to_builtins(s.copies)}
            for s in reversed(catalog.steps)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        columns = f" of each of {row['columns']} group ranks" if row["columns"] > 1 else ""
        print(f"step {row['step']}: {row['shards']} shards{columns}, "
              f"{size_text(row['total_bytes'])}{'' if row['complete'] else ' (incomplete)'}")
        for copy in row["copies"]:
            flag = "  CORRUPT" if copy["corrupt"] else ""
            where = f"at {copy['location']}" if copy["location"] else f"on {copy['node_id']}"
            column = f" of group rank {copy['column']}" if row["columns"] > 1 else ""
            print(f"  shard {copy['shard']}{column}: {copy['tier']} {where}, "
                  f"{size_text(copy['nbytes'])}, xxh3 {copy['checksum']}{flag}")
    return 0


def size_text(nbytes: int) -> str:
    """``nbytes`` as people read a size: "812 B", "7.9 MiB", "1.2 GiB" (``--json`` keeps
    the exact count)."""
    size, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"


def cmd_ckpt_export(args: argparse.Namespace) -> int:
    """``phalanx ckpt export JOB STEP DIR``: a durable step, checked, as a plain DCP dir."""
    import fsspec

    from phalanx.runtime import durable

    source = args.source
    if source is None:
        record = asyncio.run(with_client(args, lambda c: c.job(args.job)))
        source = (record.spec.checkpoint.durable_url if record is not None else "") \
            or str(Path(args.data_dir) / "checkpoints")
    fs, root = fsspec.core.url_to_fs(source)
    found = [c for c in durable.committed_steps(fs, f"{root.rstrip('/')}/{args.job}")
             if c.step == args.step]
    if not found:
        print(f"phalanx ckpt: no committed durable step {args.step} of {args.job!r} under "
              f"{source}", file=sys.stderr)
        return EXIT_FAILED
    try:
        files = durable.export(fs, found[0], Path(args.dir))
    except durable.DurableCorrupt as exc:
        print(f"phalanx ckpt: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"exported step {args.step} of {args.job} to {args.dir} ({len(files)} files, "
          "checked): load it with torch.distributed.checkpoint.load")
    return 0


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    ckpt = sub.add_parser("ckpt", help="a job's checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    ckpt_ls = ckpt_sub.add_parser("ls", parents=[parents.common],
                                  help="steps, tiers, locations, sizes and checksums")
    ckpt_ls.add_argument("job")
    ckpt_ls.add_argument("--json", action="store_true")
    ckpt.set_defaults(func=cmd_ckpt)
    ckpt_export = ckpt_sub.add_parser("export", parents=[parents.common],
                                      help="write a durable step as a plain DCP checkpoint")
    ckpt_export.add_argument("job")
    ckpt_export.add_argument("step", type=int)
    ckpt_export.add_argument("dir")
    ckpt_export.add_argument("--from", dest="source", metavar="URL",
                             help="the durable root the job wrote to (default: the job "
                                  "spec's checkpoint.durable_url, else <data-dir>/checkpoints)")
    ckpt_export.set_defaults(func=cmd_ckpt_export)
