"""``phalanx logs``: a job's replica logs, read over the bus from the agents that ran them.

A replica's output stays in a file on its node; each agent answers ``LogRequest`` on
``phalanx.agent.<node>.logs`` with which of the job's logs it holds, or a piece of one
(:mod:`phalanx.services.agent.logs`), so the command works from any machine that reaches
the bus, as ``kubectl logs`` does through the kubelet. ``--rank`` names the replica that
holds the rank in the job's current generation; ``-f`` follows until the job's record
says it ended, picking up replicas the job starts meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.services.cli.common import (
    EXIT_FAILED,
    Parents,
    Subparsers,
    bus_config,
    whole_number,
)

if TYPE_CHECKING:
    from phalanx.bus.client import Bus, Delivery
    from phalanx.schemas.messages import LogReply
    from phalanx.services.client import AdmissionClient

#: How often ``-f`` asks the agents for what their followed logs gained: the files are on
#: other machines, with nothing to subscribe to.
FOLLOW_POLL_S = 0.5
#: How long a node's agent has to answer (one that does not is named, its logs missing).
ANSWER_S = 5.0


@dataclasses.dataclass
class ReplicaLog:
    """One replica's log on its node, and how much of it has been printed."""

    node_id: str
    replica_id: str
    size: int = 0  # when it was listed
    offset: int = 0
    partial: bytes = b""  # a line begun and not ended, held back while labelling lines


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (or follow) a job's replica logs, read from the agents of the nodes."""
    return asyncio.run(_logs(args))


async def _logs(args: argparse.Namespace) -> int:
    from phalanx.bus.client import Bus
    from phalanx.services.client import AdmissionClient

    async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
        client = AdmissionClient(bus)
        record = await client.job(args.job)
        if record is None:
            print(f"phalanx logs: no job {args.job!r}", file=sys.stderr)
            return EXIT_FAILED
        replica = args.replica
        if args.rank is not None:
            members, where = await _members(client, args.job)
            if members is not None:
                if args.rank >= len(members):
                    print(f"phalanx logs: {args.job!r} has no rank {args.rank}: its world "
                          f"size is {len(members)} ({where})", file=sys.stderr)
                    return EXIT_FAILED
                replica = members[args.rank]
        if args.follow:
            return await _follow(bus, args.job, replica, args.rank, args.tail,
                                 record.spec.ranks_per_replica)
        logs = _chosen(await _listing(bus, args.job), replica, args.rank)
        if not logs:
            what = f"replica {replica}" if replica else (
                f"rank {args.rank}" if args.rank is not None else "any replica")
            print(f"phalanx logs: no agent holds a log of {what} of {args.job!r}",
                  file=sys.stderr)
            return EXIT_FAILED
        for log in logs:
            if len(logs) > 1:
                _write(f"==> {log.replica_id} on {log.node_id} <==\n".encode())
            if args.tail is not None:
                await _skip_to_tail(bus, args.job, log, args.tail)
            await _read_new(bus, args.job, log, _write)
    return 0


def _chosen(logs: list[ReplicaLog], replica: str | None, rank: int | None) -> list[ReplicaLog]:
    """``replica``'s log (a group's: each of its processes'); with only ``rank`` (a job
    not under the runtime), the latest replica's in that slot; else every log."""
    from phalanx.schemas.replicas import log_replica

    if replica is None and rank is not None:
        in_slot = [log for log in logs if log.replica_id.startswith(f"r{rank}-")]
        if not in_slot:
            return []
        replica = log_replica(in_slot[-1].replica_id)[0]
    if replica is not None:
        return [log for log in logs if log_replica(log.replica_id)[0] == replica]
    return logs


async def _listing(bus: Bus, job_id: str) -> list[ReplicaLog]:
    """Every node's logs of the job, asked at once, in slot then incarnation order; a node
    whose agent does not answer is named on stderr."""
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.errors import PhalanxError
    from phalanx.schemas.messages import LogReply, LogRequest, NodeRecord
    from phalanx.schemas.replicas import replica_order

    nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
    entries, _ = await nodes.entries()  # an entry that does not decode is still a node
    node_ids = sorted(entry.key for entry in entries)

    async def ask(node_id: str) -> LogReply | None:
        try:
            return await bus.request(subjects.agent_logs(node_id), LogRequest(job_id=job_id),
                                     LogReply, timeout_s=ANSWER_S)
        except PhalanxError:
            return None

    replies = await asyncio.gather(*(ask(n) for n in node_ids))
    silent = [n for n, reply in zip(node_ids, replies, strict=True) if reply is None]
    if silent:
        shown = ", ".join(silent[:5]) + (f" and {len(silent) - 5} more" if len(silent) > 5
                                         else "")
        print(f"phalanx logs: no agent answered on {len(silent)} node(s) ({shown}): logs "
              "there, if any, are not shown", file=sys.stderr)
    logs = [ReplicaLog(reply.node_id, log.replica_id, log.size) for reply in replies
            if reply is not None for log in reply.logs]
    for reply in replies:
        if reply is not None and reply.unlisted:
            print(f"phalanx logs: {reply.node_id} holds {reply.unlisted} more log(s) of "
                  f"{job_id}, of older incarnations, than one answer lists: not shown",
                  file=sys.stderr)
    return sorted(logs, key=lambda log: replica_order(log.replica_id))


async def _piece(bus: Bus, job_id: str, log: ReplicaLog, offset: int,
                 max_bytes: int | None = None) -> LogReply:
    """``LogReply``: up to ``max_bytes`` (default: one reply's most) of ``log`` from
    ``offset``, from its node's agent."""
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import LOG_CHUNK_BYTES, LogReply, LogRequest

    return await bus.request(
        subjects.agent_logs(log.node_id),
        LogRequest(job_id=job_id, replica_id=log.replica_id, offset=offset,
                   max_bytes=max_bytes or LOG_CHUNK_BYTES),
        LogReply, timeout_s=ANSWER_S)


async def _read_new(bus: Bus, job_id: str, log: ReplicaLog, write: Callable[[bytes], None]) -> None:
    """Pass on what ``log`` holds beyond what was read of it, piece by piece."""
    while True:
        reply = await _piece(bus, job_id, log, log.offset)
        if not reply.data:
            return
        write(reply.data)
        log.offset = reply.offset + len(reply.data)
        if log.offset >= reply.size:
            return


def tail_start(data: bytes, lines: int) -> int | None:
    """Where the last ``lines`` lines of ``data``, the end of a log, begin (its last line
    may lack its newline); None unless ``data`` holds more (its first line may have begun
    before it: the reader reads further back, or from the log's start)."""
    if lines == 0:
        return len(data)
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        end = data.rfind(b"\n", 0, end)
        if end < 0:
            return None
    return end + 1


async def _skip_to_tail(bus: Bus, job_id: str, log: ReplicaLog, lines: int) -> None:
    """Move ``log``'s offset to where its last ``lines`` lines (as listed) begin, reading
    it backwards a piece at a time."""
    from phalanx.schemas.messages import LOG_CHUNK_BYTES

    seen, start = b"", log.size
    while start > 0:
        end, start = start, max(0, start - LOG_CHUNK_BYTES)
        seen = (await _piece(bus, job_id, log, start, end - start)).data + seen
        found = tail_start(seen, lines)
        if found is not None:
            log.offset = start + found
            return
    log.offset = 0


def _write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


async def _members(client: AdmissionClient, job_id: str) -> tuple[list[str] | None, str]:
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


async def _follow(bus: Bus, job_id: str, replica: str | None, rank: int | None,
                  tail: int | None, ranks_per_replica: int = 1) -> int:
    """Follow ``replica``'s log (None: every replica's, also those the job starts from now
    on, each process's of a replica of ``ranks_per_replica`` ranks; ``tail``: from the
    last lines of those listed) until the job's record says it ended; then pass on what
    was written last."""
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.errors import PhalanxError
    from phalanx.schemas.messages import JobRecord, RankStarted
    from phalanx.schemas.replicas import member_log
    from phalanx.services.deadline import wait_set

    everyone = replica is None and rank is None
    followed: dict[str, ReplicaLog] = {}

    def follow(log: ReplicaLog) -> None:
        followed.setdefault(log.replica_id, log)

    async def started(message: RankStarted, _: Delivery) -> None:
        if message.replica_id is not None:
            for group_rank in range(ranks_per_replica) if ranks_per_replica > 1 else [None]:
                follow(ReplicaLog(message.node_id, member_log(message.replica_id, group_rank)))

    if everyone:  # before the logs are listed: no replica started meanwhile is missed
        await bus.subscribe(subjects.rank_started(job_id), RankStarted, started)
    for log in _chosen(await _listing(bus, job_id), replica, rank):
        if tail is not None:
            await _skip_to_tail(bus, job_id, log, tail)
        follow(log)
    jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
    ended = asyncio.Event()
    last: list[JobRecord | None] = []  # the record that ended it (None: deleted)

    async def watch() -> None:
        async for change in jobs.watch():  # the record's changes, not a poll
            if change is not None and change.key == job_id and (
                    change.value is None or change.value.state.terminal):
                last.append(change.value)
                ended.set()
                return

    watcher = asyncio.create_task(watch())
    try:
        while True:
            done = ended.is_set()  # read once more after the end: what was written last
            for log in list(followed.values()):
                with contextlib.suppress(PhalanxError):  # its node is gone: nothing more
                    await _read_new(bus, job_id, log, _lines_of(log, everyone))
            if done:
                break
            await wait_set(ended, FOLLOW_POLL_S)
    finally:
        watcher.cancel()
    for log in followed.values():  # a last line without its newline
        if log.partial:
            _lines(log, b"\n", labelled=everyone)
    record = last[0]
    what = "deleted" if record is None else f"{record.state.value}: {record.reason}"
    print(f"=== phalanx: {job_id} {what}", file=sys.stderr)
    return 0


def _lines_of(log: ReplicaLog, labelled: bool) -> Callable[[bytes], None]:
    return lambda data: _lines(log, data, labelled=labelled)


def _lines(log: ReplicaLog, data: bytes, *, labelled: bool) -> None:
    """Write ``data`` of ``log``; labelled, whole lines only, each after ``r1-1 | ``."""
    if not labelled:
        _write(data)
        return
    *lines, log.partial = (log.partial + data).split(b"\n")
    if lines:
        label = f"{log.replica_id} | ".encode()
        _write(b"".join(label + line + b"\n" for line in lines))


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    logs = sub.add_parser("logs", parents=[parents.common],
                          help="a job's replica logs, from the agents that ran them")
    logs.add_argument("job")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R",
                       help="the replica that is rank R now (in the current generation)")
    which.add_argument("--replica", metavar="ID", help="one replica, e.g. r1-0")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="follow until the job ends (all replicas: new ones too)")
    logs.add_argument("--tail", type=whole_number, metavar="N",
                      help="only the last N lines of each log (then, with -f, what follows)")
    logs.set_defaults(func=cmd_logs)
