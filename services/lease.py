"""Leader leases: of the instances of a service, at most one acts at a time.

A lease is a :class:`~phalanx.schemas.messages.Lease` record under the
service's key in the ``phalanx_leases`` bucket. An instance takes it when it is
absent, left unrenewed (below), or already its own (compare-and-swap: of two
instances trying at once, one wins), renews it every ``lease_s / 3`` at the
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
import time
from collections.abc import Awaitable, Callable

from phalanx.bus.errors import Conflict
from phalanx.bus.kv import TypedKV
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import Lease
from phalanx.services import metrics

log = logging.getLogger("phalanx.lease")


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


class Leadership:
    """Holds ``key``'s lease for ``holder`` and runs ``lead()`` exactly while holding it.

    ``lead`` is started when the lease is taken and cancelled when it is lost, or when
    the lease could not be confirmed in time (:func:`acts_until`); if it returns or
    raises, the lease is released so that another instance (or this one, at the next
    attempt) starts afresh.

    Args:
        leases: the lease bucket.
        key: the service's key in it.
        holder: this instance's name (a subject token).
        lease_s: how long a lease lasts without renewal.
        lead: the leader's work.
        clock: this instance's monotonic clock (tests give their own).
    """

    def __init__(self, leases: TypedKV[Lease], key: str, holder: str, lease_s: float,
                 lead: Callable[[], Awaitable[None]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.leases = leases
        self.key = key
        self.holder = holder
        self.lease_s = lease_s
        self.lead = lead
        self.clock = clock
        self.revision: int | None = None  # of our lease while we lead
        self.renewed_at = 0.0  # monotonic: when our last confirmed renewal was sent
        self.sighting: Sighting | None = None  # another's lease, while we stand by
        self.epoch = 0
        #: Terms ended because the lease could not be confirmed in time.
        self.deposals = 0
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._gauge = metrics.LEADER.labels(key)
        self._gauge.set(0)

    @property
    def leading(self) -> bool:
        return self.revision is not None

    @property
    def acts_until(self) -> float:
        """When this leader stops acting unless a renewal is confirmed first."""
        return acts_until(self.renewed_at, self.lease_s)

    async def run(self, sleep_or_stop: Callable[[float], Awaitable[bool]]) -> None:
        """Try to lead or renew every ``lease_s / 3`` until ``sleep_or_stop`` says stop;
        then release the lease."""
        try:
            while True:
                await self._check()
                if await sleep_or_stop(self.lease_s / 3):
                    break
        finally:
            await self.step_down(release=True)

    async def _check(self) -> None:
        try:
            if self.revision is None:
                await self._try_take()
            else:
                await self._renew()
        except LeadershipLost as exc:
            log.warning("stepping down: %s", exc, extra={"lease": self.key})
            await self.step_down(release=False)
        except (PhalanxError, TimeoutError, OSError) as exc:
            log.warning("lease check failed: %s", exc, extra={"lease": self.key})
            if self.revision is not None and deposed(self.renewed_at, self.lease_s,
                                                     self.clock()):
                self._depose()
        except Exception:  # not an outage this code knows: lead again from a fresh read
            log.exception("lease check failed unexpectedly; stepping down",
                          extra={"lease": self.key})
            await self.step_down(release=False)
        if self.revision is None and self._task is not None:
            await self.step_down(release=False)  # deposed: reap the cancelled work
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
        if deposed(now, self.lease_s, self.clock()):
            return  # confirmed too late to act on: the next check reads it afresh
        self.revision, self.renewed_at, self.epoch = revision, now, epoch
        self.sighting = None
        self._gauge.set(1)
        log.info("leading", extra={"lease": self.key, "epoch": epoch})
        self._arm()
        self._task = asyncio.create_task(self._lead(), name=f"lead {self.key}")

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

    async def _renew(self) -> None:
        held = self.revision
        assert held is not None
        sent = self.clock()
        lease = Lease(holder=self.holder, epoch=self.epoch,
                      expires_at=time.time() + self.lease_s)
        try:
            # Not past the moment this leader stops acting: an outage is not waited out.
            async with asyncio.timeout(max(0.0, self.acts_until - sent)):
                revision = await self.leases.update(self.key, lease, held)
        except Conflict:
            raise LeadershipLost("the lease was taken over") from None
        if self.revision != held:
            return  # deposed meanwhile: the next check reads the lease afresh
        self.revision, self.renewed_at = revision, sent
        self._arm()

    def _arm(self) -> None:
        """Set the timer that ends this term at :attr:`acts_until`."""
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, self.acts_until - self.clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.revision is None:
            return
        if not deposed(self.renewed_at, self.lease_s, self.clock()):
            self._arm()  # a renewal moved the deadline (an injected clock lags the loop's)
            return
        self._depose()

    def _depose(self) -> None:
        """Stop acting now (synchronously: the work is cancelled before anything else
        runs); :meth:`step_down` reaps it later. The lease is left to run out."""
        if self.revision is None:
            return
        unconfirmed = self.clock() - self.renewed_at
        log.warning("deposed: no renewal confirmed for %.2f s (a leader acts %.2f s after "
                    "its last, lease_s %g); stopping", unconfirmed,
                    self.lease_s * ACTS_FOR, self.lease_s,
                    extra={"lease": self.key, "epoch": self.epoch,
                           "unconfirmed_s": round(unconfirmed, 3)})
        self.revision = None
        self.deposals += 1
        self._gauge.set(0)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()

    async def step_down(self, *, release: bool) -> None:
        """Stop leading (idempotent): cancel the work, then optionally release the lease."""
        revision, self.revision = self.revision, None
        task, self._task = self._task, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._gauge.set(0)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if revision is None:
            return
        if release:
            try:
                await self.leases.delete(self.key, revision=revision)
            except Exception as exc:  # it runs out by itself: a standby waits lease_s longer
                log.warning("could not release the lease: %s", exc, extra={"lease": self.key})
        log.info("stepped down", extra={"lease": self.key})
