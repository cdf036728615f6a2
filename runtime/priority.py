"""A replacement replica returns to normal CPU priority once it is ready.

Its agent started it at a raised nice value so that its start-up (importing
torch, building the model) does not take the survivors' CPU, and named the
value to return to in :data:`~phalanx.schemas.environment.NICE_WHEN_READY`
(:mod:`phalanx.services.agent.priority` says why and when). Linux keeps a nice
value per thread, so every thread of the process is set back.
"""

from __future__ import annotations

import logging
import os

from phalanx.schemas.environment import NICE_WHEN_READY as ENV

__all__ = ["ENV", "restore"]

log = logging.getLogger("phalanx.runtime.priority")


def restore(nice: int) -> int:
    """Set every thread of this process to ``nice``; returns how many were changed.

    A thread that ended meanwhile is skipped; a refusal (EPERM) is logged, not raised:
    the replica still trains, only more slowly.
    """
    changed = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                changed += 1
        except ProcessLookupError:
            continue
        except PermissionError:
            log.warning("cannot return thread %s to nice %d: no CAP_SYS_NICE", tid, nice)
    return changed
