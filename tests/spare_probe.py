"""Finding a job's warm spares as a user would: processes whose environment marks them.

The agent keeps no list of its spares on the bus; the tests of spares look at
the machine's processes (``/proc/<pid>/environ``), which is what must hold:
a spare running, replaced, or gone.
"""

from __future__ import annotations

import os
from pathlib import Path


def spares_of(job_id: str) -> set[int]:
    """The pids of the job's spares on this machine (from their environment)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PHALANX_JOB_ID={job_id}".encode() in environ \
                and any(v.startswith(b"PHALANX_SPARE=") for v in environ):
            found.add(int(entry))
    return found
