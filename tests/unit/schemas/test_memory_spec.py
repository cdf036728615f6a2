"""A job's ``memory_per_rank``: bytes or a number with a unit, at least 64 MiB, and an
error that says what is allowed."""

from __future__ import annotations

import msgspec
import pytest

from phalanx.schemas.messages import JobSpec


def spec(memory: object) -> JobSpec:
    raw = {"name": "m", "team": "t", "priority_class": "normal",
           "replicas": {"min": 1, "max": 1}, "command": ["python", "t.py"],
           "memory_per_rank": memory}
    return msgspec.json.decode(msgspec.json.encode(raw), type=JobSpec)


@pytest.mark.parametrize(("given", "limit"), [
    ("4Gi", 4 << 30), ("512Mi", 512 << 20), ("2G", 2 * 10**9), ("1.5Gi", 3 << 29),
    (1 << 30, 1 << 30), (None, None)])
def test_memory_per_rank_is_read_as_bytes(given: object, limit: int | None) -> None:
    assert spec(given).memory_limit == limit


@pytest.mark.parametrize(("given", "said"), [
    ("lots", "matching regex"), ("4gi", "matching regex"),
    ("1Mi", "at least 64 MiB"), (1000, ">= 67108864")])
def test_a_bad_memory_per_rank_says_what_is_allowed(given: object, said: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=said):
        spec(given)
