"""State copy between two real gloo ranks (two threads, one in-process store)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.state import (
    StateTransferError,
    landing_buffers,
    receive_state,
    send_state,
)


def trained(seed: int, widths: tuple[int, ...] = (6, 8, 3)) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(widths[0], widths[1]), torch.nn.ReLU(),
                                torch.nn.Linear(widths[1], widths[2]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, widths[0])).sum().backward()
    optimizer.step()  # the optimizer has state (exp_avg, exp_avg_sq, a 0-d step)
    return model, optimizer


def pair(sender: Callable[[dist.ProcessGroup], Any],
         receiver: Callable[[dist.ProcessGroup], Any],
         refused: bool = False) -> tuple[Any, Any]:
    """Run ``sender`` as rank 0 and ``receiver`` as rank 1 of a fresh gloo group.

    When the receiver is to refuse the state, only it is waited for: the sender's
    transfer then blocks until the group's timeout (the runtime tears the group down
    instead), and nothing about it is checked.
    """
    store = dist.HashStore()
    results: list[Any] = [None, None]

    def rank(r: int, body: Callable[[dist.ProcessGroup], Any]) -> None:
        # A generous timeout: a loaded CI machine may take seconds to connect the pair.
        pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=60))
        try:
            results[r] = body(pg)
        except Exception as exc:  # handed to the test thread
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(0, sender), daemon=True),
               threading.Thread(target=rank, args=(1, receiver), daemon=True)]
    for t in threads:
        t.start()
    for t in threads[1:] if refused else threads:
        t.join(120)
        assert not t.is_alive(), "a rank never finished"
    return results[0], results[1]


def wait(work: dist.Work) -> None:
    work.wait()


@pytest.mark.parametrize("checksum", [False, True])
def test_state_arrives_whole_model_optimizer_step_and_rng(checksum: bool) -> None:
    source, source_opt = trained(0)
    target, target_opt = trained(1)
    torch.manual_seed(42)
    rng = torch.get_rng_state()
    sent, (step, stats) = pair(
        lambda pg: send_state(pg, 1, source, source_opt, 17, wait, checksum=checksum),
        lambda pg: receive_state(pg, 0, target, target_opt, wait))
    assert step == 17 and stats.nbytes == sent.nbytes > 0 and stats.tensors == sent.tensors
    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    src, dst = source_opt.state_dict(), target_opt.state_dict()
    for i, state in src["state"].items():
        for key, value in state.items():
            assert torch.equal(value, dst["state"][i][key])
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_fresh_optimizer_receives_its_state_too() -> None:
    source, source_opt = trained(0)
    torch.manual_seed(3)
    target = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)  # no state yet: a joiner
    pair(lambda pg: send_state(pg, 1, source, source_opt, 5, wait),
         lambda pg: receive_state(pg, 0, target, target_opt, wait))
    assert set(target_opt.state_dict()["state"]) == set(source_opt.state_dict()["state"])


def test_a_state_that_does_not_fit_the_model_is_refused_naming_the_tensor() -> None:
    source, source_opt = trained(0, (6, 8, 3))
    target, target_opt = trained(1, (6, 9, 3))
    before = [t.clone() for t in target.state_dict().values()]
    _, error = pair(lambda pg: send_state(pg, 1, source, source_opt, 5, wait),
                    lambda pg: receive_state(pg, 0, target, target_opt, wait), refused=True)
    assert isinstance(error, StateTransferError)
    assert "model tensor 0" in str(error) and "[8, 6]" in str(error)
    for a, b in zip(before, target.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # nothing was overwritten


def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_landing_buffers_leave_model_gradients_and_optimizer_as_they_were() -> None:
    model, optimizer = fresh(3)
    model(torch.randn(4, 6)).sum().backward()
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = landing_buffers(optimizer)
    # AdamW: exp_avg, exp_avg_sq and a 0-d step per parameter.
    assert len(buffers) == 3 * len(params)
    assert not optimizer.state  # a fresh optimizer still: its first step is the usual one
    for p, before, grad in zip(model.parameters(), params, grads, strict=True):
        assert torch.equal(p, before) and torch.equal(p.grad, grad)
    assert landing_buffers(optimizer) != []  # still no state: buffers again
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    assert landing_buffers(optimizer) == []  # it has state: nothing to prepare


def test_an_optimizer_that_needs_a_closure_gets_no_buffers_and_is_untouched() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.LBFGS(model.parameters())
    assert landing_buffers(optimizer) == []
    assert not optimizer.state
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.grad is None


def test_the_optimizer_state_is_received_into_the_landing_buffers() -> None:
    source, source_opt = trained(0)
    target, target_opt = fresh(3)
    buffers = landing_buffers(target_opt)
    addresses = {b.data_ptr() for b in buffers}
    pair(lambda pg: send_state(pg, 1, source, source_opt, 5, wait),
         lambda pg: receive_state(pg, 0, target, target_opt, wait, buffers))
    src, dst = source_opt.state_dict()["state"], target_opt.state_dict()["state"]
    for i, state in src.items():
        for key, value in state.items():
            assert torch.equal(value, dst[i][key])
            assert dst[i][key].data_ptr() in addresses  # no fresh allocation
    # The target trains on exactly as the source does.
    batch = torch.randn(4, 6)
    for model, optimizer in ((source, source_opt), (target, target_opt)):
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)


def scheduled(model_opt: tuple[torch.nn.Module, torch.optim.Optimizer],
              steps: int) -> tuple[Any, Any]:
    """A warmup + cosine schedule and an EMA, both stepped ``steps`` times."""
    model, optimizer = model_opt
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, 5),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 20)], milestones=[5])
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        ema.update_parameters(model)
    return scheduler, ema


def test_registered_state_arrives_with_the_optimizers_the_lr_schedule_and_an_ema() -> None:
    source = trained(0)
    source_extra = dict(zip(("scheduler", "ema"), scheduled(source, 9), strict=True))
    target = fresh(3)
    target_extra = dict(zip(("scheduler", "ema"), scheduled(target, 0), strict=True))
    pair(lambda pg: send_state(pg, 1, *source, 9, wait, checksum=True, extra=source_extra),
         lambda pg: receive_state(pg, 0, *target, wait, extra=target_extra))
    assert target_extra["scheduler"].state_dict() == source_extra["scheduler"].state_dict()
    assert target[1].param_groups[0]["lr"] == source[1].param_groups[0]["lr"]
    for a, b in zip(source_extra["ema"].state_dict().values(),
                    target_extra["ema"].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # Both go on alike: the next LR is the same.
    for model_opt, extra in ((source, source_extra), (target, target_extra)):
        model_opt[1].step()
        extra["scheduler"].step()
    assert target[1].param_groups[0]["lr"] == source[1].param_groups[0]["lr"]


def test_registered_state_under_other_names_is_refused_naming_both() -> None:
    source, target = trained(0), fresh(3)
    sent = {"scheduler": scheduled(source, 2)[0]}
    mine = {"sched": scheduled(target, 0)[0]}
    before = [t.clone() for t in target[0].state_dict().values()]
    _, error = pair(lambda pg: send_state(pg, 1, *source, 2, wait, extra=sent),
                    lambda pg: receive_state(pg, 0, *target, wait, extra=mine), refused=True)
    assert isinstance(error, StateTransferError)
    assert "['scheduler']" in str(error) and "['sched']" in str(error)
    for a, b in zip(before, target[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)  # nothing was overwritten
