"""torch.distributed's default group under the session, and a session the script leaves open."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime import default_group, record
from phalanx.runtime.elastic import ElasticSession
from phalanx.runtime.sharded import sharded_optimizer
from phalanx.schemas import environment

pytestmark = pytest.mark.usefixtures("no_default_group")


def session_alone() -> ElasticSession:
    model = torch.nn.Linear(2, 1)
    data = [(torch.zeros(2), torch.zeros(1))] * 8
    return ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                          global_batch=4)


def test_a_session_alone_is_rank_0_of_1_and_collectives_on_the_default_group_are_refused(
        ) -> None:
    session_alone()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "phalanx")
    for collective in (lambda: dist.all_reduce(torch.ones(1)), dist.barrier,
                       lambda: dist.broadcast(torch.ones(1), 0)):
        with pytest.raises(RuntimeError, match="default process group.*step.add"):
            collective()


def test_each_generation_remakes_the_default_group_and_a_non_member_has_none() -> None:
    default_group.answer(2, 4)
    assert (dist.get_rank(), dist.get_world_size()) == (2, 4)
    default_group.answer(0, 3)
    assert (dist.get_rank(), dist.get_world_size()) == (0, 3)
    default_group.clear()
    assert not dist.is_initialized()


def test_a_default_group_the_script_made_itself_is_the_sessions_from_then_on() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    session_alone()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "phalanx")
    default_group.answer(1, 2)
    assert (dist.get_rank(), dist.get_world_size()) == (1, 2)
    default_group.clear()
    assert not dist.is_initialized()


def test_a_traceback_names_the_rank_of_the_generation_applied_last_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    session_alone()  # the script's world of one, then the session's groups
    for rank in (1, 2, 3):
        default_group.answer(rank, 4)
    try:
        raise OSError("the disk is full")
    except OSError:
        sys.excepthook(*sys.exc_info())
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines[-1] == "[rank3]: OSError: the disk is full"
    assert all(line.startswith("[rank3]: ") and "[rank" not in line[9:] for line in lines)
    default_group.clear()


def test_the_rank_asked_before_the_session_of_a_world_of_one_warns_with_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every replica of a declared session starts as rank 0 of its own world of one: a
    ``rank = dist.get_rank()`` kept from before the session made all four rank 0."""
    for name, value in environment.WORLD_OF_ONE.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo")  # the script's, from the agent's variables
    with pytest.warns(RuntimeWarning, match=r"0 in every replica.*after "
                                            r"ElasticSession.from_env.*session.is_primary"):
        assert dist.get_rank() == 0
    session_alone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default_group.answer(2, 4)
        assert dist.get_rank() == 2  # the session's: the generation's rank
    default_group.clear()
    monkeypatch.delenv(environment.WORLD_OF_ONE_MARK)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with warnings.catch_warnings():  # torchrun's world of one, outside phalanx: nothing
        warnings.simplefilter("error")
        assert dist.get_rank() == 0


def test_a_sharded_optimizer_is_built_over_the_sessions_default_group() -> None:
    model = torch.nn.Linear(2, 1)
    zero = sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    assert (zero.world_size, dist.get_backend()) == (1, "phalanx")
    # Built by a member, it leaves the member's rank alone: it is refused, as before.
    default_group.answer(2, 4)
    with pytest.raises(RuntimeError, match="default group of 4 ranks"):
        sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    assert (dist.get_rank(), dist.get_world_size()) == (2, 4)


SCRIPT = """
import sys, torch
from phalanx.runtime.elastic import ElasticSession
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
data = [(torch.randn(2), torch.randn(1)) for _ in range(8)]
session = ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                         global_batch=4, record_dir=sys.argv[1])
for step in session.steps(4):
    for x, y in step:
        step.backward(torch.nn.functional.mse_loss(model(x), y))
    step.commit()
    if step.index == 1:
        if sys.argv[2] == "raise":
            raise RuntimeError("the script's own failure after step 1's commit")
        break
"""


@pytest.mark.parametrize("ending", ["break", "raise"])
def test_a_session_left_open_is_closed_at_exit(tmp_path: Path, ending: str) -> None:
    # Left after step 1's commit: its boundary (the commit's record) comes as the process
    # exits, unless an uncaught exception is ending it (the step's post-commit code failed).
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), ending],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == (1 if ending == "raise" else 0), run.stderr
    (lines,) = record.read(tmp_path).values()
    commits = [line["step"] for line in lines if line["kind"] == "commit"]
    assert commits == ([0] if ending == "raise" else [0, 1])
