"""How many warm spares a node keeps for each job, and how their restarts back off."""

from __future__ import annotations

import pytest

from phalanx.services.agent.core import (
    SPARE_BACKOFF_MAX_S,
    slots_on_gpus,
    spare_counts,
    spare_restart_delay,
)


@pytest.mark.parametrize(("capacity", "placed", "jobs", "expected"), [
    # A free slot holds the one spare asked for; none left, none kept.
    (3, 2, [("a", 1, 1)], {"a": 1}),
    (2, 2, [("a", 1, 1)], {"a": 0}),
    # More asked than free: as many as fit, a job's replica size counted.
    (6, 2, [("a", 3, 1)], {"a": 3}),
    (6, 2, [("a", 3, 2)], {"a": 2}),
    # Free slots go to the jobs in order: the first takes what it asks, the next the rest.
    (5, 3, [("a", 1, 1), ("b", 1, 1)], {"a": 1, "b": 1}),
    (4, 3, [("a", 1, 1), ("b", 1, 1)], {"a": 1, "b": 0}),
    # Nothing asked: nothing kept; placed beyond capacity is no negative.
    (4, 1, [("a", 0, 1)], {"a": 0}),
    (2, 3, [("a", 1, 1)], {"a": 0}),
    # Unbounded node: what each job asks.
    (None, 8, [("a", 2, 1), ("b", 1, 4)], {"a": 2, "b": 1}),
])
def test_spare_counts(capacity: int | None, placed: int, jobs: list[tuple[str, int, int]],
                      expected: dict[str, int]) -> None:
    assert spare_counts(capacity, placed, jobs) == expected


@pytest.mark.parametrize(("gpus", "unusable", "wanted", "expected"), [
    # CPU slots: a spare has no GPUs, and any free slots do.
    ((), set(), (), ()),
    # The spare's GPU, on its lowest usable slot; one slot per GPU or several.
    ((0, 1, 2, 3), {0}, (2,), (2,)),
    ((0, 0, 1, 1), {0}, (0,), (1,)),
    # Its GPUs in its order (the process sees them as cuda:0, cuda:1).
    ((0, 1, 2, 3), set(), (3, 1), (3, 1)),
    # A spare of two slots on one GPU that two slots share.
    ((5, 5, 6), set(), (5, 5), (0, 1)),
    # Its GPU taken by a rank, or cordoned: nowhere to run it.
    ((0, 1, 2, 3), {2}, (2,), None),
    ((0, 0, 1), {0, 1}, (0,), None),
    ((0, 1), set(), (0, 0), None),
])
def test_slots_on_gpus(gpus: tuple[int, ...], unusable: set[int], wanted: tuple[int, ...],
                       expected: tuple[int, ...] | None) -> None:
    assert slots_on_gpus(gpus, unusable, wanted) == expected


def test_a_spare_that_died_once_comes_back_at_once_then_restarts_back_off() -> None:
    delays = [spare_restart_delay(n) for n in range(1, 10)]
    assert delays[:4] == [0.0, 1.0, 2.0, 4.0]
    assert delays == sorted(delays) and delays[-1] == SPARE_BACKOFF_MAX_S
