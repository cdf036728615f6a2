"""Fixtures the integration modules share."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from phalanx.services.agent.zygote import Launcher, Template


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset ``runtime_worker.py`` trains on, prepared once per module."""
    path = tmp_path_factory.mktemp("runtime") / "data"
    worker = Path(__file__).resolve().parent / "runtime_worker.py"
    subprocess.run([sys.executable, str(worker), "--prepare", str(path)], check=True,
                   timeout=120)
    return path


@pytest.fixture(scope="session")
async def launcher(tmp_path_factory: pytest.TempPathFactory,
                   zygote_template: Template) -> AsyncIterator[Launcher]:
    """Starts the tests' rank processes as an agent does: forked from a zygote that has
    torch imported (started cold, a worker spent about 2.4 s of CPU before its first step,
    most of what these modules cost), itself forked from the test process's template."""
    launcher = Launcher(tmp_path_factory.mktemp("launcher"), template=zygote_template.path)
    yield launcher
    await launcher.close()
