"""The agent's supervisor's rules: its restart delay and the agent's command line (the
process layout itself: tests/integration/test_agent_supervisor.py)."""

from __future__ import annotations

import sys

from phalanx.services.agent.supervisor import (
    FIRST_DELAY_S,
    MAX_DELAY_S,
    STEADY_S,
    agent_command,
    next_delay,
)


def test_the_restart_delay_doubles_while_the_agent_dies_young_and_resets_after() -> None:
    delays = [FIRST_DELAY_S]
    for _ in range(8):
        delays.append(next_delay(delays[-1], ran_s=0.5))
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0] and max(delays) == MAX_DELAY_S
    assert next_delay(MAX_DELAY_S, ran_s=STEADY_S) == FIRST_DELAY_S


def test_the_agent_under_the_supervisor_is_the_same_command_without_the_flag() -> None:
    assert agent_command(["agent", "--supervised", "--node-id", "n"]) == [
        sys.executable, "-m", "phalanx.services.cli", "agent", "--node-id", "n"]
