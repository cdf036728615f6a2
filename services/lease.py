"""Leader leases: of the instances of a service, at most one acts at a time.

A lease is a :class:`~phalanx.schemas.messages.Lease` record under the
service's key in the ``phalanx_leases`` bucket. An instance takes it when it is
absent, left unrenewed (below), or already its own (compare-and-swap: of two
instances trying at once, one wins), renews it every ``lease_s / 6`` at the
revision it last wrote, and releases it on a clean stop (a delete conditional on
that revision), so a standby takes over at once after a stop, and after a crash
once it has watched the last renewal for ``lease_s`` (it checks every
``lease_s / 3``: within ``lease_s * 5 / 3`` of that renewal).

Another instance takes over only after watching the same revision of the lease for
``lease_s`` by *its* clock (:func:`may_take`): it cannot see a renewal before it is
written, nor a renewal be written before it is sent, so it takes over no sooner than
``lease_s`` after the holder *sent* its last renewal that was stored. No two clocks
need agree (the lease's ``expires_at``, the holder's wall clock, is for people to
read). A standby that has just started, or last saw another revision, waits a whole
``lease_s`` of watching.

**A leader stops acting before another can take its lease.** It acts only until
:func:`acts_until`: ``lease_s * 2 / 3`` (:data:`ACTS_FOR`) after it sent its last
renewal that the bus confirmed, by its own monotonic clock. A timer set at each
confirmation cancels its work at that moment, whatever the lease's loop is doing (a
renewal that waits on a cut link, retried through a failover, is itself cut short
there). So a leader cut from the bus, both ways or only heard not, has stopped a
third of a lease before the earliest takeover: that third is the margin for its
cancellation and for clocks that do not run at quite the same rate. A renewal
confirmed after its own deadline starts nothing; the next check reads the lease
afresh, and leads again if it is still its own.

**Renewals run on a thread of their own, over a connection of their own,** while the
service's loop turns. A leader's own work shares its loop: restoring 12,000 jobs, or
a burst's thousands of writes in flight, held or crowded it past the margin, and
renewals sent from it went out and came back too late: the leader deposed itself,
led again, restored again, and was deposed again. The thread renews whatever that
loop does, and stops renewing once the loop has not run what the thread posts it for
``hung_s`` (:data:`HUNG_LEASES` leases): a hung leader still loses its lease. A
garbage collection holds every thread, this one too: the service shell makes full
collections rare (:data:`~phalanx.services.base.GC_THRESHOLDS`). The
timer that ends a term stays on the service's loop: a loop held past
:func:`acts_until` cancels the work when it turns again (the step that held it may
send one more write first, which fencing refuses if a successor wrote since).

**A leader on a minority's server stands down.** On a NATS cluster, a connection whose
server is found cut from the majority (``Bus.in_majority`` false: :mod:`phalanx.bus.
majority`) is moving off it. While either of the leader's connections, the service's
or the renewals', is, it stops at its next check and takes no term: the lease read there
may be stale, and with the service's connection on the majority and the renewals' on the
minority it was deposed and took the lease back every 2 s, deciding nothing (issue 53).

A renewal that finds the lease moved on means another instance leads: the leader's
work is cancelled at once. No error in a check ends the lease's loop: one this module
does not expect steps down (the work is cancelled, the lease left to run out) and the
next check starts from a fresh read, which finds the lease still its own if nothing
else took it, or another's: then it stands by (a cut leader after the link heals).
Whatever a leader writes that others must not overwrite after a takeover is
compare-and-swapped on its own revision as well (fencing), so a write the leader sent
in time but that a cut held back until after a takeover is refused, not applied.

Each instance shows whether it leads as ``phalanx_leader{service=<key>}`` (1 or 0) on
its metrics page, so "no leader" is ``max by (service) (phalanx_leader) < 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import Conflict
from phalanx.bus.kv import TypedKV
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import Lease
from phalanx.services import metrics

log = logging.getLogger("phalanx.lease")
T = TypeVar("T")


class LeadershipLost(PhalanxError, RuntimeError):
    """Another instance changed the lease (or state this leader fences on): stop acting."""


@dataclasses.dataclass(frozen=True)
class Sighting:
    """Another instance's lease as this one watches it: the revision it saw, and when
    it first saw that revision, by its own monotonic clock."""

    revision: int
    since: float


def sighted(before: Sighting | None, revision: int, now: float) -> Sighting:
    """The sighting after reading the lease at ``revision`` at ``now``."""
    if before is not None and before.revision == revision:
        return before
    return Sighting(revision, now)


#: Of a lease's length, how long a leader acts after sending its last confirmed renewal.
ACTS_FOR = 2 / 3
#: In leases, how long the service's loop may go without turning before it counts as
#: hung and its lease is renewed no more (:class:`Leadership`).
HUNG_LEASES = 2.0
#: In leases, how often the renewal thread renews.
RENEW_EVERY = 1 / 6


def acts_until(sent: float, lease_s: float) -> float:
    """When a leader must have stopped acting (its own monotonic clock), its last renewal
    that the bus confirmed having been sent at ``sent``: :data:`ACTS_FOR` of a lease on.
    A standby takes the lease no sooner than ``lease_s`` after ``sent`` by its clock."""
    return sent + lease_s * ACTS_FOR


def deposed(sent: float, lease_s: float, now: float) -> bool:
    """Whether a leader whose last confirmed renewal was sent at ``sent`` must have
    stopped acting at ``now`` (:func:`acts_until`)."""
    return now >= acts_until(sent, lease_s)


def may_take(current: Lease | None, holder: str, sighting: Sighting | None, revision: int,
             lease_s: float, now: float) -> bool:
    """Whether ``holder`` may take the lease, read at ``revision`` at ``now`` (its own
    monotonic clock): absent, its own, or left unrenewed — that revision watched since
    ``sighting`` — for ``lease_s``. The holder's stamps are never read."""
    return (current is None or current.holder == holder
            or (sighting is not None and sighting.revision == revision
                and now - sighting.since >= lease_s))


def fenced_out(exc: BaseException) -> LeadershipLost | None:
    """The :class:`LeadershipLost` that ended a leader's work — also from a task group,
    which wraps it in an exception group — or None if anything else took part."""
    if isinstance(exc, LeadershipLost):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        lost, rest = exc.split(LeadershipLost)
        if lost is not None and rest is None:
            first: LeadershipLost | BaseExceptionGroup[LeadershipLost] = lost
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            return first
    return None


@dataclasses.dataclass
class Tenure:
    """One unbroken holding of the lease, from a take to a step-down or deposal.

    The renewal thread writes :attr:`revision` and :attr:`renewed_at`; the service's
    loop reads :attr:`renewed_at` (its timer) and sets :attr:`ended`. Each is one
    attribute written by one side, so no lock is needed.
    """

    epoch: int
    revision: int
    #: Monotonic: when the last renewal that the bus confirmed was sent.
    renewed_at: float
    #: Set by the service's loop: no renewal of this tenure starts any more.
    ended: bool = False
    #: The renewal thread found the service's loop silent and renews no more.
    hung: bool = False


class _LeaseThread:
    """An event loop on a thread of its own, with a bus connection of its own: renewals
    go out and come back there however long the service's loop is held or crowded."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.bus: Bus | None = None
        self.leases: TypedKV[Lease] | None = None
        #: Held (on this thread) by a renewal or a release: they never overlap.
        self.writing = asyncio.Lock()

    async def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on this thread and wait for it; cancelling the caller
        cancels it."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine,
                                                                          self.loop))

    async def close(self) -> None:
        """Cancel what runs on the thread, close its connection, end the thread."""
        async def shut() -> None:
            rest = asyncio.all_tasks() - {asyncio.current_task()}
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest)
            if self.bus is not None:
                await self.bus.close()

        try:
            await self.call(shut())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            await asyncio.to_thread(self._thread.join, 10)
            if not self._thread.is_alive():
                self.loop.close()


class Leadership:
    """Holds ``key``'s lease for ``holder`` and runs ``lead()`` exactly while holding it.

    ``lead`` is started when the lease is taken and cancelled when it is lost, or when
    the lease could not be confirmed in time (:func:`acts_until`); if it returns or
    raises, the lease is released so that another instance (or this one, at the next
    attempt) starts afresh.

    The lease is taken from the service's loop, and renewed (and released) from a
    thread of its own over a connection of its own (``bus_config``), for as long as
    the service's loop turns: the leader's own work may hold that loop or crowd it with
    thousands of ready tasks, never delay a renewal (before, a busy admission leader
    deposed itself term after term). A loop that has not turned for ``hung_s`` is
    hung: the thread renews no more, so that another instance takes over.

    Args:
        leases: the lease bucket.
        key: the service's key in it.
        holder: this instance's name (a subject token).
        lease_s: how long a lease lasts without renewal.
        lead: the leader's work.
        bus_config: where the renewal thread connects (the service's own bus).
        hung_s: how long the service's loop may go without turning before renewals
            stop; ``None``: :data:`HUNG_LEASES` leases.
        in_majority: whether the service's own connection's server answers for the
            cluster's majority (``Bus.in_majority``); ``None``: only the renewals'
            connection is judged.
        clock: this instance's monotonic clock (tests give their own).
    """

    def __init__(self, leases: TypedKV[Lease], key: str, holder: str, lease_s: float,
                 lead: Callable[[], Awaitable[None]], *, bus_config: BusConfig,
                 hung_s: float | None = None, in_majority: Callable[[], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.leases = leases
        self.key = key
        self.holder = holder
        self.lease_s = lease_s
        self.lead = lead
        self.bus_config = bus_config
        self.hung_s = lease_s * HUNG_LEASES if hung_s is None else hung_s
        self.clock = clock
        self._service_in_majority = in_majority or (lambda: True)
        self.sighting: Sighting | None = None  # another's lease, while we stand by
        self.epoch = 0
        #: Terms ended because the lease could not be confirmed in time.
        self.deposals = 0
        #: Monotonic: when the service's loop last ran what the renewal thread posted.
        self.loop_seen = clock()
        self._tenure: Tenure | None = None
        self._last: Tenure | None = None  # the tenure of the moment, or the last one
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._thread: _LeaseThread | None = None
        self._gauge = metrics.LEADER.labels(key)
        self._gauge.set(0)

    @property
    def leading(self) -> bool:
        return self._tenure is not None

    @property
    def acts_until(self) -> float:
        """When this leader stops acting unless a renewal is confirmed first (or, having
        stopped, when it did)."""
        assert self._last is not None, "never led"
        return acts_until(self._last.renewed_at, self.lease_s)

    async def run(self, sleep_or_stop: Callable[[float], Awaitable[bool]]) -> None:
        """Try to lead every ``lease_s / 3`` until ``sleep_or_stop`` says stop; then
        release the lease."""
        try:
            while True:
                await self._check()
                if await sleep_or_stop(self.lease_s / 3):
                    break
        finally:
            try:
                await self.step_down(release=True)
            finally:
                thread, self._thread = self._thread, None
                if thread is not None:
                    await thread.close()

    @property
    def in_majority(self) -> bool:
        """Whether both connections, the service's and the renewals', are on servers
        that answer for the cluster's majority (:mod:`phalanx.bus.majority`)."""
        thread = self._thread
        renewals = thread is None or thread.bus is None or thread.bus.in_majority
        return renewals and self._service_in_majority()

    async def _check(self) -> None:
        if not self.in_majority:
            # A minority's server stores no take nor renewal, and what it reads of the lease
            # may be stale: stand by until the connections have moved to the majority.
            if self._tenure is not None:
                self._end(self._tenure, "its nats-server is cut from the cluster's majority")
        elif self._tenure is None:
            try:
                await self._try_take()
            except (PhalanxError, TimeoutError, OSError) as exc:
                log.warning("lease check failed: %s", exc, extra={"lease": self.key})
            except Exception:  # not an outage this code knows: lead again from a fresh read
                log.exception("lease check failed unexpectedly; stepping down",
                              extra={"lease": self.key})
                await self.step_down(release=False)
        if self._tenure is None and self._task is not None:
            await self.step_down(release=False)  # deposed or lost: reap the cancelled work
        if self._task is not None and self._task.done():
            await self.step_down(release=True)  # the work ended: let the next term start clean

    async def _try_take(self) -> None:
        # An undecodable lease counts as absent: it is replaced at its revision.
        current, revision = await self.leases.current(self.key)
        now = self.clock()
        if current is not None and current.holder != self.holder:
            self.sighting = sighted(self.sighting, revision, now)
        if not may_take(current, self.holder, self.sighting, revision, self.lease_s, now):
            return
        epoch = current.epoch + 1 if current else 1
        lease = Lease(holder=self.holder, epoch=epoch, expires_at=time.time() + self.lease_s)
        try:
            async with asyncio.timeout(max(0.0, acts_until(now, self.lease_s) - now)):
                revision = (await self.leases.update(self.key, lease, revision) if revision
                            else await self.leases.create(self.key, lease))
        except Conflict:
            return  # another instance was quicker
        if self._thread is None:  # the renewals' own connection, once this instance leads
            self._thread = await self._start_thread()
        if deposed(now, self.lease_s, self.clock()):
            return  # confirmed too late to act on: the next check reads it afresh
        self._tenure = self._last = Tenure(epoch, revision, now)
        self.loop_seen = self.clock()
        self.epoch = epoch
        self.sighting = None
        self._gauge.set(1)
        log.info("leading", extra={"lease": self.key, "epoch": epoch})
        self._arm()
        self._task = asyncio.create_task(self._lead(), name=f"lead {self.key}")

    async def _start_thread(self) -> _LeaseThread:
        thread = _LeaseThread(f"phalanx-lease-{self.key}")
        try:
            thread.bus = await thread.call(Bus.connect(self.bus_config,
                                                       name=f"lease:{self.holder}"))
            thread.leases = await thread.call(TypedKV.open(thread.bus.js,
                                                           self.leases.bucket, Lease))
            thread.loop.call_soon_threadsafe(
                thread.loop.create_task,
                self._renewing(thread, asyncio.get_running_loop()))
        except BaseException:
            await thread.close()
            raise
        return thread

    async def _lead(self) -> None:
        try:
            await self.lead()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            lost = fenced_out(exc)
            if lost is not None:  # fencing worked as designed: nothing is wrong here
                log.warning("stepping down: %s", lost, extra={"lease": self.key})
            else:
                log.exception("leading failed; stepping down", extra={"lease": self.key})

    # --- on the renewal thread ---------------------------------------------------------

    async def _renewing(self, thread: _LeaseThread,
                        service_loop: asyncio.AbstractEventLoop) -> None:
        """Renew the tenure of the moment every ``lease_s / 3`` while the service's
        loop turns, until the thread closes. A renewal that finds the lease moved on, or
        fails in a way this module does not expect, ends the tenure at once."""
        assert thread.leases is not None
        due = self.clock()
        while True:
            # The service's loop shows it turns by running this as soon as it can: a
            # callback, where a task would wait a turn more.
            with contextlib.suppress(RuntimeError):  # the service's loop has closed
                service_loop.call_soon_threadsafe(self._turned)
            # Every period from the last send, not from the last reply: a slow reply does
            # not push the next renewal towards the deadline.
            due = max(due + self.lease_s * RENEW_EVERY, self.clock())
            await asyncio.sleep(due - self.clock())
            tenure = self._tenure
            if tenure is None or tenure.ended:
                continue
            sent = self.clock()
            silent = sent - self.loop_seen
            if silent > self.hung_s:
                if not tenure.hung:
                    log.warning("the service's loop has not turned for %.2f s (hung after "
                                "%.2f s): renewals stop", silent, self.hung_s,
                                extra={"lease": self.key, "epoch": tenure.epoch})
                tenure.hung = True
                continue
            tenure.hung = False
            why = None
            try:
                async with thread.writing:
                    if tenure.ended:
                        continue
                    await self._renew(thread.leases, tenure, sent)
            except Conflict:
                why = "the lease was taken over"
            except (PhalanxError, TimeoutError, OSError) as exc:
                log.warning("lease renewal failed: %r", exc,
                            extra={"lease": self.key, "epoch": tenure.epoch})
            except Exception:  # not an outage this code knows: lead again from a fresh read
                log.exception("lease renewal failed unexpectedly",
                              extra={"lease": self.key, "epoch": tenure.epoch})
                why = "the renewal failed unexpectedly"
            if why is not None:
                with contextlib.suppress(RuntimeError):  # the service's loop has closed
                    service_loop.call_soon_threadsafe(self._end, tenure, why)

    async def _renew(self, leases: TypedKV[Lease], tenure: Tenure, sent: float) -> None:
        lease = Lease(holder=self.holder, epoch=tenure.epoch,
                      expires_at=time.time() + self.lease_s)
        # Not past the moment this leader stops acting: an outage is not waited out.
        async with asyncio.timeout(max(0.0, acts_until(tenure.renewed_at, self.lease_s)
                                       - sent)):
            tenure.revision = await leases.update(self.key, lease, tenure.revision)
        tenure.renewed_at = sent

    async def _release(self, thread: _LeaseThread, tenure: Tenure) -> None:
        """Delete the lease at the revision this tenure last wrote (after any renewal in
        flight)."""
        assert thread.leases is not None
        async with thread.writing:
            await thread.leases.delete(self.key, revision=tenure.revision)

    # --- on the service's loop ----------------------------------------------------------

    def _turned(self) -> None:
        self.loop_seen = self.clock()

    def _arm(self) -> None:
        """Set the timer that ends this term at :attr:`acts_until`."""
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, self.acts_until - self.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        tenure = self._tenure
        if tenure is None:
            return
        if not deposed(tenure.renewed_at, self.lease_s, self.clock()):
            self._arm()  # a renewal moved the deadline
            return
        unconfirmed = self.clock() - tenure.renewed_at
        log.warning("deposed: no renewal confirmed for %.2f s (a leader acts %.2f s after "
                    "its last, lease_s %g); stopping", unconfirmed,
                    self.lease_s * ACTS_FOR, self.lease_s,
                    extra={"lease": self.key, "epoch": tenure.epoch,
                           "unconfirmed_s": round(unconfirmed, 3)})
        self.deposals += 1
        self._end(tenure, None)

    def _end(self, tenure: Tenure, why: str | None) -> None:
        """Stop acting now (synchronously: the work is cancelled before anything else
        runs); :meth:`step_down` reaps it later. The lease is left to run out."""
        if self._tenure is not tenure:
            return
        if why is not None:
            log.warning("stepping down: %s", why, extra={"lease": self.key})
        tenure.ended = True
        self._tenure = None
        self._gauge.set(0)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()

    async def step_down(self, *, release: bool) -> None:
        """Stop leading (idempotent): cancel the work, then optionally release the lease."""
        tenure, self._tenure = self._tenure, None
        task, self._task = self._task, None
        if tenure is not None:
            tenure.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._gauge.set(0)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if tenure is None:
            return
        if release and self._thread is not None:
            try:
                await self._thread.call(self._release(self._thread, tenure))
            except Exception as exc:  # it runs out by itself: a standby waits lease_s longer
                log.warning("could not release the lease: %s", exc, extra={"lease": self.key})
        log.info("stepped down", extra={"lease": self.key})
