"""A replacement replica starts at low CPU priority and trains at normal priority.

A replacement imports torch, builds its model and warms up while the
survivors train on the same machine. On a node whose cores the survivors
already use, that start-up takes their CPU: on the reference 2-core machine
it slowed their steps by 60-90 % for the five seconds it lasted. So the agent
starts a replacement with a raised nice value (:func:`lower`) and tells it, in
:data:`~phalanx.schemas.environment.NICE_WHEN_READY`, the value to return to
once it is ready (:func:`phalanx.runtime.priority.restore`), before it joins
and its steps count.

Linux keeps a nice value per thread and lowering it again (raising the
priority) needs ``CAP_SYS_NICE`` or a high enough ``RLIMIT_NICE``. The agent
only lowers the priority when the replica will be allowed to raise it back
(:func:`can_restore`): a replica left at nice 19 would be a straggler.
"""

from __future__ import annotations

import os
import resource

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
