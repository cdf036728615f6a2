"""The environment a rank process starts with: variables its node agent sets and the
runtime inside the rank reads; and the one exit status the runtime gives a meaning.
Both sides name them from here, so neither imports the other (services never import
the runtime; the runtime never imports a service)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

#: The nice value a replica started at low CPU priority returns to once it is ready.
NICE_WHEN_READY = "PHALANX_NICE_WHEN_READY"

#: Set (to the spare's id) on a warm spare: a process of a job's command that has no
#: replica identity yet and waits, in the session's ``from_env``, for the one its agent
#: writes to its standard input (one JSON object of variables, one line).
SPARE = "PHALANX_SPARE"

#: The job's admission a rank was started for (``JobRecord.admission``), which its events
#: carry so that elasticity tells them from an earlier admission's.
ADMISSION = "PHALANX_ADMISSION"

#: The exit status of a rank that ended because its generation found the job's state
#: nowhere it could reach (``StateLost``): ``EX_TEMPFAIL``, a failure to retry. The
#: state may be reachable again later (a lost node's agent back with its memory), so
#: health counts it against the restart budget, which judges progress, not against the
#: application failures that end a job at the first few.
EXIT_STATE_LOST = 75

#: torchrun's variables for a process that is a world of its own: what a rank of a job that
#: runs a session starts with (a job that does not declare it in its spec gets the gang's
#: until it has a generation). A DDP script's own ``dist.init_process_group(...)`` then
#: makes a group of one at once, with a store on a free port, and never waits for a peer
#: that died or left; the session, which knows the membership, takes torch's default group
#: over (``phalanx.runtime.default_group``).
#: ``PHALANX_WORLD_OF_ONE`` marks them: ``dist.get_rank()`` asked before the session is 0 in
#: every replica, and the runtime says so (``phalanx.runtime.default_group``).
WORLD_OF_ONE_MARK = "PHALANX_WORLD_OF_ONE"
WORLD_OF_ONE: Mapping[str, str] = MappingProxyType({
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
    "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
    WORLD_OF_ONE_MARK: "1"})
