"""Store → restore: a job's membership comes back as it was, from any point of a run.

The states are those of the phase walk (every phase, its own events); each is stored
and restored, in this version's layout and in the one before it (the live dataclass as
msgpack, which this version still reads). That a restored core then decides what one
that never stopped decides is test_elasticity_core_properties.py's.
"""

from __future__ import annotations

import msgspec
from hypothesis import given
from test_phase_properties import SETTINGS, ops, shapes, walk

from phalanx.services.elasticity import stored


@SETTINGS
@given(shapes, ops)
def test_a_membership_stored_and_restored_is_the_same_in_either_layout(shape, steps) -> None:
    for _, core, _ in walk(shape, steps):
        job = core.jobs.get("j")
        if job is None:
            break
        back = stored.restore(stored.snapshot(job))
        assert back == job
        assert back.phase is job.phase
        assert stored.restore(msgspec.msgpack.encode(job)) == job  # the layout before
        # Restored, it is a copy: changing it does not change the job it came from.
        back.launched["r9-9"] = 9
        assert "r9-9" not in job.launched
