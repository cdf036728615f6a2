"""Where a rank trains: its device, and which process group its generations build.

**The device.** An agent that lists GPUs (``agent.gpus``) gives each rank its
slot's GPU alone (``CUDA_VISIBLE_DEVICES``) and says so (``PHALANX_DEVICE=cuda``),
so a rank with a GPU trains on ``cuda:0``; one whose agent lists none, and a
script run outside phalanx without CUDA, trains on the CPU. A script puts its
model on :func:`device` before it builds the session; the session then keeps
everything it allocates (gradient buckets, snapshot staging, received state)
where the model is (:attr:`~.elastic.ElasticSession.device`).

**The backend.** A job spec's ``backend`` (``auto | nccl | gloo``) reaches the
rank as ``PHALANX_BACKEND``; :func:`choose_backend` turns it and the model's
device into the process group each generation builds: ``auto`` is NCCL on a GPU
and gloo on a CPU, so the same script and spec run on either. Ranks that share
one GPU need ``gloo`` (NCCL refuses two ranks on one device); gloo takes CUDA
tensors in its all-reduce and broadcast, and :class:`~.group.DeviceGroup` stages
what it does not take (point-to-point sends of CUDA tensors) through the host.

**NCCL's own error handling.** torch's NCCL watchdog, by default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), ends the process when a collective
fails; a communicator the runtime aborts on purpose (a member died, the
generation is given up) makes its pending collectives fail. So the runtime sets
the variable to ``0`` (:func:`nccl_environment`) before it builds an NCCL group:
every failure is the runtime's to handle, as on gloo (it aborts the
communicator and goes on in the next generation); the collective timeout stays
the last resort, seen as a failed collective. The watchdog's heartbeat monitor
(``TORCH_NCCL_ENABLE_MONITORING``) is left as it is: it ends only a process
whose watchdog itself is stuck, a real hang that health reports.

**Deterministic mode on a GPU** (:func:`deterministic_cuda`): the session's
float64 sums make the reduction exact whatever the world size, on a GPU as on
the CPU; what a GPU adds is kernels whose results depend on scheduling (atomic
accumulation in cuBLAS' split-K, in embedding and fused-attention backward). In
deterministic mode the session turns on torch's deterministic algorithms and
the math attention kernel, so each micro-batch's gradient is the same bytes at
any world size.

Pure except :func:`device` (which asks torch for CUDA), :func:`deterministic_cuda`
and :func:`nccl_environment` (which set process-wide state).
"""

from __future__ import annotations

import datetime
import enum
import logging
import math
import os
from collections.abc import Mapping, MutableMapping

import torch

from phalanx.schemas import environment

log = logging.getLogger("phalanx.runtime")
#: The watchdog setting a runtime that aborts NCCL communicators on purpose needs.
NCCL_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
#: Seconds torch waits for a non-blocking NCCL communicator (:func:`nccl_environment`).
NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


class Backend(enum.StrEnum):
    """A generation's process group."""

    GLOO = "gloo"
    NCCL = "nccl"


def device(env: Mapping[str, str] | None = None) -> torch.device:
    """The device this rank trains on: ``cuda:0`` (its GPU) or ``cpu``.

    Under an agent (``PHALANX_DEVICE`` set) the agent decides: ``cuda`` when its node
    lists GPUs; outside phalanx, ``cuda:0`` whenever torch sees CUDA.

    Raises:
        RuntimeError: the agent gave this rank a GPU and torch sees no CUDA device.
    """
    env = os.environ if env is None else env
    wanted = env.get(environment.DEVICE)
    if wanted is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if wanted not in ("cuda", "cpu"):
        raise ValueError(f"{environment.DEVICE} must be cuda or cpu, got {wanted!r}")
    if wanted == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"the agent gave this rank GPU {env.get('CUDA_VISIBLE_DEVICES')!r}"
                           f" but torch {torch.__version__} sees no CUDA device (a CPU build "
                           "of torch, or no driver)")
    return torch.device("cuda", 0)


def choose_backend(requested: str, on: torch.device) -> Backend:
    """The process group for a job spec's ``backend`` and a model on device ``on``.

    Raises:
        ValueError: ``requested`` is none of auto, nccl, gloo; or nccl for a model
            that is not on a GPU.
    """
    if requested == "auto":
        return Backend.NCCL if on.type == "cuda" else Backend.GLOO
    if requested not in ("nccl", "gloo"):
        raise ValueError(f"backend must be auto, nccl or gloo, got {requested!r}")
    if requested == "nccl" and on.type != "cuda":
        raise ValueError(f"backend nccl needs the model on a GPU; it is on {on} (use "
                         "backend auto or gloo for CPU ranks)")
    return Backend(requested)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` lives: its first parameter's (or buffer's) device; CPU if it has
    neither.

    Raises:
        ValueError: its parameters and buffers are on more than one device (a
            data-parallel replica lives on one).
    """
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) > 1:
        raise ValueError(f"the model's tensors are on {sorted(map(str, devices))}: a "
                         "replica's model lives on one device")
    return devices.pop() if devices else torch.device("cpu")


def deterministic_cuda(env: MutableMapping[str, str] | None = None) -> None:
    """Make CUDA kernels bitwise repeatable, for the session's deterministic mode on a GPU:
    torch's deterministic algorithms (cuBLAS with a fixed workspace,
    ``CUBLAS_WORKSPACE_CONFIG``, set before cuBLAS starts), and attention by the math
    kernel (the fused ones' backward accumulate in whatever order their blocks finish)."""
    env = os.environ if env is None else env
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def nccl_environment(init_timeout: datetime.timedelta,
                     env: MutableMapping[str, str] | None = None) -> None:
    """Set :data:`NCCL_SETTINGS` in ``env`` (the process's, by default) before an NCCL
    group is built, saying so when it replaces another value; and, unless set already,
    how long torch waits for a non-blocking communicator to initialise.

    That wait holds the communicator's lock, which its abort needs too: a generation
    given up while its communicator waits for a peer that never comes is aborted only
    once the wait ends (seen on an H200: still waiting after 60 s). torch's default is
    30 minutes; the generation's collective timeout bounds it instead. torch reads it
    once, at the first NCCL group of the process.
    """
    env = os.environ if env is None else env
    for name, value in NCCL_SETTINGS.items():
        if env.get(name, value) != value:
            log.warning("%s=%s replaced by %s: the runtime aborts NCCL communicators on "
                        "purpose and handles their failures itself", name, env[name], value)
        env[name] = value
    env.setdefault(NONBLOCKING_TIMEOUT_ENV, str(max(1, math.ceil(init_timeout.total_seconds()))))
