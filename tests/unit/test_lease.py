"""Lease rules that need no bus: who may take a lease, and what counts as being fenced out."""

from __future__ import annotations

from phalanx.schemas.messages import Lease
from phalanx.services.lease import LeadershipLost, fenced_out, may_take


def test_may_take_absent_expired_or_own() -> None:
    lease = Lease(holder="a", epoch=3, expires_at=100.0)
    assert may_take(None, "b", 50.0)
    assert may_take(lease, "a", 50.0)
    assert not may_take(lease, "b", 99.9)
    assert may_take(lease, "b", 100.0)


def test_fenced_out_finds_the_loss_inside_task_groups() -> None:
    lost = LeadershipLost("the ledger was written by another instance")
    assert fenced_out(lost) is lost
    assert fenced_out(ExceptionGroup("tasks", [lost])) is lost
    assert fenced_out(ExceptionGroup("outer", [ExceptionGroup("inner", [lost])])) is lost


def test_fenced_out_is_none_when_anything_else_failed() -> None:
    lost = LeadershipLost("taken over")
    assert fenced_out(RuntimeError("bug")) is None
    assert fenced_out(ExceptionGroup("tasks", [lost, ValueError("bug")])) is None
