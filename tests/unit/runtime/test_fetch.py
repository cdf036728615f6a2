"""Which shards a member fetches before a restore: those no member's node holds, split
round robin over the members, each with its holders nearest first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from phalanx.runtime.fetch import plan_fetches
from phalanx.schemas.messages import ResumeAnswer


def answer(held_by: list[list[str]]) -> ResumeAnswer:
    return ResumeAnswer(job_id="j", step=20, shards=len(held_by), held_by=held_by)


def test_only_shards_no_members_node_holds_are_fetched_split_over_the_members() -> None:
    held_by = [["a"], ["c", "b"], ["b"], ["a", "b"], ["d"], []]
    plans = [plan_fetches(answer(held_by), {"a"}, rank, 2) for rank in range(2)]
    assert plans == [[(1, ["c", "b"]), (4, ["d"])], [(2, ["b"])]]


@given(st.lists(st.lists(st.sampled_from("abcde"), unique=True), max_size=12),
       st.sets(st.sampled_from("abcde")), st.integers(1, 5))
def test_every_missing_shard_is_fetched_by_exactly_one_member(held_by, members, size) -> None:
    plans = [plan_fetches(answer(held_by), members, rank, size) for rank in range(size)]
    fetched = sorted(shard for plan in plans for shard, _ in plan)
    assert fetched == [shard for shard, holders in enumerate(held_by)
                       if holders and not members.intersection(holders)]
    assert max(map(len, plans)) - min(map(len, plans)) <= 1  # shared evenly
    assert all(holders == held_by[shard] for plan in plans for shard, holders in plan)
