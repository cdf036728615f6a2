"""A replica of several ranks (a group) under any order of its processes' ends.

However its processes end, the group is reported once with one of their ends: a clean
end only when every process exited 0, and a failure that came first is what is
reported; and its slots are split among its ranks without overlap or loss.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.services.agent.core import ProcessEnd, group_exit, group_slots, siblings_wait_s

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)

END = st.one_of(
    st.builds(ProcessEnd, st.integers(0, 7), st.sampled_from([0, 0, 0, 1, 3]), st.none()),
    st.builds(ProcessEnd, st.integers(0, 7), st.none(),
              st.sampled_from(["SIGKILL", "SIGTERM", "SIGSEGV"])),
    st.builds(ProcessEnd, st.integers(0, 7), st.none(), st.none(), st.just(False)))


@SETTINGS
@given(ends=st.lists(END, min_size=1, max_size=8), grace_s=st.floats(0.1, 60))
def test_a_group_ends_clean_only_when_every_process_did(ends: list[ProcessEnd],
                                                       grace_s: float) -> None:
    reported = group_exit(ends)
    assert reported in ends
    assert reported.clean == all(end.clean for end in ends)
    if not ends[0].clean:
        assert reported == ends[0]  # the first failure is the group's
        assert siblings_wait_s(ends[0], grace_s) == 0.0  # and the rest are stopped at once
    else:
        assert siblings_wait_s(ends[0], grace_s) == grace_s


@SETTINGS
@given(ranks=st.integers(1, 8), per_rank=st.integers(1, 4),
       slots=st.sets(st.integers(0, 63), min_size=32, max_size=32))
def test_a_groups_ranks_share_its_slots_in_order(ranks: int, per_rank: int,
                                                 slots: set[int]) -> None:
    held = tuple(sorted(slots))[:ranks * per_rank]
    shares = group_slots(held, ranks)
    assert len(shares) == ranks and all(len(share) == per_rank for share in shares)
    assert tuple(s for share in shares for s in share) == held
