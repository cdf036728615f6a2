"""``phalanx logs``: a job's replica logs, read from the work dirs of this machine's agents
(logs stay on the node that ran the replica). ``--rank`` names the replica that holds the
rank in the job's current generation; ``-f`` follows, ``tail -F`` per file, until the
job's record says it ended, picking up replicas the job starts meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

from phalanx.services.cli.common import EXIT_FAILED, Parents, Subparsers, bus_config, with_client


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (or follow) a job's replica logs from this machine's agents' work dirs."""
    data_dir = Path(args.data_dir)
    replica = args.replica
    if args.rank is not None:
        members, where = asyncio.run(with_client(args, lambda c: _members(c, args.job)))
        replica = _replica_at_rank(data_dir, args.job, args.rank, members, where)
        if replica is None:
            return EXIT_FAILED
    if args.follow:
        return asyncio.run(_follow(args, data_dir, replica))
    paths = _replica_logs(data_dir, args.job, replica)
    if not paths:
        what = f"replica {replica}" if replica else "any replica"
        print(f"phalanx logs: no log of {what} of {args.job!r} under {data_dir} (logs stay "
              "on the node that ran the replica)", file=sys.stderr)
        return EXIT_FAILED
    for path in paths:
        if len(paths) > 1:
            sys.stdout.write(f"==> {path.stem} on {path.parents[2].name} <==\n")
        sys.stdout.flush()
        sys.stdout.buffer.write(path.read_bytes())
    sys.stdout.flush()
    return 0


def _replica_logs(data_dir: Path, job_id: str, replica: str | None) -> list[Path]:
    """The log files of ``replica`` (every replica: None) of the job under ``data_dir``."""
    return sorted(data_dir.glob(f"agents/*/jobs/{job_id}/{replica or '*'}.log"),
                  key=_replica_order)


def _replica_order(path: Path) -> tuple[int, int]:
    """``r<slot>-<incarnation>.log`` in slot, then incarnation order."""
    slot, _, incarnation = path.stem.removeprefix("r").partition("-")
    return (int(slot), int(incarnation)) if slot.isdigit() and incarnation.isdigit() \
        else (1 << 62, 0)


async def _members(client, job_id: str) -> tuple[list[str] | None, str]:
    """The replicas of the job's current generation by rank (its last one, once it ended),
    and which generation that is; None for a job not under the runtime."""
    generation = await client.generation(job_id)
    if generation is not None:
        return [m.replica_id for m in generation.members], f"generation {generation.generation}"
    history = await client.history(job_id)
    if history is not None and history.generations:
        last = history.generations[-1]
        return list(last.members), f"its last generation, {last.generation}"
    return None, ""


def _replica_at_rank(data_dir: Path, job_id: str, rank: int, members: list[str] | None,
                     where: str) -> str | None:
    """The replica that is ``rank`` in ``members``; in a job not under the runtime, the
    latest replica in slot ``rank``. None (said why) when there is none."""
    if members is not None:
        if rank < len(members):
            return members[rank]
        print(f"phalanx logs: {job_id!r} has no rank {rank}: its world size is "
              f"{len(members)} ({where})", file=sys.stderr)
        return None
    in_slot = sorted(data_dir.glob(f"agents/*/jobs/{job_id}/r{rank}-*.log"), key=_replica_order)
    if not in_slot:
        print(f"phalanx logs: no log of rank {rank} of {job_id!r} under {data_dir}",
              file=sys.stderr)
        return None
    return in_slot[-1].stem


class _Tail:
    """``tail -F`` of one replica's log, each line prefixed with the replica when several
    are followed; :meth:`finish` prints what the file holds beyond what tail passed on."""

    def __init__(self, path: Path, label: str) -> None:
        self.path, self.label, self.offset = path, label.encode(), 0

    async def start(self) -> _Tail:
        self.process = await asyncio.create_subprocess_exec(
            "tail", "-n", "+1", "-F", str(self.path), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL)
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.offset += len(line)
            self._write(line)

    def _write(self, data: bytes) -> None:
        sys.stdout.buffer.write(self.label + data)
        sys.stdout.buffer.flush()

    async def finish(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        await self.reader
        await self.process.wait()
        with contextlib.suppress(OSError), self.path.open("rb") as f:
            f.seek(self.offset)
            rest = f.read()
            for line in rest.splitlines(keepends=True):
                self._write(line)


async def _follow(args: argparse.Namespace, data_dir: Path, replica: str | None) -> int:
    """Follow ``replica``'s log (None: every replica's, also those the job starts from now
    on) until the job's record says it ended."""
    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import JobRecord, RankStarted
    from phalanx.services.agent.ranks import replica_log

    job_id, everyone = args.job, replica is None
    tails: dict[Path, _Tail] = {}

    async def follow(path: Path) -> None:
        if path not in tails:
            tails[path] = await _Tail(path, f"{path.stem} | " if everyone else "").start()

    async def started(message: RankStarted, _) -> None:
        if message.replica_id is not None:
            await follow(replica_log(data_dir / "agents" / message.node_id, job_id,
                                     message.replica_id))

    async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
        jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        if await jobs.get(job_id) is None:
            print(f"phalanx logs: no job {job_id!r}", file=sys.stderr)
            return EXIT_FAILED
        if everyone:  # before the files are listed: no replica started meanwhile is missed
            await bus.subscribe(subjects.rank_started(job_id), RankStarted, started)
        for path in await asyncio.to_thread(_replica_logs, data_dir, job_id, replica):
            await follow(path)
        ended: JobRecord | None = None
        async for change in jobs.watch():  # the record's changes, not a poll
            if change is not None and change.key == job_id and (
                    change.value is None or change.value.state.terminal):
                ended = change.value
                break
        # A replica's log found meanwhile adds a tail while another one finishes.
        for tail in list(tails.values()):
            await tail.finish()
    what = "deleted" if ended is None else f"{ended.state.value}: {ended.reason}"
    print(f"=== phalanx: {job_id} {what}", file=sys.stderr)
    return 0


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    logs = sub.add_parser("logs", parents=[parents.common],
                          help="a job's replica logs (on this machine's agents)")
    logs.add_argument("job")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R",
                       help="the replica that is rank R now (in the current generation)")
    which.add_argument("--replica", metavar="ID", help="one replica, e.g. r1-0")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="follow until the job ends (all replicas: new ones too)")
    logs.set_defaults(func=cmd_logs)
