"""Where a rank trains and which process group it builds (runtime/placement.py, and the
session that uses it)."""

from __future__ import annotations

import datetime

import pytest
import torch

from phalanx.runtime.elastic import ElasticSession
from phalanx.runtime.placement import (
    Backend,
    choose_backend,
    device,
    model_device,
    nccl_environment,
)

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(("requested", "on", "backend"), [
    ("auto", CPU, Backend.GLOO),
    ("auto", GPU, Backend.NCCL),
    ("gloo", CPU, Backend.GLOO),
    ("gloo", GPU, Backend.GLOO),  # ranks sharing one GPU
    ("nccl", GPU, Backend.NCCL),
])
def test_the_backend_follows_the_spec_and_the_models_device(requested: str, on: torch.device,
                                                           backend: Backend) -> None:
    assert choose_backend(requested, on) is backend


def test_nccl_for_a_cpu_model_and_an_unknown_backend_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="backend nccl needs the model on a GPU; it is on cpu"):
        choose_backend("nccl", CPU)
    with pytest.raises(ValueError, match="backend must be auto, nccl or gloo, got 'mpi'"):
        choose_backend("mpi", CPU)


def test_the_agent_decides_the_device_and_cpu_needs_no_cuda() -> None:
    assert device({"PHALANX_DEVICE": "cpu"}) == CPU
    with pytest.raises(ValueError, match="PHALANX_DEVICE must be cuda or cpu, got 'tpu'"):
        device({"PHALANX_DEVICE": "tpu"})
    alone = device({})
    assert alone == (GPU if torch.cuda.is_available() else CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a rank given a GPU without CUDA")
def test_a_rank_given_a_gpu_without_cuda_says_so() -> None:
    with pytest.raises(RuntimeError, match="the agent gave this rank GPU '2' but torch .* "
                                           "sees no CUDA device"):
        device({"PHALANX_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "2"})


def test_the_models_device_is_where_its_tensors_are() -> None:
    assert model_device(torch.nn.Linear(2, 2)) == CPU
    assert model_device(torch.nn.ReLU()) == CPU  # no tensors at all
    split = torch.nn.Linear(2, 2)
    split.register_buffer("scale", torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match=r"on \['cpu', 'meta'\]: a replica's model lives"):
        model_device(split)


def test_nccl_environment_keeps_the_watchdog_from_ending_the_process(
        caplog: pytest.LogCaptureFixture) -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "90",
           "OTHER": "x"}
    nccl_environment(datetime.timedelta(seconds=30), env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                   "TORCH_NCCL_NONBLOCKING_TIMEOUT": "90", "OTHER": "x"}  # the user's wait
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 replaced by 0" in caplog.text
    unset: dict[str, str] = {}
    nccl_environment(datetime.timedelta(seconds=2.5), unset)
    # An initialisation given up is aborted once torch's wait for it ends: bounded.
    assert unset == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                     "TORCH_NCCL_NONBLOCKING_TIMEOUT": "3"}


class Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2,), float(i)), torch.zeros(1)


@pytest.mark.parametrize(("env", "backend"), [({}, Backend.GLOO),
                                              ({"PHALANX_BACKEND": "auto"}, Backend.GLOO),
                                              ({"PHALANX_BACKEND": "gloo"}, Backend.GLOO)])
def test_a_cpu_session_takes_the_specs_backend(env: dict[str, str], backend: Backend) -> None:
    model = torch.nn.Linear(2, 1)
    session = ElasticSession.from_env(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      Pairs(), env=env, global_batch=4)
    assert session.device == CPU and session.backend is backend
    session.close()


@pytest.mark.parametrize(("backend", "message"), [
    ("nccl", "backend nccl needs the model on a GPU; it is on cpu"),
    ("mpi", "backend must be auto, nccl or gloo, got 'mpi'"),
])
def test_a_session_refuses_a_backend_its_model_cannot_use(backend: str, message: str) -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=message):
        ElasticSession.from_env(model, torch.optim.SGD(model.parameters(), lr=0.1), Pairs(),
                                env={"PHALANX_BACKEND": backend}, global_batch=4)
