"""A job spec's ``backend``: auto by default, one of auto | nccl | gloo, anything else
refused naming the field and the value."""

from __future__ import annotations

import pytest

from phalanx.schemas.messages import CollectiveBackend
from phalanx.services.client import SpecError, parse_job_spec

SPEC = {"name": "gpt", "team": "t", "priority_class": "normal",
        "replicas": {"min": 1, "max": 4}, "command": ["python", "train.py"]}


def test_the_backend_is_auto_unless_the_spec_names_one() -> None:
    assert parse_job_spec(SPEC).backend is CollectiveBackend.AUTO
    for name in ("auto", "nccl", "gloo"):
        assert parse_job_spec({**SPEC, "backend": name}).backend.value == name


@pytest.mark.parametrize(("value", "problem"), [
    ("mpi", "Invalid enum value 'mpi'"),
    ("NCCL", "Invalid enum value 'NCCL'"),
    (3, "Expected `str`, got `int`"),
])
def test_another_backend_is_refused_naming_field_value_and_choices(value: object,
                                                                    problem: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_job_spec({**SPEC, "backend": value})
    assert str(refused.value) == (f"job spec: {problem} (one of auto, nccl, gloo) "
                                  "- at `$.backend`")
