"""Which peers' nodes answer: a TCP connect to each, all at once, with a deadline.

A link cut between nodes (a switch port down, a firewall, a partition the bus does not
see) fails nothing at once: gloo's connections go silent and its collectives wait for
their timeout (30 s), with every process alive and reporting progress, so neither health
nor elasticity hears of it. A member whose collective has made no progress for
``unreachable_after_s`` asks, here, which of its peers' nodes answer at all: a connect
to the address a peer advertises (its rendezvous store's endpoint) that is neither
accepted nor refused within the deadline is a node this one cannot reach.

A refused connect is an answer: the node is reachable and the process is gone (a crash,
which health faults within seconds), so only silence names a peer. A stopped process
(SIGSTOP) still has its connects accepted by its kernel: a hang, health's to find.
One connect per node: its members share the verdict. Nothing here runs while
collectives complete.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Iterable

#: How long a collective waits without progress before its member asks which nodes
#: answer (the session's ``unreachable_after_s``).
UNREACHABLE_AFTER_S = 3.0
#: How long a node has to answer a connect (a LAN answers in well under 1 ms; a SYN
#: lost is sent again after 1 s, so a lossy link may be named too).
PROBE_S = 1.0


def silent(endpoints: Iterable[str], timeout_s: float = PROBE_S) -> set[str]:
    """The ``host:port`` endpoints whose connect was neither accepted nor refused within
    ``timeout_s`` (all tried at once), or could not be tried (no route: also silence)."""
    selector = selectors.DefaultSelector()
    pending: dict[socket.socket, str] = {}
    unanswered: set[str] = set()
    try:
        for endpoint in set(endpoints):
            host, _, port = endpoint.rpartition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((host, int(port)))
            if code in (0, errno.ECONNREFUSED):
                sock.close()
            elif code == errno.EINPROGRESS:
                pending[sock] = endpoint
                selector.register(sock, selectors.EVENT_WRITE, sock)
            else:
                sock.close()
                unanswered.add(endpoint)  # no route, unreachable network
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                answered: socket.socket = key.data
                code = answered.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                endpoint = pending.pop(answered)
                selector.unregister(answered)
                answered.close()
                if code not in (0, errno.ECONNREFUSED, errno.ECONNRESET):
                    unanswered.add(endpoint)  # EHOSTUNREACH, ETIMEDOUT
        return unanswered | set(pending.values())
    finally:
        for sock in pending:
            sock.close()
        selector.close()
