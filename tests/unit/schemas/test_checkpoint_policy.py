"""The job spec's checkpoint section as submitted: the memory interval is auto, a fixed
number or 0, its budget and ceiling are bounded, and a durable interval fits it."""

from __future__ import annotations

import msgspec
import pytest

from phalanx.schemas.messages import CheckpointPolicy


def decode(doc: dict) -> CheckpointPolicy:
    return msgspec.json.decode(msgspec.json.encode(doc), type=CheckpointPolicy)


def test_the_default_adapts_the_memory_interval_to_2_percent_at_most_every_100_steps() -> None:
    policy = decode({})
    assert (policy.memory_every_steps, policy.memory_overhead,
            policy.memory_max_every_steps) == ("auto", 0.02, 100)


@pytest.mark.parametrize("every", ["auto", 0, 1, 50])
def test_auto_a_fixed_interval_or_never(every: str | int) -> None:
    assert decode({"memory_every_steps": every}).memory_every_steps == every


@pytest.mark.parametrize("doc", [{"memory_every_steps": "adaptive"},
                                 {"memory_every_steps": -1},
                                 {"memory_overhead": 0.0}, {"memory_overhead": 0.75},
                                 {"memory_max_every_steps": 0}])
def test_out_of_range_is_refused_at_submit(doc: dict) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(doc)


def test_any_durable_interval_under_auto_a_multiple_of_a_fixed_one() -> None:
    assert decode({"durable_every_steps": 7}).durable_every_steps == 7  # always snapshotted
    assert decode({"memory_every_steps": 5, "durable_every_steps": 10}).durable_every_steps \
        == 10
    for every in (0, 3):
        with pytest.raises(msgspec.ValidationError, match="multiple"):
            decode({"memory_every_steps": every, "durable_every_steps": 10})
