"""The runtime on a GPU: NCCL generations with abort, device snapshots, CUDA tensors over
gloo, a lone session's deterministic steps.

Skipped without CUDA (every test here needs a real GPU; the CPU side of the same code is
tested in test_device_group.py, test_snapshot.py, test_state.py and test_reduce.py). One
GPU: NCCL runs at world size 1 (it refuses two ranks on one device); two ranks share the
GPU over gloo with CUDA tensors, as bench/gpu.py's phase (a) does. docs/gpu.md says what
this covers and what it does not (NCCL across ranks and nodes).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import time
from collections.abc import Callable
from typing import Any

import gloo_pair
import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.device_staging import DeviceStaging
from phalanx.runtime.elastic import ElasticSession
from phalanx.runtime.flat_state import copy_range, flat_state
from phalanx.runtime.group import Aborted, DeviceGroup, Waits, connect, nccl_ready, rendezvous
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.placement import Backend
from phalanx.runtime.reduce import BucketedReduce, bucket_plan
from phalanx.runtime.snapshot import write_share
from phalanx.runtime.spare import wait_for_identity
from phalanx.runtime.state import receive_state, send_state
from phalanx.schemas.errors import ConfigError
from phalanx.schemas.messages import Generation, GenerationReason, Member

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# torch reads it once, at the process's first NCCL group: an initialisation given up is
# released within seconds here (the runtime sets the generation's collective timeout).
os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", "5")
GPU = torch.device("cuda", 0)
TIMEOUT = datetime.timedelta(seconds=30)


def generation(number: int, endpoint: str) -> Generation:
    return Generation(job_id="gpu", generation=number, world_size=1, rendezvous=f"gpu-g{number}",
                      resume_step=0, reason=GenerationReason.FAULT,
                      members=[Member(replica_id="r0-0", rank=0, node_id="n", endpoint=endpoint)])


def used_bytes() -> int:
    """GPU memory in use by anyone (NCCL's own buffers are outside torch's allocator)."""
    free, total = torch.cuda.mem_get_info(GPU)
    return total - free


def threads() -> int:
    return len(os.listdir("/proc/self/task"))  # torch's watchdog threads are not Python's


@pytest.mark.skipif(not dist.is_nccl_available(), reason="torch without NCCL")
def test_nccl_generations_are_aborted_and_rebuilt_and_leak_nothing() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT, use_libuv=True)
    waits = Waits(Inbox("r0-0"), lambda: None)
    weight = torch.nn.Parameter(torch.ones(256, 256, device=GPU))
    optimizer = torch.optim.SGD([weight], lr=0.01)
    after: list[tuple[int, int]] = []  # GPU memory in use and threads, after the aborts
    for number in range(8):
        # Every other generation is built while the last one's abort is still under way.
        group = rendezvous(waits, {}, ("r0-0", store), generation(number, f"x:{store.port}"),
                           0, TIMEOUT, lambda: None, Backend.NCCL, GPU)
        assert isinstance(group, DeviceGroup) and group.backend_kind is Backend.NCCL
        on_device, on_host = torch.full((4,), 2.0, device=GPU), torch.arange(3)
        for tensor in (on_device, on_host):  # the host vector is staged and comes back
            waits.work(group.allreduce([tensor]), lambda: False)
        assert on_device.tolist() == [2.0] * 4 and on_host.tolist() == [0, 1, 2]
        waits.abandon(group)  # what a fault does: ncclCommAbort, on a thread of its own
        assert waits.abandoned == []  # nothing kept on NCCL
        weight.grad = torch.tanh(weight @ weight)  # a step on the device during the abort
        optimizer.step()
        torch.cuda.synchronize(GPU)
        if number % 2:
            assert waits.aborted(30), "an NCCL abort did not end in 30 s"
            after.append((used_bytes(), threads()))
    assert torch.isfinite(weight).all() and not torch.equal(weight, torch.ones_like(weight))
    memory, count = zip(*after[1:], strict=True)  # once the first communicators warmed up
    assert max(memory) - min(memory) < 16 * 2**20, after
    assert max(count) - min(count) <= 4, after  # a leak: two threads or more a generation


@pytest.mark.skipif(not dist.is_nccl_available(), reason="torch without NCCL")
def test_a_communicator_given_up_while_it_waits_for_a_peer_is_aborted_and_released() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT, use_libuv=True)
    waits = Waits(Inbox("r0-0"), lambda: None)
    lonely = connect(dist.PrefixStore("lonely/", store), 0, 2, TIMEOUT, Backend.NCCL, GPU)
    assert isinstance(lonely, DeviceGroup)
    deadline = time.monotonic() + 0.5
    with pytest.raises(Aborted, match="rank 1 never came"):
        waits.call(lambda: nccl_ready(lonely),
                   lambda: "rank 1 never came" if time.monotonic() > deadline else None)
    waits.abandon(lonely)
    # The next generation forms while that abort waits for torch to give the init up.
    after = rendezvous(waits, {}, ("r0-0", store), generation(1, f"x:{store.port}"), 0,
                       TIMEOUT, lambda: None, Backend.NCCL, GPU)
    probe = torch.ones(4, device=GPU)
    waits.work(after.allreduce([probe]), lambda: False)
    assert probe.tolist() == [1.0] * 4
    waits.abandon(after)
    # Bounded by TORCH_NCCL_NONBLOCKING_TIMEOUT (5 s in this module), not torch's 30 min.
    assert waits.aborted(60), "an NCCL communicator given up during its init stayed"


def test_a_device_snapshot_holds_the_committed_bytes_and_the_fence_keeps_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 8)).to(GPU)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device=GPU)).sum().backward()
    optimizer.step()
    state = flat_state(model, optimizer, {}, 3)
    assert state.device == GPU
    offset, length = state.extent(1, 2)
    expected = torch.empty(length, dtype=torch.uint8)
    copy_range(state, offset, expected)  # the CPU path's synchronous copy
    meta = b"meta"
    plain = write_share(memoryview(bytearray(length + 8192)), state, meta, "j", 3, 0, 1, 2)
    staging = DeviceStaging(GPU)
    staged = staging.start(state, 1, 2)
    staging.fence()  # then the next step writes the parameters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert staging.copied is not None
    staging.copied.synchronize()
    assert torch.equal(staged, expected)
    from_device = write_share(memoryview(bytearray(length + 8192)), state, meta, "j", 3, 0, 1,
                              2, staged)
    assert from_device == plain  # the same header, checksum (on the host) included


def on_two_ranks(body: Callable[[int, DeviceGroup, Waits], Any]) -> list[Any]:
    """Two ranks (threads) sharing the GPU over gloo with CUDA tensors."""
    return gloo_pair.on_two_ranks(
        lambda r, gloo: body(r, DeviceGroup(gloo, Backend.GLOO, GPU),
                             Waits(Inbox(f"r{r}"), lambda: None)),
        timeout=TIMEOUT, join_s=60)


def test_cuda_state_and_gradients_travel_over_gloo_between_ranks_sharing_the_gpu() -> None:
    def body(rank: int, group: DeviceGroup, waits: Waits) -> dict[str, Any]:
        torch.manual_seed(rank)  # different models: the copy must make them equal
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(GPU)
        optimizer = torch.optim.AdamW(model.parameters())
        if rank == 0:
            model(torch.randn(2, 16, device=GPU)).sum().backward()
            optimizer.step()

        def wait(work: Any) -> None:
            waits.work(work, lambda: False)

        if rank == 0:
            send_state(group, 1, model, optimizer, 7, wait, checksum=True)
        else:
            step, _ = receive_state(group, 0, model, optimizer, wait)
            assert step == 7
        params = list(model.parameters())
        for p in params:
            p.grad = torch.full_like(p, float(rank + 1))
        reduce = BucketedReduce(group, params, bucket_plan(params, 256), None,
                                lambda: torch.tensor([float(rank)]))
        tail = reduce.finish(wait)
        return {"state": {k: v.cpu() for k, v in model.state_dict().items()},
                "exp_avg": [s["exp_avg"].cpu() for s in optimizer.state.values()],
                "grads": [p.grad.cpu() for p in params], "tail": tail.tolist()}

    first, second = on_two_ranks(body)
    for name, value in first["state"].items():
        assert torch.equal(value, second["state"][name]), name
    assert all(torch.equal(a, b) for a, b in zip(first["exp_avg"], second["exp_avg"],
                                                   strict=True))
    assert all(bool((g == 3.0).all()) for g in first["grads"] + second["grads"])
    assert first["tail"] == second["tail"] == [1.0]


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(2, generator=g)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self[i] for i in indices), strict=True)
        return torch.stack(xs), torch.stack(ys)


@pytest.fixture
def global_cuda_settings() -> Any:
    """Deterministic mode changes process-wide settings: put them back after the test."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    kernels = (torch.backends.cuda.flash_sdp_enabled(),
               torch.backends.cuda.mem_efficient_sdp_enabled(),
               torch.backends.cuda.cudnn_sdp_enabled())
    yield
    torch.use_deterministic_algorithms(deterministic)
    for enable, on in zip((torch.backends.cuda.enable_flash_sdp,
                           torch.backends.cuda.enable_mem_efficient_sdp,
                           torch.backends.cuda.enable_cudnn_sdp), kernels, strict=True):
        enable(on)


def lone_gpu_session() -> tuple[torch.nn.Module, ElasticSession]:
    """A small model on the GPU and its lone session, deterministic (seeded alike)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 2)).to(GPU)
    optimizer = torch.optim.AdamW(model.parameters())
    return model, ElasticSession(model, optimizer, Tokens(), global_batch=16,
                                 micro_batch_size=4, deterministic=True)


def test_a_lone_session_trains_on_the_gpu_and_deterministic_mode_repeats_bitwise(
        global_cuda_settings: Any) -> None:
    def train() -> list[torch.Tensor]:
        model, session = lone_gpu_session()
        assert session.device == GPU and session.backend is Backend.NCCL
        assert torch.are_deterministic_algorithms_enabled()
        for step in session.steps(6):
            for x, y in step:
                step.backward(torch.nn.functional.mse_loss(model(x.to(GPU)), y.to(GPU)))
            step.commit()
        session.close()
        return [p.detach().cpu() for p in model.parameters()]

    first, again = train(), train()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_the_scripts_own_backward_on_the_gpu_trains_as_session_backward_does(
        global_cuda_settings: Any) -> None:
    # The hooks and the pass's end callback run on the autograd engine's device thread.
    def train(plain: bool) -> list[torch.Tensor]:
        model, session = lone_gpu_session()
        for _ in session.epochs(2):
            for x, y in session.loader:
                loss = torch.nn.functional.mse_loss(model(x.to(GPU)), y.to(GPU))
                if plain:
                    loss.backward()
                else:
                    session.backward(loss)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if not session.commit():
                    continue
        session.close()
        return [p.detach().cpu() for p in model.parameters()]

    told, plain, again = train(False), train(True), train(True)
    for a, b, c in zip(told, plain, again, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(b, c)


def test_a_spare_whose_cuda_started_refuses_a_replica_on_other_gpus() -> None:
    torch.ones(1, device=GPU)  # CUDA is up in this process, on the devices it sees
    seen = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    process_env = {"PHALANX_SPARE": "spare-1", "CUDA_VISIBLE_DEVICES": seen}
    line = json.dumps({"PHALANX_REPLICA_ID": "r0-1", "CUDA_VISIBLE_DEVICES": seen + ",7"})
    with pytest.raises(ConfigError, match="spare spare-1: told to be a replica on GPUs"):
        wait_for_identity(process_env, io.BytesIO(line.encode() + b"\n"), process_env)
    same = json.dumps({"PHALANX_REPLICA_ID": "r0-1", "CUDA_VISIBLE_DEVICES": seen})
    assert wait_for_identity(process_env, io.BytesIO(same.encode() + b"\n"),
                             process_env)["PHALANX_REPLICA_ID"] == "r0-1"
