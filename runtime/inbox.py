"""The membership inbox: what the bus thread hands to the training thread.

The rank's bus client runs on its own thread (:mod:`.bus_thread`); its
callbacks write here, under one lock, and set one event, :attr:`Inbox.wake`,
that every wait of the training thread sleeps on, so a generation, a fault
or the job's end is noticed the moment it arrives:

* the **newest generation** of the job (older or repeated ones are ignored)
  and the trace context it arrived with;
* the replicas **reported failed** (health's faults; stragglers do not count);
* the highest step any rank of the job reported (the job's end, for a
  replica the job may complete without).

From these :meth:`Inbox.must_abort` decides whether a collective of the
current generation must be given up: a member failed, or a newer generation
that is not a *planned* change replaced it. A join this replica is part of,
and a leave (for the members that stay and for those that go alike), are
planned: the step in flight completes, and everyone switches after it.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phalanx.bus.client import Delivery
from phalanx.schemas.messages import (
    Fault,
    Generation,
    GenerationReason,
    RankProgress,
)


class Inbox:
    """Generations, faults and the job's progress, as the bus thread received them."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        #: Set when something arrives (or a collective finishes): waits sleep on it.
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._newest: Generation | None = None
        self._context: Any = None  # the trace context the newest arrived with
        self._faulted: set[str] = set()
        self._finished_step = 0

    # --- the bus thread ----------------------------------------------------------------

    def on_generation(self, generation: Generation, delivery: Delivery | None) -> None:
        with self._lock:
            if self._newest is not None and generation.generation <= self._newest.generation:
                return
            self._newest = generation
            self._context = TraceContextTextMapPropagator().extract(
                delivery.headers if delivery is not None else {})
        self.wake.set()

    def on_fault(self, fault: Fault, _: Delivery) -> None:
        if not fault.removes_member or fault.replica_id is None:
            return
        with self._lock:
            self._faulted.add(fault.replica_id)
        self.wake.set()

    def on_progress(self, progress: RankProgress, _: Delivery) -> None:
        if progress.step > self._finished_step:
            with self._lock:
                self._finished_step = max(self._finished_step, progress.step)
            self.wake.set()

    # --- the training thread -----------------------------------------------------------

    def newest(self) -> tuple[Generation | None, Any]:
        """The newest generation and the trace context it came with."""
        with self._lock:
            return self._newest, self._context

    def newest_number(self) -> int:
        with self._lock:
            return -1 if self._newest is None else self._newest.generation

    @property
    def finished_step(self) -> int:
        """The highest step any rank of the job reported."""
        with self._lock:
            return self._finished_step

    def must_abort(self, current: Generation | None) -> bool:
        """A member of ``current`` failed, or a generation that is not planned replaced it:
        a fault, or a join that leaves this replica out after one it did not see (a fault
        dropped it meanwhile). A join right after ``current`` that leaves it out takes it
        out as a leaver (its slot was taken while the others were below min), planned."""
        if current is None:
            return False
        with self._lock:
            newest, faulted = self._newest, set(self._faulted)
        if newest is not None and newest.generation > current.generation and not (
                newest.reason is GenerationReason.LEAVE
                or (newest.reason is GenerationReason.JOIN
                    and (newest.member(self.replica_id) is not None
                         or newest.generation == current.generation + 1))):
            return True
        return any(m.replica_id in faulted for m in current.members)

    def forget_faults(self, generation: Generation) -> None:
        """``generation`` was applied: its members' earlier faults are over."""
        with self._lock:
            self._faulted -= {m.replica_id for m in generation.members}

    def sleep(self, timeout_s: float) -> None:
        """Wait until something arrives, at most ``timeout_s``."""
        self.wake.wait(timeout_s)
        self.wake.clear()
