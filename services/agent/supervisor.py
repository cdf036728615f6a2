"""Keep a node's agent running in place, so that its ranks outlive it in a container.

On a machine an agent that dies leaves its ranks running (each is its own
session): the init process reaps them when they end, and the agent started
again adopts them (:meth:`.ranks.RankSet.adopt`). In a container the agent
would be the first process: its death ends the container and every rank with
it, so the agent-restart recovery never happens there. ``phalanx agent
--supervised`` puts this supervisor first instead. It

* makes itself the reaper of every process below it (``PR_SET_CHILD_SUBREAPER``;
  as a container's first process it is one anyway), so a rank whose agent died
  is reparented to it and reaped when it ends, never left a zombie that would
  look alive to the next agent;
* starts the agent, and starts it again in place whenever it exits on its own
  (a crash, an OOM kill, a failed liveness probe's kill), backing off
  (:func:`next_delay`) while it keeps dying young;
* passes SIGTERM and SIGINT to the agent (which gives the ranks their jobs' grace
  period) and exits with the agent's status once it has exited.

It imports nothing of phalanx beyond this module: it is the container's
long-lived first process and must stay small.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from phalanx.schemas import settings

log = logging.getLogger("phalanx.agent.supervisor")

#: prctl(2) option: orphaned descendants are reparented to this process, not to init.
PR_SET_CHILD_SUBREAPER = 36
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
#: An agent that ran this long before it exited was not crash-looping: the next restart
#: waits only the first delay again.
STEADY_S = 60.0


def next_delay(delay_s: float, ran_s: float) -> float:
    """The wait before the agent's next start, after one that ran ``ran_s`` and was
    preceded by a wait of ``delay_s``: doubling while it dies young, reset once it ran
    :data:`STEADY_S`."""
    if ran_s >= STEADY_S:
        return FIRST_DELAY_S
    return min(MAX_DELAY_S, max(FIRST_DELAY_S, 2 * delay_s))


#: The listening socket a supervisor of ours hands its process to serve metrics on
#: (:mod:`phalanx.services.metrics`): the agent gets it, as it would unsupervised.
METRICS_FD_ENV = settings.METRICS_FD


def inherited_fds() -> tuple[int, ...]:
    """The descriptors the agent must inherit: the metrics socket, when one is named."""
    raw = os.environ.get(METRICS_FD_ENV, "")
    return (int(raw),) if raw.isdigit() else ()


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children; False where it cannot."""
    if os.getpid() == 1:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def exit_status(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


class Supervisor:
    """Runs ``command`` (the agent) until told to stop; see the module docstring."""

    def __init__(self, command: Sequence[str]) -> None:
        if not command:
            raise ValueError("the supervisor needs the agent's command")
        self.command = list(command)
        self.stopping = False
        self.agent: int | None = None

    def _forward(self, signum: int, _frame: object) -> None:
        self.stopping = True
        if self.agent is not None:
            with contextlib.suppress(ProcessLookupError):  # exiting: reaped next
                os.kill(self.agent, signum)

    def run(self) -> int:
        if not become_subreaper():
            log.warning("cannot become a child subreaper: ranks whose agent died are "
                        "reaped by init, not here")
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)
        delay = FIRST_DELAY_S
        while True:
            started = time.monotonic()
            self.agent = subprocess.Popen(self.command, pass_fds=inherited_fds(),
                                          env=agent_environment(os.environ)).pid
            log.info("agent started", extra={"pid": self.agent})
            status = self._reap_until(self.agent)
            self.agent = None
            code = exit_status(status)
            if self.stopping:
                return code
            ran = time.monotonic() - started
            delay = next_delay(delay, ran)
            log.warning("agent exited; starting it again in place",
                        extra={"status": code, "ran_s": round(ran, 1), "in_s": delay})
            if self._wait(delay):
                return code

    def _reap_until(self, pid: int) -> int:
        """Reap every child that ends (the agent, orphaned ranks) until ``pid`` has; its
        wait status."""
        while True:
            try:
                ended, status = os.waitpid(-1, 0)
            except ChildProcessError:  # no child at all: the agent is gone unseen
                return 0
            if ended == pid:
                return status

    def _wait(self, delay_s: float) -> bool:
        """Sleep ``delay_s``, reaping orphans meanwhile; True if told to stop."""
        until = time.monotonic() + delay_s
        while not self.stopping and time.monotonic() < until:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            time.sleep(min(0.1, max(0.0, until - time.monotonic())))
        return self.stopping


def agent_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without a zygote template: a zygote forked from one is the template's
    child, outside this tree, and the ranks it forked would be reparented, when their
    agent and its zygote die, to another reaper than this one."""
    return {k: v for k, v in env.items() if k != settings.AGENT("zygote_template")}


def supervise(command: Sequence[str]) -> int:
    """Run ``command`` under a :class:`Supervisor`; its exit status once stopped."""
    return Supervisor(command).run()


def agent_command(argv: Sequence[str]) -> list[str]:
    """The agent's own command line from ``phalanx agent --supervised ...``'s arguments
    (``argv``: everything after the program name): the same, without ``--supervised``."""
    return [sys.executable, "-m", "phalanx.services.cli",
            *[a for a in argv if a != "--supervised"]]
