"""Leader leases: of the instances of a service, at most one acts at a time.

A lease is a :class:`~phalanx.schemas.messages.Lease` record under the
service's key in the ``phalanx_leases`` bucket. An instance takes it when it is
absent, expired, or already its own (compare-and-swap: of two instances trying
at once, one wins), renews it every ``lease_s / 3`` at the revision it last
wrote, and releases it on a clean stop (a delete conditional on that revision),
so a standby takes over within ``lease_s`` of a crash and at once after a stop.

A renewal that finds the lease moved on means another instance leads: the
leader's work is cancelled at once. A renewal that fails for want of a bus (an
outage) keeps leading until the lease would have expired by this instance's own
clock, and no longer: another instance may take over only after it expired by
*its* clock, so the two never act at once as long as clocks agree far better
than ``lease_s`` (NTP does). Whatever a leader writes that others must not
overwrite after a takeover is compare-and-swapped on its own revision as well
(fencing), so even a leader that has not yet noticed its loss cannot clobber
its successor.

Each instance shows whether it leads as ``phalanx_leader{service=<key>}`` (1 or 0) on
its metrics page, so "no leader" is ``max by (service) (phalanx_leader) < 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
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


def may_take(current: Lease | None, holder: str, now: float) -> bool:
    """Whether ``holder`` may take the lease at ``now``: absent, expired or its own."""
    return current is None or current.expires_at <= now or current.holder == holder


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

    ``lead`` is started when the lease is taken and cancelled when it is lost; if it
    returns or raises, the lease is released so that another instance (or this one,
    at the next attempt) starts afresh.

    Args:
        leases: the lease bucket.
        key: the service's key in it.
        holder: this instance's name (a subject token).
        lease_s: how long a lease lasts without renewal.
        lead: the leader's work.
    """

    def __init__(self, leases: TypedKV[Lease], key: str, holder: str, lease_s: float,
                 lead: Callable[[], Awaitable[None]]) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.leases = leases
        self.key = key
        self.holder = holder
        self.lease_s = lease_s
        self.lead = lead
        self.revision: int | None = None  # of our lease while we lead
        self.expires_at = 0.0
        self.epoch = 0
        self._task: asyncio.Task[None] | None = None
        self._gauge = metrics.LEADER.labels(key)
        self._gauge.set(0)

    @property
    def leading(self) -> bool:
        return self.revision is not None

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
            if self.revision is not None and time.time() >= self.expires_at:
                await self.step_down(release=False)
        if self._task is not None and self._task.done():
            await self.step_down(release=True)  # the work ended: let the next term start clean

    async def _try_take(self) -> None:
        now = time.time()
        # An undecodable lease counts as absent: it is replaced at its revision.
        current, revision = await self.leases.current(self.key)
        if not may_take(current, self.holder, now):
            return
        epoch = current.epoch + 1 if current else 1
        lease = Lease(holder=self.holder, epoch=epoch, expires_at=now + self.lease_s)
        try:
            revision = (await self.leases.update(self.key, lease, revision) if revision
                        else await self.leases.create(self.key, lease))
        except Conflict:
            return  # another instance was quicker
        self.revision, self.expires_at, self.epoch = revision, lease.expires_at, epoch
        self._gauge.set(1)
        log.info("leading", extra={"lease": self.key, "epoch": epoch})
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
        assert self.revision is not None
        now = time.time()
        lease = Lease(holder=self.holder, epoch=self.epoch, expires_at=now + self.lease_s)
        try:
            self.revision = await self.leases.update(self.key, lease, self.revision)
        except Conflict:
            raise LeadershipLost("the lease was taken over") from None
        self.expires_at = lease.expires_at

    async def step_down(self, *, release: bool) -> None:
        """Stop leading (idempotent): cancel the work, then optionally release the lease."""
        revision, self.revision = self.revision, None
        task, self._task = self._task, None
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
            except (PhalanxError, TimeoutError, OSError) as exc:
                log.warning("could not release the lease: %s", exc, extra={"lease": self.key})
        log.info("stepped down", extra={"lease": self.key})
