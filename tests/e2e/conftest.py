"""Fixtures the e2e modules share for the whole session: the MLP workload's data set and its
fault-free runs (``test_elastic``'s script and ARGS).

Most e2e modules train the same script on the same data, and several compare against the
same run alone. Each is a torch process (2-5 s of CPU on a suite bound by its CPU), so each
is made once per session, not once per module. A module whose job differs (more steps, an
LR schedule, the sharded optimizer) overrides ``reference`` with its own
``fault_free_runs(steps, args)``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_elastic import LONG_STEPS, STEPS, FaultFreeRuns, made_once, prepare


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this test session that all its processes see: with pytest-xdist,
    the workers' common base; alone, this process's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def data_dir(shared_dir: Path) -> Path:
    """The data set of ``train_mlp.py`` with test_elastic's ARGS (made once a session)."""
    path = shared_dir / "data" / "mlp"
    with made_once(path) as to_make:
        if to_make:
            prepare(path)
    return path


@pytest.fixture(scope="session")
def fault_free_runs(data_dir: Path, shared_dir: Path) -> FaultFreeRuns:
    """``fault_free_runs(steps, args)``: the script alone on ``data_dir``, once a session."""
    return FaultFreeRuns(data_dir, shared_dir)


@pytest.fixture(scope="session")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    """The run alone of test_elastic's jobs (STEPS)."""
    return fault_free_runs(STEPS)


@pytest.fixture(scope="session")
def long_reference(fault_free_runs: FaultFreeRuns) -> dict:
    """The run alone of test_elastic's jobs that wait for a replacement (LONG_STEPS)."""
    return fault_free_runs(LONG_STEPS)
