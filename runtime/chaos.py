"""Fault injection inside a rank: ``PHALANX_CHAOS_KILL=<replica>:<step>:<phase>[,...]``.

The named replica SIGKILLs itself at that step, either at the step's
``boundary`` (before it starts) or during its gradient ``allreduce`` (5 ms
after the first bucket is launched, so the collective is in flight). It
writes a ``chaos`` line to its record first, so a test knows the death was
injected. Other replicas ignore the entries that do not name them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from phalanx.schemas.errors import ConfigError

PHASES = ("boundary", "allreduce")


def parse_chaos_kill(value: str, replica_id: str) -> tuple[int, str] | None:
    """``(step, phase)`` at which ``replica_id`` dies, or None.

    Raises:
        ConfigError: an entry is not ``<replica>:<step>:<boundary|allreduce>``.
    """
    kill = None
    for item in filter(None, value.split(",")):
        target, _, rest = item.partition(":")
        step, _, phase = rest.partition(":")
        if not step.isdigit() or phase not in PHASES:
            raise ConfigError(f"PHALANX_CHAOS_KILL: {item!r} is not "
                              "<replica>:<step>:<boundary|allreduce>")
        if target == replica_id:
            kill = (int(step), phase)
    return kill


def die(before: Callable[[], None] | None = None) -> None:
    """Die now, as a SIGKILLed rank does (``before`` runs first: the record line)."""
    if before is not None:
        before()
    os.kill(os.getpid(), signal.SIGKILL)
