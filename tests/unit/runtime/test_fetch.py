"""Which shards a member fetches before a restore: those no member's node holds, split
round robin over the members, each with its holders nearest first; and how one shard's
holders are asked (:func:`~phalanx.runtime.fetch.fetch_shard`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from phalanx.bus.errors import NoResponders, RemoteError
from phalanx.runtime.fetch import fetch_shard, plan_fetches
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


class Holders:
    """Holders' agents as ``fetch_shard`` asks them, on a clock that ``pause`` moves:
    ``silent_until`` (down until then: no responders) or ``refuses`` (the copy is gone)."""

    def __init__(self, silent_until: dict[str, float],
                 refuses: frozenset[str] = frozenset()) -> None:
        self.silent_until, self.refuses = silent_until, refuses
        self.now = 0.0
        self.asked: list[tuple[str, float]] = []

    def ask(self, holder: str, left: float) -> int:
        self.asked.append((holder, self.now))
        if holder in self.refuses:
            raise RemoteError("404", f"{holder} holds no committed copy",
                              f"phalanx.agent.{holder}.fetch.j")
        if self.now < self.silent_until.get(holder, 0.0):
            raise NoResponders(f"no service listens on phalanx.agent.{holder}.fetch.j")
        return 1000

    def pause(self, seconds: float) -> None:
        self.now += seconds


def test_a_holder_whose_agent_is_down_is_asked_again_until_it_is_back() -> None:
    """The lost node's agent restarting for 5 s with its memory intact: the step is
    fetched once it is back, instead of the job training again from an older step."""
    holders = Holders({"a": 5.0})
    got, why = fetch_shard(holders.ask, ["a"], 24.0, lambda: holders.now, holders.pause)
    assert got == 1000
    assert holders.asked[-1] == ("a", 5.0) and len(holders.asked) == 11  # every 0.5 s
    assert why == ["from a: no service listens on phalanx.agent.a.fetch.j"]


def test_a_refusal_is_final_and_the_silent_holder_is_asked_until_the_deadline() -> None:
    holders = Holders({"b": 100.0}, refuses=frozenset({"a"}))
    got, why = fetch_shard(holders.ask, ["a", "b"], 2.0, lambda: holders.now, holders.pause)
    assert got is None
    assert [h for h, _ in holders.asked].count("a") == 1  # refused: never again
    assert why == ["from a: phalanx.agent.a.fetch.j answered error 404: a holds no "
                   "committed copy",
                   "from b: no service listens on phalanx.agent.b.fetch.j",
                   "no time left to fetch it"]


def test_the_first_holder_that_answers_sends_it() -> None:
    holders = Holders({"a": 100.0})
    got, why = fetch_shard(holders.ask, ["a", "b"], 24.0, lambda: holders.now, holders.pause)
    assert got == 1000 and holders.asked == [("a", 0.0), ("b", 0.0)]
    assert why == ["from a: no service listens on phalanx.agent.a.fetch.j"]
