"""A replacement replica starts at low CPU priority and trains at normal priority.

A replacement imports torch, builds its model and warms up while the
survivors train on the same machine. On a node whose cores the survivors
already use, that start-up takes their CPU: on the reference 2-core machine
it slowed their steps by 60-90 % for the five seconds it lasted. So the agent
starts a replacement with a raised nice value and tells it, in
``PHALANX_NICE_WHEN_READY``, the value to return to once it is ready
(:func:`restore`), before it joins and its steps count.

Linux keeps a nice value per thread and lowering it again (raising the
priority) needs ``CAP_SYS_NICE`` or a high enough ``RLIMIT_NICE``. The agent
only lowers the priority when the replica will be allowed to raise it back
(:func:`can_restore`): a replica left at nice 19 would be a straggler.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("phalanx.runtime.priority")

#: The environment variable naming the nice value a replica returns to when ready.
ENV = "PHALANX_NICE_WHEN_READY"
_CAP_SYS_NICE = 23


def _has_cap_sys_nice() -> bool:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except OSError:
        pass
    return False


def can_restore(nice: int) -> bool:
    """Whether a process of this user may lower its nice value back to ``nice``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    # RLIMIT_NICE allows nice values down to 20 - limit (RLIM_INFINITY: any).
    return _has_cap_sys_nice() or soft == resource.RLIM_INFINITY or 20 - soft <= nice


def current() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def lower(pid: int, nice: int) -> None:
    """Set process ``pid``'s nice value (its main thread's; threads it starts inherit it)."""
    os.setpriority(os.PRIO_PROCESS, pid, nice)


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
