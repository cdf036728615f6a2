"""A node following any sequence of one job's records, with its ranks exiting at any
moment between them.

Whatever the records and exits: once a pass's decisions are carried out, the slots the
record places here are those launched here, each running a rank unless that rank exited
by itself (a record never starts it again: elasticity replaces it, by a launch request);
every launch kept is for the record's placement (an elastic job's: for any), and a
second pass decides nothing.
"""

from __future__ import annotations

from agent_rules import carry_out, job_record
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import JobRecord, JobState
from phalanx.services.agent.core import Launch, reconcile

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)
ME = "n1"

records = st.one_of(
    st.lists(st.sampled_from([ME, "n2", "n3"]), min_size=1, max_size=4).map(
        lambda nodes: job_record(*nodes)),
    st.sampled_from([JobState.PENDING, JobState.CANCELLED]).map(
        lambda state: job_record(state=state)))


@SETTINGS
@given(elastic=st.booleans(),
       steps=st.lists(st.tuples(records, st.sets(st.integers(0, 3))), max_size=12))
def test_the_node_runs_exactly_what_the_record_places_here(
        elastic: bool, steps: list[tuple[JobRecord, set[int]]]) -> None:
    running: dict[int, Launch] = {}
    launched: dict[int, Launch] = {}
    exited: dict[int, Launch] = {}  # slot -> the launch there that ended by itself
    for record, exits in steps:
        elastic_now = elastic and record.state is JobState.ADMITTED  # as the service asks
        carry_out(reconcile(record, ME, running, launched, elastic=elastic_now),
                  running, launched)
        here = {slot for slot, node in record.placement().items() if node == ME}
        assert set(launched) == here
        # A slot without a rank is one whose rank exited, and nothing else was launched.
        assert {s: launched[s] for s in here - set(running)}.items() <= exited.items()
        if not elastic_now:
            assert {launch.placement for launch in launched.values()} <= {tuple(record.nodes)}
        assert reconcile(record, ME, running, launched, elastic=elastic_now) == []
        for slot in exits & set(running):  # ranks that end by themselves
            exited[slot] = running.pop(slot)
        assert reconcile(record, ME, running, launched, elastic=elastic_now) == []
