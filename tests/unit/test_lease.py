"""Lease rules that need no bus: who may take a lease, and what counts as being fenced out."""

from __future__ import annotations

from phalanx.schemas.messages import Lease
from phalanx.services.lease import (
    ACTS_FOR,
    LeadershipLost,
    Sighting,
    acts_until,
    deposed,
    fenced_out,
    may_take,
    sighted,
)


def test_may_take_absent_own_or_watched_unrenewed_for_a_lease() -> None:
    lease = Lease(holder="a", epoch=3, expires_at=100.0)
    assert may_take(None, "b", None, 0, 3.0, 50.0)
    assert may_take(lease, "a", None, 7, 3.0, 50.0)
    assert not may_take(lease, "b", None, 7, 3.0, 50.0)  # never watched: however stale
    watched = Sighting(7, 50.0)
    assert not may_take(lease, "b", watched, 7, 3.0, 52.9)
    assert may_take(lease, "b", watched, 7, 3.0, 53.0)
    assert not may_take(lease, "b", watched, 8, 3.0, 60.0)  # renewed since


def test_a_standby_judges_by_its_own_clock_whatever_the_holder_stamped() -> None:
    """Renewed every second, stamped an hour behind or ahead: never taken; unrenewed
    for a lease's length of watching: taken, whatever the stamp says."""
    for stamp in (100.0 - 3600.0, 100.0 + 3600.0):
        lease = Lease(holder="a", epoch=1, expires_at=stamp)
        seen = None
        for revision, now in enumerate(range(100, 110), start=1):
            seen = sighted(seen, revision, float(now))
            assert not may_take(lease, "b", seen, revision, 3.0, float(now))
        for now in (110.0, 111.0):
            seen = sighted(seen, 10, now)
            assert not may_take(lease, "b", seen, 10, 3.0, now)
        assert seen == Sighting(10, 109.0)
        assert may_take(lease, "b", sighted(seen, 10, 112.0), 10, 3.0, 112.0)


def test_fenced_out_finds_the_loss_inside_task_groups() -> None:
    lost = LeadershipLost("the ledger was written by another instance")
    assert fenced_out(lost) is lost
    assert fenced_out(ExceptionGroup("tasks", [lost])) is lost
    assert fenced_out(ExceptionGroup("outer", [ExceptionGroup("inner", [lost])])) is lost


def test_fenced_out_is_none_when_anything_else_failed() -> None:
    lost = LeadershipLost("taken over")
    assert fenced_out(RuntimeError("bug")) is None
    assert fenced_out(ExceptionGroup("tasks", [lost, ValueError("bug")])) is None


def test_a_leader_acts_until_two_thirds_of_a_lease_after_its_last_confirmed_renewal() -> None:
    """Sent at 100 with a 3 s lease: acting until 102, a standby taking no sooner than 103
    by the same clock (a third of a lease of margin)."""
    assert acts_until(100.0, 3.0) == 102.0
    assert not deposed(100.0, 3.0, 101.99)
    assert deposed(100.0, 3.0, 102.0)
    assert acts_until(100.0, 3.0) + 3.0 * (1 - ACTS_FOR) == 100.0 + 3.0
