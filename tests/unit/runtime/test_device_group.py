"""The device side of runtime/group.py that runs on the CPU: staging, polled waits, and the
CPU rank's group left as it is.

Two real gloo ranks (threads). A :class:`DeviceGroup` stages what its backend cannot take
where it is; NCCL's rule is "CUDA tensors only", so with NCCL's rule and ``device=cpu``
over gloo every tensor goes through a staged copy and comes back after the work: the
staging and copy-back code the NCCL path runs, on the CPU. The polled wait is the one
NCCL's work items get. NCCL itself is checked only on a GPU (tests/gpu).
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from gloo_pair import on_two_ranks

from phalanx.runtime.group import Aborted, DeviceGroup, DeviceWork, Waits, connect
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.placement import Backend

TIMEOUT = datetime.timedelta(seconds=10)


def waits() -> Waits:
    return Waits(Inbox("r"), lambda: None)


def test_a_cpu_ranks_gloo_group_is_used_as_it_is() -> None:
    group = connect(dist.HashStore(), 0, 1, TIMEOUT, Backend.GLOO, torch.device("cpu"))
    assert type(group) is dist.ProcessGroupGloo


def test_staged_tensors_come_back_summed_broadcast_and_received() -> None:
    def body(rank: int, pg: dist.ProcessGroup) -> list[torch.Tensor]:
        group = DeviceGroup(pg, Backend.NCCL, torch.device("cpu"))
        wait = waits()
        summed = torch.full((3,), float(rank + 1))
        work = group.allreduce([summed])
        assert isinstance(work, DeviceWork) and work.polled and len(work.back) == 1
        wait.work(work, lambda: False)
        sent = torch.arange(4, dtype=torch.int64) * (7 if rank == 0 else 0)
        wait.work(group.broadcast(sent, 0), lambda: False)
        # gloo's send and receive (what ranks sharing a GPU use, their CUDA tensors staged
        # through the host): no future, so a waiter thread waits, and the work's own wait
        # copies back.
        pair = DeviceGroup(pg, Backend.GLOO, torch.device("cpu"))
        received = torch.zeros(2, dtype=torch.uint8)
        if rank == 0:
            wait.work(pair.send([torch.tensor([5, 9], dtype=torch.uint8)], 1, 3), lambda: False)
        else:
            wait.work(pair.recv([received], 0, 3), lambda: False)
        return [summed, sent, received]

    for rank, (summed, sent, received) in enumerate(on_two_ranks(body)):
        assert summed.tolist() == [3.0, 3.0, 3.0]
        assert sent.tolist() == [0, 7, 14, 21]
        assert received.tolist() == ([0, 0] if rank == 0 else [5, 9])


def test_a_polled_wait_gives_up_the_moment_the_generation_is_abandoned() -> None:
    """Rank 1 reaches the all-reduce late; rank 0's wait is given up when its inbox is
    woken with the abort, not at gloo's timeout."""
    abort = threading.Event()
    late = threading.Event()

    def body(rank: int, pg: dist.ProcessGroup) -> float | None:
        group = DeviceGroup(pg, Backend.NCCL, torch.device("cpu"))
        if rank == 1:
            late.wait(30)  # only once rank 0 gave up: nothing is left pending at the end
            group.allreduce([torch.ones(1)]).wait()
            return None
        wait = waits()
        work = group.allreduce([torch.ones(1)])

        def fault() -> None:
            abort.set()
            wait.inbox.wake.set()  # what the bus thread does with a fault

        timer = threading.Timer(0.2, fault)
        started = time.monotonic()  # before the timer: the wait lasts at least its 0.2 s
        timer.start()
        try:
            with pytest.raises(Aborted, match="a member failed"):
                wait.work(work, abort.is_set)
            return time.monotonic() - started
        finally:
            late.set()
            work.work.wait()  # rank 1 completes it

    given_up_after = on_two_ranks(body)[0]
    # Given up by the abort, not by gloo's timeout (10 s): how soon is the benchmarks' to
    # say (bench/recovery.py), the bound here only tells the two apart on a loaded machine.
    assert given_up_after is not None and 0.2 <= given_up_after < 5
