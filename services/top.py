"""``phalanx top``: a live terminal view of the cluster at work.

Three panels, rendered with rich: the **nodes** (as ``phalanx nodes`` shows them), the
**jobs** (state, size against its min and max, the generation its members applied last
and one decided after it, marked pending, step and steps per second),
and the **latest events** (rank starts and exits, faults, readiness and applied
generations from the job-events stream, then generations, scaling events and node
conditions as they are published), in the order they happened: each at its own time,
or the time the stream stored it, or (a message not stored) when it arrived.

It refreshes from the bus, not by polling: the jobs, nodes, generations, history and
progress buckets are watched (their current values first, then every change) and each change
redraws the frame; a one-second tick only ages the heartbeats. ``--once`` reads the
current values and the last events stored, prints one frame and exits.

:class:`Board` is the state the watches fill and :func:`render` draws it; both are plain
functions of their inputs, so a frame can be tested as text.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from rich.console import Group
from rich.table import Table

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.kv import Change, TypedKV
from phalanx.bus.stream import JOB_EVENTS, EventReader
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    Fault,
    Generation,
    GenerationApplied,
    GenerationGivenUp,
    JobHistory,
    JobProgress,
    JobRecord,
    Message,
    NodeConditionChanged,
    NodeRecord,
    RankExited,
    RankStarted,
    ReplicaReady,
    ScalingEvent,
)
from phalanx.schemas.registry import views
from phalanx.services.deadline import wait_set
from phalanx.services.tables import node_table, size_cell, step_cell, whole_columns

#: Events kept and shown (the newest last).
EVENTS = 12
#: Stored job events a frame starts from.
STORED_EVENTS = 50

M = TypeVar("M", bound=Message)


@dataclasses.dataclass
class Board:
    """What the view shows, as the bus last told it."""

    nodes: dict[str, NodeRecord] = dataclasses.field(default_factory=dict)
    jobs: dict[str, JobRecord] = dataclasses.field(default_factory=dict)
    generations: dict[str, Generation] = dataclasses.field(default_factory=dict)
    progress: dict[str, JobProgress] = dataclasses.field(default_factory=dict)
    histories: dict[str, JobHistory] = dataclasses.field(default_factory=dict)
    events: collections.deque[tuple[float, str, str]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=EVENTS))

    def take(self, into: dict[str, M], change: Change[M]) -> None:
        if change.value is None:
            into.pop(change.key, None)
        else:
            into[change.key] = change.value

    def note(self, message: Message, arrived_at: float) -> None:
        """Keep ``message`` among the latest events, if it is one worth showing."""
        described = describe(message, arrived_at)
        if described is not None:
            self.events.append(described)


def describe(message: Message, arrived_at: float) -> tuple[float, str, str] | None:
    """An event line: (when, job or node, what happened); None for anything else.

    When is the message's own time where it has one, else ``arrived_at``: the time the
    stream stored it, or for a message that is not stored, when it was received."""
    match message:
        case RankStarted():
            return (message.started_at, message.job_id,
                    f"{message.replica_id or 'rank'} started in slot {message.rank} on "
                    f"{message.node_id}")
        case RankExited():
            how = f"signal {message.signal}" if message.signal else f"code {message.exit_code}"
            return (message.exited_at, message.job_id,
                    f"{message.replica_id or 'rank'} (rank {message.rank}) "
                    f"{message.cause.value}, {how}")
        case Fault():
            who = message.replica_id or message.node_id
            return (message.detected_at, message.job_id,
                    f"fault {message.kind.value}: {who}" + (
                        f" ({message.detail.splitlines()[0]})" if message.detail else ""))
        case ReplicaReady():
            return (message.sent_at or arrived_at, message.job_id,
                    f"{message.replica_id} ready on {message.node_id}")
        case GenerationApplied():
            return (arrived_at, message.job_id,
                    f"{message.replica_id} applied generation {message.generation} "
                    f"(rebuild {message.rebuild_s:.3f} s, copy {message.state_copy_s:.3f} s)")
        case GenerationGivenUp():
            return (message.sent_at or arrived_at, message.job_id,
                    f"{message.replica_id} gave up generation {message.generation}")
        case Generation():
            return (arrived_at, message.job_id,
                    f"generation {message.generation} ({message.reason.value}): "
                    f"world size {message.world_size}")
        case ScalingEvent():
            return (message.at, message.job_id,
                    f"scaling {message.kind.value} {message.from_replicas} -> "
                    f"{message.to_replicas} ({message.reason})")
        case NodeConditionChanged():
            return (message.at, message.node_id,
                    f"node {message.condition.value}: {message.reason}")
    return None


def generation_cells(generation: Generation | None,
                     history: JobHistory | None) -> tuple[int | None, str]:
    """A job's size and generation as its members have them: the generation they applied
    last (the newest of its admission's history that a member reported applied), and a
    newer one elasticity decided, ``(N pending)``, until a member applies it. During an
    outage a generation is decided that no member applies until the cluster is back
    (top showed ``gen 2`` for a job still training in generation 1). Without a history
    that holds the decided generation (not written yet, or still another admission's:
    each admission counts from generation 0) the decided generation is all there is to
    show. The size is the shown generation's world size (None: neither is known)."""
    if generation is None:
        return None, "-"
    members = [m.replica_id for m in generation.members]
    if history is None or not any(g.generation == generation.generation
                                  and g.members == members for g in history.generations):
        return generation.world_size, str(generation.generation)
    applied = next((g for g in reversed(history.generations)
                    if g.applied_resume_step is not None), None)
    if applied is not None and applied.generation >= generation.generation:
        return applied.world_size, str(applied.generation)
    pending = f"({generation.generation} pending)"
    if applied is None:
        return generation.world_size, f"- {pending}"
    return applied.world_size, f"{applied.generation} {pending}"


def render(board: Board, now: float, lost_after_s: float) -> Group:
    """One frame of the view."""
    nodes = node_table(views(board.nodes.values(), now, lost_after_s))
    rows = []
    for job_id, record in sorted(board.jobs.items(), key=lambda j: j[1].submitted_at):
        applied_size, gen = generation_cells(board.generations.get(job_id),
                                             board.histories.get(job_id))
        progress = board.progress.get(job_id)
        size = applied_size if applied_size is not None else len(record.nodes)
        step = step_cell(None, None) if progress is None \
            else step_cell(progress.step, progress.total_steps, progress.reached_step())
        rate = "-" if progress is None or progress.steps_per_s is None \
            else f"{progress.steps_per_s:.1f}"
        rows.append((job_id, record.state.value, size_cell(size, record.spec.replicas), gen,
                     step, rate, " ".join(sorted(set(record.nodes))) or "-"))
    jobs = Table(title="jobs")
    # Size: now (min..max); gen: the generation applied (one decided after it pending). No
    # cell is cut; the nodes wrap.
    whole_columns(jobs, ("job", "state", "size", "gen", "step", "steps/s", "nodes"), rows,
                  wrapping=("nodes",))
    events = Table(title="latest events")
    for column in ("time", "job / node", "event"):
        events.add_column(column)
    for at, who, what in sorted(board.events, key=lambda e: e[0]):
        events.add_row(time.strftime("%H:%M:%S", time.localtime(at)), who, what)
    return Group(nodes, jobs, events)


#: A bucket the board mirrors, and the board's part that holds its values (the list of
#: them mixes message types: each pair agrees on one, which a list cannot say).
Mirrored = tuple[TypedKV[Any], Callable[[Board], dict[str, Any]]]


async def _buckets(bus: Bus) -> list[Mirrored]:
    return [
        (await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord), lambda b: b.nodes),
        (await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord), lambda b: b.jobs),
        (await TypedKV.open(bus.js, subjects.GENERATIONS_BUCKET, Generation),
         lambda b: b.generations),
        (await TypedKV.open(bus.js, subjects.PROGRESS_BUCKET, JobProgress),
         lambda b: b.progress),
        (await TypedKV.open(bus.js, subjects.HISTORY_BUCKET, JobHistory),
         lambda b: b.histories),
    ]


async def _stored_events(bus: Bus) -> tuple[int, int]:
    """The job-events stream's first sequence to show and its last one (0, 0: none)."""
    try:
        info = await bus.js.stream_info(JOB_EVENTS)
    except Exception:  # no job has run yet: the stream is made by the first agent
        return 0, 0
    if info.state.messages == 0:
        return 0, 0
    return max(info.state.first_seq, info.state.last_seq - STORED_EVENTS + 1), \
        info.state.last_seq


async def snapshot(bus: Bus) -> Board:
    """The current values of every bucket and the last stored events."""
    board = Board()
    for kv, part in await _buckets(bus):
        async for change in _current(kv):
            board.take(part(board), change)
    first, last = await _stored_events(bus)
    if last:
        reader = await EventReader(bus, first).start()
        try:
            async for event in reader:
                board.note(event.message, event.stored_at or time.time())
                if event.seq >= last:
                    break
        finally:
            await reader.close()
    return board


async def _current(kv: TypedKV[M]) -> AsyncIterator[Change[M]]:
    async for change in kv.watch():
        if change is None:
            return
        yield change


async def live(bus: Bus, show: Callable[[Board], None]) -> None:
    """Keep a board current from the bus and call ``show`` whenever it changed (and every
    second, for the heartbeat ages), until cancelled."""
    board = await snapshot(bus)
    changed = asyncio.Event()
    _, last = await _stored_events(bus)

    async def follow(kv: TypedKV[M], part: Callable[[Board], dict[str, M]]) -> None:
        async for change in kv.follow(bus.resync_event()):
            if change is not None:
                board.take(part(board), change)
                changed.set()

    async def on_event(message: Message, _: Delivery, arrived_at: float | None = None) -> None:
        board.note(message, arrived_at or time.time())  # a live message: received now
        changed.set()

    async def stored() -> None:
        reader = await EventReader(bus, last + 1).start()
        try:
            async for event in reader:
                await on_event(event.message, event.delivery, event.stored_at)
        finally:
            await reader.close()

    async with asyncio.TaskGroup() as tasks:
        watchers = [tasks.create_task(follow(kv, part)) for kv, part in await _buckets(bus)]
        watchers.append(tasks.create_task(stored()))
        subscriptions = [
            await bus.subscribe(subjects.job_events("generation"), Generation, on_event),
            await bus.subscribe(subjects.job_events("scaling"), ScalingEvent, on_event),
            await bus.subscribe(subjects.node_conditions(), NodeConditionChanged, on_event)]
        try:
            while True:
                show(board)
                changed.clear()
                await wait_set(changed, 1.0)
        finally:
            for subscription in subscriptions:
                await subscription.unsubscribe()
            for watcher in watchers:
                watcher.cancel()
