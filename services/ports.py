"""TCP ports for listeners on this host, picked outside the kernel's ephemeral range.

A port the kernel picks (``bind`` to port 0) comes from the ephemeral range (32768 up by
default), the same range every outgoing connection and every other ``bind(0)`` on the
host draws from: free when picked, it could be taken before the listener it was picked
for bound it. Seen in the suite under load: a nats-server of a deployment test failed
with "address already in use", and a replica group's ranks met another group's store.
So a port is picked here from a range below it, where only other pickers look.
"""

from __future__ import annotations

import random
import socket
import zlib

#: Where :func:`free_port` looks: ports for the servers a cluster or a test starts.
SERVER_PORTS = range(10000, 20000)
#: Where a replica group's ``MASTER_PORT`` is picked (below the gangs' ``master_port``
#: range, 29500 up).
GROUP_PORTS = range(20000, 29500)


def free_in(ports: range, first: int, host: str = "127.0.0.1") -> int:
    """The first port of ``ports`` free on ``host`` now, scanning (cyclically) from index
    ``first``.

    Raises:
        OSError: every port of the range is taken.
    """
    for i in range(len(ports)):
        port = ports[(first + i) % len(ports)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {ports.start}..{ports.stop - 1} on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port of :data:`SERVER_PORTS` nothing listens on now, from a random point (two
    pickers at once on a host rarely start at the same port)."""
    return free_in(SERVER_PORTS, random.randrange(len(SERVER_PORTS)), host)


def group_master_port(key: str) -> int:
    """A TCP port free on this host now for a group's ``MASTER_PORT`` (its processes
    rendezvous on their own host), scanning :data:`GROUP_PORTS`
    from a point ``key`` (the group's job, replica and incarnation) picks."""
    try:
        return free_in(GROUP_PORTS, zlib.crc32(key.encode()) % len(GROUP_PORTS))
    except OSError as exc:
        raise OSError(f"{exc}, for a replica group's rendezvous") from None
