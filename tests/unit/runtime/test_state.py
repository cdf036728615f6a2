"""State copy between two real gloo ranks (two threads, one in-process store)."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.state import StateTransferError, receive_state, send_state


def trained(seed: int, widths: tuple[int, ...] = (6, 8, 3)) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(widths[0], widths[1]), torch.nn.ReLU(),
                                torch.nn.Linear(widths[1], widths[2]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, widths[0])).sum().backward()
    optimizer.step()  # the optimizer has state (exp_avg, exp_avg_sq, a 0-d step)
    return model, optimizer


def pair(sender: Callable[[dist.ProcessGroup], Any],
         receiver: Callable[[dist.ProcessGroup], Any]) -> tuple[Any, Any]:
    """Run ``sender`` as rank 0 and ``receiver`` as rank 1 of a fresh gloo group."""
    store = dist.HashStore()
    results: list[Any] = [None, None]

    def rank(r: int, body: Callable[[dist.ProcessGroup], Any]) -> None:
        pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=3))
        try:
            results[r] = body(pg)
        except Exception as exc:  # handed to the test thread
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(0, sender)),
               threading.Thread(target=rank, args=(1, receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
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
                    lambda pg: receive_state(pg, 0, target, target_opt, wait))
    assert isinstance(error, StateTransferError)
    assert "model tensor 0" in str(error) and "[8, 6]" in str(error)
    for a, b in zip(before, target.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # nothing was overwritten
