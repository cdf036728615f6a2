"""The text of a crash fault: what ended a rank, its error and its last output. Pure.

A crash fault's detail is what people read first (``phalanx top``, a generation's
cause), so its first line says what happened and, when the script failed by itself,
quotes its error; the rank's last output follows, cut at its start so that the whole
stays within :data:`~phalanx.schemas.messages.DETAIL_CHARS`.
"""

from __future__ import annotations

from phalanx.schemas.messages import DETAIL_CHARS
from phalanx.services.health.events import RankExitSeen

#: The most of a rank's error line that the first line of its crash detail quotes.
ERROR_CHARS = 500
#: What parts the detail's first line from the rank's last output: the first line stands
#: alone (a one-line view shows only it), so nothing on it announces what follows.
LAST_OUTPUT = "\nits last output:\n"


def crash_detail(event: RankExitSeen) -> str:
    """The detail of a crash fault: what ended the rank, and its error and last output."""
    if event.cause == "launch_failed":
        return f"rank {event.rank} could not be started: {event.detail or 'no reason given'}"
    if event.cause == "gpu_fault":  # the agent's detail: the fault's line, then the output
        fault, _, output = event.detail.partition("\n")
        head = f"rank {event.rank} was killed by its agent on {event.node_id}: GPU fault: " \
            f"{fault[:ERROR_CHARS] or 'no detail given'}"
        output = output.rstrip()
        if not output:
            return head
        head += LAST_OUTPUT
        return head + output[max(0, len(output) - (DETAIL_CHARS - len(head))):]
    if event.cause == "lost" and event.with_agent:
        return (f"rank {event.rank} was stopped with its agent on {event.node_id} (the agent "
                "shut down while the job still wanted the rank)")
    if event.cause == "lost":
        what = (f"rank {event.rank} was found dead by a restarted agent on {event.node_id}; "
                "its exit status is unknown")
        if event.signal is not None or event.exit_code is not None:
            what += f" (reported: exit code {event.exit_code}, signal {event.signal})"
        return what
    if event.cause == "oom":
        what = (f"rank {event.rank} was killed by the OOM killer on {event.node_id}: its "
                "memory passed its job's memory_per_rank")
    elif event.signal is not None:
        code = f" (exit code {event.exit_code})" if event.exit_code is not None else ""
        what = f"rank {event.rank} was killed by signal {event.signal}{code}"
    elif event.exit_code is None:
        what = f"rank {event.rank} exited with an unknown status"
    else:
        what = f"rank {event.rank} exited with code {event.exit_code}"
    output = event.detail.rstrip()
    if not output:
        return what
    # The error is the output's last line (an exception's, a "can't open file"): it goes on
    # the first line too, which is all that one-line views show (phalanx top, a
    # generation's cause). The output is cut at its start to keep the fault's detail
    # within DETAIL_CHARS, so the error is never what is lost.
    error = output.splitlines()[-1].strip()
    # A process killed by a signal was stopped from outside: its last line is no error.
    head = f"{what}{LAST_OUTPUT}" if event.signal is not None \
        else f"{what}: {error[:ERROR_CHARS]}{LAST_OUTPUT}"
    return head + output[max(0, len(output) - (DETAIL_CHARS - len(head))):]

