"""A job's stored membership: versioned, and what earlier versions stored still reads."""

from __future__ import annotations

import msgspec
import pytest
from test_elasticity_core import generations, ready

from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import GenerationReason
from phalanx.services.elasticity.core import ElasticityCore, Phase
from phalanx.services.elasticity.stored import VERSION, restore

MEMBER = {"replica_id": "r0-0", "slot": 0, "node_id": "n0", "endpoint": "h:9000"}
#: What the version before the stored type wrote (msgpack of the live dataclass, no
#: version field), taken from it: generation 1 dropped r2-0 and is in flight, and r2-1
#: is asked of a warm spare.
BEFORE = {
    "job_id": "j", "min_members": 2, "max_members": 3, "slots": {0: "n0", 1: "n1", 2: "n0"},
    "replacements_left": 3, "admission": 0,
    "current": {"type": "phalanx.generation.v1", "job_id": "j", "generation": 1,
                "members": [{"replica_id": "r0-0", "rank": 0, "node_id": "n0",
                             "endpoint": "h:9000"},
                            {"replica_id": "r1-0", "rank": 1, "node_id": "n1",
                             "endpoint": "h:9001"}],
                "world_size": 2, "rendezvous": "j-g1", "resume_step": 10, "reason": "fault",
                "cause": "dropped r2-0 (crash: exit code 1)"},
    "replacement_budget": 4,
    "replicas": {"r0-0": MEMBER, "r1-0": {**MEMBER, "replica_id": "r1-0", "slot": 1,
                                          "node_id": "n1", "endpoint": "h:9001"}},
    "launched": {"r2-1": 2}, "forming": [], "incarnation": {0: 0, 1: 0, 2: 1}, "applied": [],
    "committed": {"r0-0": 10, "r1-0": 10}, "failed": {}, "ready": [], "waiting_since": None,
    "complete": False,
    "to_launch": [{"job_id": "j", "slot": 2, "node_id": "n0", "replica_id": "r2-1",
                   "cause": "f1", "warm_only": True, "gang": False}],
    "high_water": 10, "managed": True, "early_faults": [], "leaving": [], "departing": [],
    "sizes": [],
    "history": [{"generation": 0, "reason": "start", "world_size": 3,
                 "members": ["r0-0", "r1-0", "r2-0"], "resume_step": 0, "decided_at": 1.0,
                 "cause": "admitted", "pause_s": 0.5, "applied_resume_step": None,
                 "restored_from": None},
                {"generation": 1, "reason": "fault", "world_size": 2,
                 "members": ["r0-0", "r1-0"], "resume_step": 10, "decided_at": 3.0,
                 "cause": "dropped r2-0 (crash: exit code 1)", "pause_s": None,
                 "applied_resume_step": None, "restored_from": None}],
    "warm_ready": [], "gather_since": None, "replaced": 1, "given_up": "", "session": False,
    "gang_round": 0,
}


def test_what_the_version_before_stored_restores_and_carries_on() -> None:
    core = ElasticityCore()
    assert core.restore(msgspec.msgpack.encode(BEFORE)) == "j"
    job = core.jobs["j"]
    assert job.phase is Phase.IN_FLIGHT and job.to_launch[0].warm_only
    # The spare asked for is ready while generation 1 is in flight: it joins at once.
    [g] = generations(ready(core, "r2-1", 4.0))
    assert (g.generation, g.reason) == (2, GenerationReason.JOIN)
    assert [m.replica_id for m in g.members] == ["r0-0", "r1-0", "r2-1"]
    core.check_invariants()


def test_another_version_is_refused_by_its_number() -> None:
    data = msgspec.msgpack.encode({**BEFORE, "version": VERSION + 1, "slots": "new"})
    with pytest.raises(StoredStateError, match=f"version {VERSION + 1}; this version reads"):
        restore(data)


def test_a_field_that_does_not_fit_is_named() -> None:
    with pytest.raises(StoredStateError, match=r"not an elasticity job snapshot: .*\$\.slots"):
        restore(msgspec.msgpack.encode({**BEFORE, "slots": "n0"}))
    with pytest.raises(StoredStateError, match="missing required field `job_id`"):
        restore(msgspec.msgpack.encode({"version": VERSION}))
