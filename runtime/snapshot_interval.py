"""How often a rank snapshots: a fixed interval, or one the members agree on from the
measured cost (``checkpoint.memory_every_steps: auto``, the default).

**The rule** (:func:`choose_interval`, pure). A snapshot costs ``c`` seconds: its time in
the training thread (state views, meta, copy, checksum, the announcement handed to the bus
thread: the time by which the rank's next step starts later) and what the step after it
takes beyond a plain step (the median of the last :data:`STEP_WINDOW` steps no snapshot
preceded): a member whose snapshot ran long is a straggler in that step's all-reduce, and
the copy has evicted caches the step reads. The in-thread time alone missed that: with
2 % of the training time in the thread, W's steps on the 2-core test machine averaged
2.6-3.1 % more than its plain steps in the same run (bench/RESULTS.md, 2026-11-28). A
step costs ``s`` seconds of training. Snapshotting every ``k`` steps costs ``c / (k·s)`` of
the training time, so the rule takes the smallest ``k`` with ``c / (k·s) <= overhead``
(``checkpoint.memory_overhead``, 2 %), capped at ``max_every``
(``checkpoint.memory_max_every_steps``: the most steps a job whose every rank dies loses
from memory; at the cap the overhead may pass the target). A rank's ``c`` is the mean of
its last :data:`COST_WINDOW` snapshots (the budget is about their total time, slow ones
included), with the steps after them where that is more (a step after one that runs
faster than a plain step does not make a snapshot cheaper than its own time), its ``s``
the median of its last :data:`STEP_WINDOW` steps (a step descheduled on a shared machine
does not shorten the interval). The first write of each buffer of a membership is not
measured, nor the step after it: it also pays the page faults of a fresh mapping (on W,
4-6 times a warm snapshot), once per buffer and membership, not once per snapshot, and
would hold the interval up for a window.

**Agreement.** Every member must snapshot the same steps: a restore needs every shard of
one step, and a durable step is persisted from its memory snapshot. So no rank decides
from its own measurements. Each adds them to the tail of the step's gradient all-reduce
(:meth:`SnapshotSchedule.tail`: cost, step time and a one, or zeros while it has nothing
measured, as a joiner), and after the all-reduce every member applies the rule to the same
sums (the all-reduce hands every rank the same bytes): the members' mean cost against
their mean step time. The mean, not the slowest member's cost, keeps the tail three
numbers at any world size; the members' shares are equal, so their costs differ only by
how busy their nodes are. With nothing measured yet the interval is 1, so the first
snapshot measures. The snapshot after ``n`` committed steps is due when ``n`` is a
multiple of the interval, or of ``durable_every`` (a durable step always has its memory
snapshot): a multiple, not "k steps since the last one", because a joiner cannot know when
the last one was. While the interval changes, two snapshots may be up to
``2·max_every`` steps apart.

Why 2 % by default: a job's whole cost against a plain DDP loop is meant to stay within
5 %, the runtime alone takes about 3 of them on the GPT example (its step's all-reduce
does not overlap the backward as DDP's buckets do; bench/RESULTS.md), and the costs
this rule does not see ride on top of what it does. At 3 % the GPT example snapshotted
every step (7 ms of a 273 ms step) and cost +6.5 % in all.

What is not counted: the announcement's cost outside the training thread (the rank's bus
thread sending it, the bus routing it, the checkpoint service taking it in), about 0.9 ms
of CPU per rank and snapshot measured on the 2-core test machine (bench/RESULTS.md), which
an interval of k divides by k like the rest; and a durable write's thread.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Sequence

from phalanx.schemas.environment import CheckpointEnvironment

#: Snapshot costs a rank's mean is taken over.
COST_WINDOW = 5
#: Step times a rank's median is taken over.
STEP_WINDOW = 16
#: The numbers each member adds to the step's all-reduce tail.
TAIL_LENGTH = 3


@dataclasses.dataclass(frozen=True)
class IntervalPolicy:
    """A job's snapshot interval, as ``checkpoint`` in its spec says.

    Args:
        every: snapshot after every ``every``-th committed step; None: adaptive.
        overhead: the adaptive interval's budget, a fraction of the training time.
        max_every: the adaptive interval's ceiling.
        durable_every: steps that are always snapshotted (persisted from memory); 0: none.
    """

    every: int | None = None
    overhead: float = 0.02
    max_every: int = 100
    durable_every: int = 0

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"a fixed snapshot interval is at least 1, got {self.every}")
        if not 0 < self.overhead <= 0.5 or self.max_every < 1 or self.durable_every < 0:
            raise ValueError(f"overhead in (0, 0.5], max_every >= 1 and durable_every >= 0, "
                             f"got {self.overhead}, {self.max_every}, {self.durable_every}")

    @classmethod
    def of(cls, checkpoint: CheckpointEnvironment) -> IntervalPolicy | None:
        """The policy the agent passed (its ``memory_*``; ``durable_every`` is the
        session's to set, from its durable policy); None: never."""
        every = checkpoint.memory_every
        if every == 0:
            return None
        return cls(every if isinstance(every, int) else None, checkpoint.memory_overhead,
                   checkpoint.memory_max_every)


def choose_interval(cost_s: float, step_s: float, overhead: float, max_every: int) -> int:
    """The smallest interval ``k`` at which a snapshot costing ``cost_s`` takes at most
    ``overhead`` of ``k`` steps of ``step_s`` each, within ``1..max_every``.

    1 when nothing is measured (``cost_s`` or ``step_s`` not positive). Pure.
    """
    if cost_s <= 0 or step_s <= 0:
        return 1
    needed = cost_s / (overhead * step_s)
    return max(1, min(max_every, math.ceil(needed)))


def agreed_interval(summed: Sequence[float], overhead: float, max_every: int) -> int:
    """The interval from the members' tails summed (:meth:`SnapshotSchedule.tail`): the
    mean cost against the mean step time of the members that measured both. Pure: every
    member gets the same ``summed`` from the all-reduce, so every member gets the same
    interval."""
    cost_sum, step_sum, members = summed
    if members < 1:
        return 1
    return choose_interval(cost_sum / members, step_sum / members, overhead, max_every)


def is_due(committed: int, interval: int, durable_every: int) -> bool:
    """Whether the snapshot after ``committed`` steps is taken. Pure."""
    return committed % interval == 0 or (durable_every > 0 and committed % durable_every == 0)


class SnapshotSchedule:
    """One rank's side of the interval: its measurements, and the interval in force (the
    same on every member, :func:`agreed_interval`)."""

    def __init__(self, policy: IntervalPolicy) -> None:
        self.policy = policy
        self.interval = policy.every or 1
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)
        # Each measured snapshot with what the step after it took beyond a plain step.
        self._whole_costs: deque[float] = deque(maxlen=COST_WINDOW)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._plain_steps: deque[float] = deque(maxlen=STEP_WINDOW)
        # What preceded the step measured next: a snapshot measured (its in-thread time),
        # one not measured (True), or none (None).
        self._after: float | bool | None = None

    @property
    def adaptive(self) -> bool:
        return self.policy.every is None

    def due(self, committed: int) -> bool:
        return is_due(committed, self.interval, self.policy.durable_every)

    def measured(self, step_s: float, snapshot_s: float | None, taken: bool = False) -> None:
        """A committed step took ``step_s`` of training, and its snapshot ``snapshot_s`` in
        the training thread (None: none taken, or ``taken`` but not to be measured)."""
        self._steps.append(step_s)
        if self._after is None:
            self._plain_steps.append(step_s)
        elif self._after is not True and self._plain_steps:
            excess = step_s - statistics.median(self._plain_steps)
            self._whole_costs.append(self._after + excess)
        if snapshot_s is not None:
            self._costs.append(snapshot_s)
        self._after = snapshot_s if snapshot_s is not None else (True if taken else None)

    def cost(self) -> float:
        """What a snapshot costs this rank (0: nothing measured): the mean of its last
        snapshots' time in the training thread, or, where larger, of that time with what
        the step after each took beyond a plain step."""
        if not self._costs:
            return 0.0
        in_thread = statistics.fmean(self._costs)
        if not self._whole_costs:
            return in_thread
        return max(in_thread, statistics.fmean(self._whole_costs))

    def tail(self) -> list[float]:
        """This member's part of the all-reduce tail: ``[cost, step time, 1]``, zeros while
        it has not measured both."""
        if not self._costs or not self._steps:
            return [0.0] * TAIL_LENGTH
        return [self.cost(), statistics.median(self._steps), 1.0]

    def agree(self, summed: Sequence[float]) -> None:
        """Every member's tail summed (the same on every member): set the interval."""
        if self.adaptive:
            self.interval = agreed_interval(summed, self.policy.overhead,
                                            self.policy.max_every)
