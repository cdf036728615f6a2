"""Ports for listeners: picked below the kernel's ephemeral range, never one in use."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from phalanx.services.ports import GROUP_PORTS, SERVER_PORTS, free_in, free_port


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_a_server_port_lies_below_the_ephemeral_range_and_apart_from_the_groups() -> None:
    port = free_port()
    assert port in SERVER_PORTS and port < ephemeral_low()
    assert not set(SERVER_PORTS) & set(GROUP_PORTS)


def test_a_port_in_use_is_passed_over_and_a_full_range_says_so() -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        # The taken port, then one free a moment ago (its neighbour may be anyone's).
        step = free - taken
        assert free_in(range(taken, free + step // abs(step), step), 0) == free
        with pytest.raises(OSError, match=f"no free port in {taken}..{taken} "):
            free_in(range(taken, taken + 1), 0)
