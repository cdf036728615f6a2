"""The pure layers import without the bus: no `nats`, no `asyncio` in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE_MODULES = [
    "phalanx.schemas",
    "phalanx.schemas.messages",
    "phalanx.schemas.codec",
    "phalanx.schemas.subjects",
    "phalanx.services.registry.core",
    "phalanx.services.agent.core",
    "phalanx.services.admission.core",
    "phalanx.services.admission.policy",
    "phalanx.services.admission.scaling",
    "phalanx.services.admission.changes",
    "phalanx.services.elasticity.core",
    "phalanx.services.health.core",
    "phalanx.services.health.policy",
    "phalanx.services.health.progress",
    "phalanx.services.checkpoint.core",
    "phalanx.services.agent.priority",
    "phalanx.schemas.environment",
]


def imported_after(module: str) -> set[str]:
    """Top-level package names in sys.modules after importing ``module`` in a fresh python."""
    code = (f"import sys, {module}\n"
            "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_does_not_pull_in_nats_or_asyncio(module: str) -> None:
    loaded = imported_after(module)
    assert "phalanx" in loaded
    assert "nats" not in loaded
    assert "asyncio" not in loaded


def test_the_check_detects_the_bus_layer() -> None:
    """Control: the bus package does import nats, so the check above is not vacuous."""
    loaded = imported_after("phalanx.bus")
    assert "nats" in loaded
    assert "asyncio" in loaded
