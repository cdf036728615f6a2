"""The seeded chaos run of ``bench/chaos.py`` at CI size: at least 15 faults, every kind
(rank SIGKILL and SIGSTOP, agent SIGKILL, a service instance and a leader SIGKILLed, a
nats-server restart) at least once, against one elastic job in deterministic mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from phalanx.bench import chaos


@pytest.mark.timeout(900)
async def test_fifteen_seeded_faults_of_every_kind_leave_the_model_exactly_as_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PHALANX_HEALTH_CORDON_FAULTS", "PHALANX_ELASTICITY_MAX_REPLACEMENTS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after: chaos sets them
    # Steps enough to outlast the faults (the job trains at 50-250 steps/s here, and a rank
    # fault waits for three members): injection stops 50 steps before the end.
    result = await chaos.run(tmp_path, seed=1, faults=15, interval_s=2.5, steps=8000)
    assert result["faults"] >= 15
    assert {f["kind"] for f in result["fault_log"]} == set(chaos.KINDS)
    assert result["finished"]
    assert result["verify_errors"] == []  # every sample once per epoch, no step trained twice
    assert result["params_equal"]  # bitwise: deterministic mode
    assert result["admitted_once"]
    assert result["left_behind"] == []
    for kind, figures in result["by_kind"].items():
        assert figures["unrecovered"] == 0, (kind, result["fault_log"])
