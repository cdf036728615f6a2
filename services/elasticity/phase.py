"""The phases of a job's membership and the transitions between them. Pure.

:class:`Phase` names what a job's membership is doing; its docstring lists every transition
the rules make, and :data:`TRANSITIONS` is that list as data, which the property tests
hold the rules to. :attr:`~.model.JobMembership.phase` computes a job's phase.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """What a job's membership is doing, computed from its fields (first that applies):

    * ``COMPLETE``: a member exited 0; nothing is launched or published any more.
    * ``GANG``: no replica reported ready yet (not ``managed``): the processes are a
      torchrun gang of incarnation ``gang_round`` in every slot (a declared session's,
      worlds of their own).
    * ``WAITING``: below ``min`` since ``waiting_since``; past the wait timeout the job
      is requeued.
    * ``GATHERING``: no survivor holds the job's state: the next generation waits for
      every replacement launched, since ``gather_since`` (at most ``GATHER_S``).
    * ``FORMING``: generation 0 waits for the replicas launched at first (``forming``).
    * ``IN_FLIGHT``: not every member applied the ``current`` generation.
    * ``TRAINING``: every member applied it.

    A phase may stay as it is on any event. The transitions between phases:

    * ``GANG`` → ``FORMING``: a replica of the gang's incarnation is ready; generation 0
      waits for the others launched.
    * ``GANG`` → ``IN_FLIGHT``: that replica was the last one awaited: generation 0.
    * ``GANG`` → ``WAITING``: a declared session's faults, kept until then, leave fewer
      than ``min`` to form generation 0.
    * ``FORMING`` → ``IN_FLIGHT``: the last replica awaited is ready or failed, with at
      least ``min`` ready: generation 0.
    * ``FORMING`` → ``WAITING``: the last one awaited failed, or its slot was taken,
      with fewer than ``min`` ready.
    * ``WAITING`` → ``IN_FLIGHT``: enough replicas are ready: the next generation.
    * ``WAITING`` → ``COMPLETE``: a member exited 0.
    * ``GATHERING`` → ``IN_FLIGHT``: every replacement is ready, or ``GATHER_S`` passed.
    * ``GATHERING`` → ``WAITING``: a fault left fewer than ``min``.
    * ``GATHERING`` → ``COMPLETE``: a member exited 0.
    * ``IN_FLIGHT`` → ``TRAINING``: the last member applied it.
    * ``IN_FLIGHT`` → ``WAITING``: a fault left fewer than ``min``.
    * ``IN_FLIGHT`` → ``GATHERING``: a fault left no member that holds the state.
    * ``IN_FLIGHT`` → ``COMPLETE``: a member exited 0.
    * ``TRAINING`` → ``IN_FLIGHT``: a join, a leave or a fault: the next generation.
    * ``TRAINING`` → ``WAITING``: a fault left fewer than ``min``.
    * ``TRAINING`` → ``GATHERING``: a fault left no member that holds the state.
    * ``TRAINING`` → ``COMPLETE``: a member exited 0.

    A job leaves the core, from any phase, when its record is not admitted any more or
    is another admission's; and from ``WAITING`` when the wait timeout requeues it.
    """

    GANG = "gang"
    FORMING = "forming"
    WAITING = "waiting"
    GATHERING = "gathering"
    IN_FLIGHT = "in_flight"
    TRAINING = "training"
    COMPLETE = "complete"


def _table(*moves: tuple[Phase, Phase]) -> dict[Phase, frozenset[Phase]]:
    return {phase: frozenset({phase} | {after for before, after in moves if before is phase})
            for phase in Phase}


#: The phases each phase may move to (itself included), as :class:`Phase` lists them.
TRANSITIONS = _table(
    (Phase.GANG, Phase.FORMING), (Phase.GANG, Phase.IN_FLIGHT), (Phase.GANG, Phase.WAITING),
    (Phase.FORMING, Phase.IN_FLIGHT), (Phase.FORMING, Phase.WAITING),
    (Phase.WAITING, Phase.IN_FLIGHT), (Phase.WAITING, Phase.COMPLETE),
    (Phase.GATHERING, Phase.IN_FLIGHT), (Phase.GATHERING, Phase.WAITING),
    (Phase.GATHERING, Phase.COMPLETE),
    (Phase.IN_FLIGHT, Phase.TRAINING), (Phase.IN_FLIGHT, Phase.WAITING),
    (Phase.IN_FLIGHT, Phase.GATHERING), (Phase.IN_FLIGHT, Phase.COMPLETE),
    (Phase.TRAINING, Phase.IN_FLIGHT), (Phase.TRAINING, Phase.WAITING),
    (Phase.TRAINING, Phase.GATHERING), (Phase.TRAINING, Phase.COMPLETE),
)
