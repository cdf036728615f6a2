"""Fault injection inside a rank.

``PHALANX_CHAOS_KILL=<replica>:<step>:<phase>[,...]``: the named replica
SIGKILLs itself at that step (``g<N>`` for the step: at the first step of
generation N, whichever step that turns out to be), either at the step's
``boundary`` (before it starts; a member dies there before applying a generation
that came meanwhile, a replica not yet a member after it joins), in its gradient
``allreduce`` (with every bucket but the last in flight, as it would launch the
last: its peers are inside the step's collective and none can complete it,
however fast the machine; rarely, a peer is still completing the step before,
which gloo completed on the dying rank first, and aborts that one), before its
first micro-batch's ``forward`` (its peers compute the step, and with
``SyncBatchNorm`` wait in its first statistics all-reduce), or in its
``update``: with a sharded optimizer right
after it posted the broadcasts of the parameters it owns (its peers may receive
some and not others: a torn step), with a plain one right after
``optimizer.step()`` (its peers commit the step, its own commit dies with it).
``rendezvous`` (``g<N>`` only): in generation N's rendezvous, once every member
has counted itself in on rank 0's store and before the group connects; when it
is rank 0, its peers are then inside the rendezvous, on the store its death takes
with it. An entry may end in ``:oom``: the replica then
dies as one that runs out of memory does, allocating and touching memory until
something kills it (the OOM killer of its memory cgroup, where its job sets
``memory_per_rank``). It writes a ``chaos`` line to its
record first, so a test knows the death was injected. Other replicas ignore
the entries that do not name them.

``PHALANX_CHAOS_HOLD=<replica>:<path>``: a slow start. The named replica waits in
``ElasticSession.from_env``, before it connects, until ``path`` exists (checked every
50 ms): a replacement that must still be starting when something happens, however
quickly the machine starts processes.

``PHALANX_CHAOS_PACE=<seconds>:<path>``: a slow job. Every replica waits that
long before each step until ``path`` exists, then runs at full speed. A test
that must act while the job still trains (grow it, kill a node, start a
replacement) releases it when done, instead of guessing how many steps the
machine's speed leaves it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from phalanx.schemas import environment
from phalanx.schemas.errors import ConfigError

PHASES = ("boundary", "forward", "allreduce", "update", "rendezvous")
#: The phase that is not in a step: only ``g<N>`` names when.
RENDEZVOUS = "rendezvous"


@dataclasses.dataclass(frozen=True)
class Kill:
    """Where a replica dies: in ``phase`` of step ``step``, or of the first step of
    ``generation`` (exactly one of the two is set)."""

    phase: str
    step: int | None = None
    generation: int | None = None
    oom: bool = False
    """By running out of memory (:func:`die`), not by SIGKILL."""


def parse_chaos_kill(value: str, replica_id: str, group_rank: int | None = None
                     ) -> Kill | None:
    """Where ``replica_id`` dies, or None. An entry's ``<replica>`` names every rank of a
    replica group, ``<replica>.g<rank>`` one of them (this process when ``group_rank`` is
    that rank).

    Raises:
        ConfigError: an entry is not
            ``<replica>:<step|g<N>>:<boundary|forward|allreduce|update>``
            or ``<replica>:g<N>:rendezvous``.
    """
    kill = None
    for item in filter(None, value.split(",")):
        target, _, rest = item.partition(":")
        step, _, phase = rest.partition(":")
        phase, _, way = phase.partition(":")
        in_generation = step.startswith("g")
        number = step[1:] if in_generation else step
        if not number.isdigit() or phase not in PHASES or way not in ("", "oom") or (
                phase == RENDEZVOUS and not in_generation):
            raise ConfigError(f"{environment.CHAOS_KILL}: {item!r} is not "
                              "<replica>:<step|g<N>>:<boundary|forward|allreduce|update>"
                              "[:oom] or <replica>:g<N>:rendezvous[:oom]")
        if target == replica_id or (group_rank is not None
                                    and target == f"{replica_id}.g{group_rank}"):
            kill = Kill(phase, generation=int(number), oom=bool(way)) if in_generation \
                else Kill(phase, step=int(number), oom=bool(way))
    return kill


@dataclasses.dataclass
class Plan:
    """Where this process dies: ``at`` (step, phase), or the first step of the generation
    ``kill.generation`` once that generation is applied (:meth:`arm`)."""

    kill: Kill | None = None
    at: tuple[int, str] | None = None

    @classmethod
    def of(cls, kill: Kill | None) -> Plan:
        return cls(kill, None if kill is None or kill.step is None else (kill.step, kill.phase))

    def due(self, step: int, phase: str) -> bool:
        """Whether this process dies in ``phase`` of step ``step``."""
        return self.at == (step, phase)

    def arm(self, generation: int, resume: int) -> None:
        """Generation ``generation`` resumes at step ``resume``: a kill asked for in its
        first step is now a kill at that step."""
        if self.kill is not None and self.kill.generation == generation \
                and self.kill.phase != RENDEZVOUS:
            self.at = (resume, self.kill.phase)

    def in_rendezvous(self, generation: int) -> bool:
        """Whether this process dies in ``generation``'s rendezvous, once every member
        has counted in (before the group connects)."""
        return self.kill is not None and self.kill.phase == RENDEZVOUS \
            and self.kill.generation == generation


#: How much an ``oom`` death allocates at a time, and at most (then it SIGKILLs itself:
#: nothing confined it).
OOM_CHUNK = 64 << 20
OOM_MOST = 64 << 30


def die(before: Callable[[], None] | None = None, oom: bool = False) -> None:
    """Die now, as a SIGKILLed rank does (``before`` runs first: the record line); with
    ``oom``, as one out of memory does: allocate and touch memory until killed."""
    if before is not None:
        before()
    if oom:
        held: list[bytearray] = []
        while len(held) * OOM_CHUNK < OOM_MOST:
            chunk = bytearray(OOM_CHUNK)
            chunk[::4096] = b"\1" * (OOM_CHUNK // 4096)  # every page touched, so taken
            held.append(chunk)
    os.kill(os.getpid(), signal.SIGKILL)


class Pace:
    """A job held to ``seconds`` per step until ``release`` exists (checked once a step)."""

    def __init__(self, seconds: float, release: Path,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.seconds = seconds
        self.release = release
        self.released = False
        self._sleep = sleep

    def wait(self) -> None:
        """Before a step: sleep, unless the job has been released."""
        if not self.released:
            self.released = self.release.exists()
        if not self.released:
            self._sleep(self.seconds)


def hold(value: str, replica_id: str, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait here while ``value`` (``<replica>:<path>``) names this replica and ``path``
    does not exist.

    Raises:
        ConfigError: ``value`` is not ``<replica>:<path>``.
    """
    if not value:
        return
    target, _, path = value.partition(":")
    if not target or not path:
        raise ConfigError(f"{environment.CHAOS_HOLD}: {value!r} is not <replica>:<path>")
    while target == replica_id and not Path(path).exists():
        sleep(0.05)


def parse_chaos_pace(value: str) -> Pace | None:
    """The pace ``<seconds>:<path>`` asks for, or None (empty).

    Raises:
        ConfigError: it is not ``<seconds>:<path>`` with seconds a number in (0, 60].
    """
    if not value:
        return None
    seconds, _, path = value.partition(":")
    try:
        wait = float(seconds)
    except ValueError:
        wait = -1.0
    if not 0 < wait <= 60 or not path:
        raise ConfigError(f"{environment.CHAOS_PACE}: {value!r} is not <seconds>:<path> "
                          "(seconds in (0, 60])")
    return Pace(wait, Path(path))
