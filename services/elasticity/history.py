"""A job's history across its admissions: what ``phalanx_history`` keeps. Pure.

The core keeps the generations of the job's current admission
(:attr:`~phalanx.services.elasticity.model.JobMembership.history`); a job requeued
(preempted, its node lost, too long below its minimum) and admitted again starts a new
membership at generation 0. So that ``phalanx job`` still shows what happened before,
each history stored carries the earlier admissions' generations (``JobHistory.earlier``),
taken from the one stored before it. Which admission a stored history is of needs no
marker: within an admission the generations are one list the core only appends to (and
trims at its old end), so a stored history is of the same admission exactly when it
holds the new one's first generation.
"""

from __future__ import annotations

import msgspec

from phalanx.schemas.messages import HISTORY_BYTES, HISTORY_LIMIT, GenerationRecord, JobHistory


def within_budget(history: list[GenerationRecord]) -> list[GenerationRecord]:
    """The latest of ``history`` whose records take about ``HISTORY_BYTES`` at most (the
    newest is always kept)."""
    used = 0
    for i in range(len(history) - 1, -1, -1):
        record = history[i]
        used += 64 + len(record.cause.encode()) + sum(len(m) + 2 for m in record.members)
        if used > HISTORY_BYTES and i < len(history) - 1:
            return history[i + 1:]
    return history


def carried(stored: JobHistory | None, new: JobHistory) -> JobHistory:
    """``new``, the current admission's history, with the earlier admissions' generations:
    ``stored``'s earlier ones, and its own when ``stored`` is another admission's (the
    latest ``HISTORY_LIMIT`` within ``HISTORY_BYTES``)."""
    if stored is None:
        return new
    first = new.generations[0] if new.generations else None
    same = first is not None and any(
        (g.generation, g.decided_at) == (first.generation, first.decided_at)
        for g in stored.generations)
    earlier = stored.earlier if same else [*stored.earlier, *stored.generations]
    return msgspec.structs.replace(new, earlier=within_budget(earlier[-HISTORY_LIMIT:]))
