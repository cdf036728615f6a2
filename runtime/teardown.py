"""Leaving a process that trained over gloo: the exit skips gloo's teardown.

A rank must not tear its process groups down at exit. A group *abandoned*
after a fault may still have a work item blocked on the dead peer until
gloo's timeout, its thread running while the process exits; once the peers
have gone, gloo's destructors throw on their closed pairs. Either ends a rank
that completed its training with SIGABRT or SIGSEGV. Keeping the groups alive
is not enough: we tried leaking one reference to each group, work item and
store so that no destructor runs, and in the e2e tests a survivor that was
not a neighbour of the killed rank (its abandoned all-reduce still blocked)
died of SIGSEGV in the C++ teardown at exit.

Alone, a sharded model's session trains in the script's own group of several ranks
(``torchrun --nproc-per-node S``), and the same teardown ended about one run in 40
with SIGABRT ("terminate called without an active exception") after the script had
saved its model and destroyed its group.

So once a session that trained over gloo is closed (:func:`arm`), the
interpreter's exit ends with ``os._exit`` from an ``atexit`` handler that
this module registers when it is imported (with ``phalanx.runtime``'s
session), i.e. before the script registers its own: ``atexit`` runs handlers
last-registered first, so **every handler the script (or a library it
imports later) registers runs**, then output is flushed and the process ends
without C++ teardown. Handlers registered before ``phalanx.runtime`` was
imported are skipped.

The exit status is the one Python would give when the runtime can know it:
an exception or ``sys.exit(n)`` that leaves ``with session:`` (the session's
``__exit__`` records it), an uncaught exception (1), otherwise 0; except for the
runtime's exceptions that are the job's doing, not the script's, armed or not (their
``exit_status``): a ``StateLost`` a later generation may recover from,
:data:`~phalanx.schemas.environment.EXIT_STATE_LOST` (75), and ``Dropped``, a rank
fenced out of its job, :data:`~phalanx.schemas.environment.EXIT_DROPPED` (76); health
counts both as infrastructure failures. A
``sys.exit(n)`` *after* the session is closed, outside its ``with`` block,
cannot be seen from an ``atexit`` handler and exits 0: end the script inside
the block, or raise before closing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import Any

from phalanx.schemas.environment import EXIT_STATUS_DIR

_armed = False
_status: int | None = None  # known from the session's __exit__, if it saw one
_uncaught = False
_infrastructure: int | None = None  # the uncaught exception's exit_status, if it has one
_watching = False


def arm() -> None:
    """The process trained over gloo: at exit, skip its teardown (idempotent)."""
    global _armed
    _armed = True
    watch()


def watch() -> None:
    """Note an uncaught exception from now on (idempotent): a session the script leaves
    open is closed at exit, after the exception was reported (:func:`failed`)."""
    global _watching
    if _watching:
        return
    _watching = True
    previous_hook = sys.excepthook

    def remember(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        global _uncaught, _infrastructure
        _uncaught = True
        _infrastructure = infrastructure_status(value)
        previous_hook(kind, value, tb)

    sys.excepthook = remember


def exit_status(exc: BaseException | None) -> None:
    """Record the status an exception leaving the session means (None: no exception)."""
    global _status
    if isinstance(exc, SystemExit):
        code = exc.code
        _status = 0 if code is None else code if isinstance(code, int) else 1
    elif exc is not None and (status := infrastructure_status(exc)) is not None:
        _status = status
    elif exc is not None:
        _status = 1


def infrastructure_status(exc: BaseException) -> int | None:
    """The exit status of a runtime exception that is the job's doing, not the script's
    (``StateLost``, ``Dropped``: their ``exit_status``); None for any other."""
    status = getattr(exc, "exit_status", None)
    return status if isinstance(status, int) else None


def failed() -> bool:
    """Whether an uncaught exception is ending the process (seen once :func:`watch` ran)."""
    return _uncaught


def record_status(status: int) -> None:
    """Write ``status`` where the agent finds it should it not see this process end
    (:data:`~phalanx.schemas.environment.EXIT_STATUS_DIR`; nothing where that is unset).
    Best effort: a process that cannot write it is reported ``lost``, as before."""
    folder = os.environ.get(EXIT_STATUS_DIR)
    if not folder:
        return
    path = os.path.join(folder, str(os.getpid()))
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            f.write(f"{status}\n")
        os.replace(path + ".tmp", path)


def _leave() -> None:
    if not _armed and _infrastructure is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    status = _infrastructure if _infrastructure is not None else \
        1 if _uncaught else (_status or 0) & 0xFF
    record_status(status)
    os._exit(status)


atexit.register(_leave)
