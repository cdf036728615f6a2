"""The seeded chaos run of ``bench/chaos.py`` at CI size: eight faults, every kind
(rank SIGKILL and SIGSTOP, agent SIGKILL, a service instance and a leader SIGKILLed, a
nats-server restart, a node lost with its ranks) at least once, against one elastic job
in deterministic mode. The first seven faults are one of each kind in a seeded order
and the eighth is drawn by weight, so every kind comes once and one twice;
``python bench/chaos.py`` runs 100."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phalanx.bench import chaos


@pytest.mark.timeout(900)
async def test_seeded_faults_of_every_kind_leave_the_model_exactly_as_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PHALANX_HEALTH_CORDON_FAULTS", "PHALANX_ELASTICITY_MAX_REPLACEMENTS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after: chaos sets them
    # Paced to at most 25 steps/s while the faults are made, 1600 steps last at least
    # 64 s: the 8 faults, 2.5 s apart, and their recoveries fit with room (injection
    # stops 50 steps before the end). The steps after them, and the fault-free run's,
    # are all CPU the suite spends: no more of them than that.
    result = await chaos.run(tmp_path, seed=1, faults=8, interval_s=2.5, steps=1600,
                             pace_s=0.04)
    assert result["faults"] == 8
    assert {f["kind"] for f in result["fault_log"]} == set(chaos.KINDS)
    assert result["finished"]
    assert result["verify_errors"] == []  # every sample once per epoch, no step trained twice
    assert result["params_equal"]  # bitwise: deterministic mode
    assert result["admitted_once"]
    assert result["left_behind"] == []
    for kind, figures in result["by_kind"].items():
        assert figures["unrecovered"] == 0, (kind, result["fault_log"])
