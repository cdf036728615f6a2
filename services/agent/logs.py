"""A node's replica logs: where they are, and reading them for ``phalanx logs`` over the bus
(``LogRequest``).

Each replica's output goes to a file in its agent's work dir (:func:`replica_log`; the
agent heads it, and a warm spare's, with a line stamped :func:`utc_now`) and stays on
that node; the agent answers with which of a job's replicas left a log here, or a piece
of one. Job and replica ids are ``Ident`` tokens (letters, digits, ``_`` and ``-``), so
a request names a file under ``jobs/<job>/`` and nothing else.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from phalanx.bus.errors import RequestRefused
from phalanx.schemas.messages import MAX_LISTED_LOGS, LogReply, LogRequest, ReplicaLog
from phalanx.schemas.replicas import replica_order


def replica_log(work_dir: Path, job_id: str, replica_id: str) -> Path:
    """Where a node's agent (work dir ``work_dir``) keeps a replica's output."""
    return work_dir / "jobs" / job_id / f"{replica_id}.log"


def utc_now() -> str:
    """Now, as log headers write it."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def read_logs(work_dir: Path, node_id: str, request: LogRequest) -> LogReply:
    """The answer to ``request`` from the logs under ``work_dir`` (blocking file reads).

    Raises:
        RequestRefused: 404, the replica left no log on this node.
    """
    if request.replica_id is None:
        logs = [ReplicaLog(replica_id=path.stem, size=path.stat().st_size)
                for path in (work_dir / "jobs" / request.job_id).glob("*.log")]
        # Too many for one reply (a node that ran thousands of replacements): the newest
        # incarnations', which hold what is happening now.
        kept = sorted(sorted(logs, key=lambda log: replica_order(log.replica_id)[1::-1])
                      [-MAX_LISTED_LOGS:], key=lambda log: replica_order(log.replica_id))
        return LogReply(node_id=node_id, logs=kept, unlisted=len(logs) - len(kept))
    path = replica_log(work_dir, request.job_id, request.replica_id)
    try:
        with path.open("rb") as log:
            size = log.seek(0, 2)
            log.seek(min(request.offset, size))
            data = log.read(request.max_bytes)
    except FileNotFoundError:
        raise RequestRefused("404", f"{request.replica_id} of {request.job_id} left no log "
                                    f"on {node_id}") from None
    return LogReply(node_id=node_id, offset=min(request.offset, size), data=data, size=size)
