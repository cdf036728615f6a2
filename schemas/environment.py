"""The environment a rank process starts with: variables its node agent sets and the
runtime inside the rank reads. Both sides name them from here, so neither imports the
other (services never import the runtime; the runtime never imports a service)."""

from __future__ import annotations

#: The nice value a replica started at low CPU priority returns to once it is ready.
NICE_WHEN_READY = "PHALANX_NICE_WHEN_READY"

#: Set (to the spare's id) on a warm spare: a process of a job's command that has no
#: replica identity yet and waits, in the session's ``from_env``, for the one its agent
#: writes to its standard input (one JSON object of variables, one line).
SPARE = "PHALANX_SPARE"

#: The job's admission a rank was started for (``JobRecord.admission``), which its events
#: carry so that elasticity tells them from an earlier admission's.
ADMISSION = "PHALANX_ADMISSION"
