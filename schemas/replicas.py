"""Replica ids: the name of the process that runs in one slot of a job.

A slot's first replica is ``r<slot>-0``; elasticity names each replacement with
the slot's next *incarnation* (``r<slot>-1``, ``r<slot>-2`` …). The node agent
launches replicas by these names and refuses one older than the slot's last
(:func:`phalanx.services.agent.core.launch_verdict`), so both sides must write and
read the name the same way: they take it from here, not from each other. Pure.

A replica of several ranks (``JobSpec.ranks_per_replica``, a group) is one name for all
its processes; each writes its own log, named with its rank in the group
(:func:`member_log`: ``r<slot>-<incarnation>_g<group rank>``).

A job admitted again after a requeue names its replicas ``r<slot>-0`` again, so a
replica id names one process only within one admission (``JobRecord.admission``): the
ranks' events carry it, and health and elasticity drop an earlier admission's
(:func:`another_admission`).
"""

from __future__ import annotations

import re

_REPLICA = re.compile(r"r(\d+)-(\d+)")
_MEMBER = re.compile(r"(.+)_g(\d+)")


def replica_id(slot: int, incarnation: int) -> str:
    """The id of ``slot``'s replica number ``incarnation`` (0: the slot's first)."""
    return f"r{slot}-{incarnation}"


def incarnation(replica: str) -> int | None:
    """The incarnation number of ``r<slot>-<incarnation>``; None for any other name."""
    match = _REPLICA.fullmatch(replica)
    return int(match[2]) if match else None


def earlier(replica: str, than: str) -> bool:
    """Whether ``replica`` is an earlier incarnation than ``than`` (names without an
    incarnation are never earlier: they are told apart by equality alone)."""
    before, after = incarnation(than), incarnation(replica)
    return before is not None and after is not None and after < before


def member_log(replica: str, group_rank: int | None) -> str:
    """The name of the log of rank ``group_rank`` of ``replica``'s group (None: a replica
    of one rank, whose log is named as the replica)."""
    return replica if group_rank is None else f"{replica}_g{group_rank}"


def log_replica(name: str) -> tuple[str, int | None]:
    """The replica and group rank a log's ``name`` is of (:func:`member_log` read back)."""
    match = _MEMBER.fullmatch(name)
    return (match[1], int(match[2])) if match else (name, None)


def replica_order(log: str) -> tuple[int, int, int, str]:
    """A sort key: ``r<slot>-<incarnation>`` in slot, then incarnation order, a group's
    logs (:func:`member_log`) in group rank order (any other name after them, by name),
    as ``phalanx logs`` lists replicas."""
    replica, group_rank = log_replica(log)
    match = _REPLICA.fullmatch(replica)
    return (int(match[1]), int(match[2]), group_rank or 0, "") if match \
        else (1 << 62, 0, 0, log)


def another_admission(current: int, seen: int) -> bool:
    """Whether an event of the job's admission ``seen`` is of another admission than the
    ``current`` one (0 on either side: not known, a sender older than the number or a
    rank started by hand, taken as the current one)."""
    return bool(current and seen and current != seen)
