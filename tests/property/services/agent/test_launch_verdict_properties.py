"""A slot's launches under any order of repeated, late and reordered launch requests.

Elasticity sends launch requests at least once (again after it restarts) and they
may arrive late or out of order; the agent answers each from the replica last
launched in the slot. Whatever the order, every replica starts at most once and the
incarnations started in a slot only grow.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.replicas import replica_id
from phalanx.services.agent.core import LaunchVerdict, launch_verdict

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)


@SETTINGS
@given(requests=st.lists(st.integers(0, 6), max_size=30))
def test_each_replica_starts_once_and_incarnations_only_grow(requests: list[int]) -> None:
    last: str | None = None
    started: list[int] = []
    for n in requests:
        newest = max(started, default=-1)
        verdict = launch_verdict(last, replica_id(2, n))
        assert (verdict is LaunchVerdict.LAUNCH) == (n > newest)
        assert (verdict is LaunchVerdict.ALREADY_LAUNCHED) == (n == newest)
        if verdict is LaunchVerdict.LAUNCH:
            started.append(n)
            last = replica_id(2, n)
    assert started == sorted(set(started))
