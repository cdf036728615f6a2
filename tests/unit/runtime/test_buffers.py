"""The buffers rule (runtime/buffers.py) in a session alone: a step's BatchNorm statistics
are its first micro-batch's forward's, whatever else the step or the script runs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.elastic import ElasticSession

pytestmark = pytest.mark.usefixtures("no_default_group")

BATCH, MICRO = 8, 3  # micro-batches of 3, 3 and 2 samples a step


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(1))
    return list(zip(x, x[:, :2].tanh(), strict=True))


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_a_steps_statistics_are_its_first_micro_batchs_forward_alone() -> None:
    model = bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ElasticSession(model, optimizer, data(), global_batch=BATCH,
                             micro_batch_size=MICRO)
    for step in session.steps(3):
        before = bn_model()  # the step's parameters and buffers, in a model of its own
        before.load_state_dict(copy.deepcopy(model.state_dict()))
        first = None
        for n, (x, y) in enumerate(step):
            if n == 0:
                first = x
            step.backward(torch.nn.functional.mse_loss(model(x), y))
        # Within the step the buffers are the step's: a state copied out of a step that
        # is then aborted (to a joiner, to a try run whole) holds them as committed.
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(model.state_dict()[name], before.state_dict()[name]), name
        model.eval()  # an evaluation inside the step moves nothing
        with torch.no_grad():
            model(first)
        model.train()
        assert step.commit()
        with torch.no_grad():  # what the step's first micro-batch alone leaves
            before(first)
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(model.state_dict()[name], before.state_dict()[name]), name
    assert int(model[1].num_batches_tracked) == 3  # once a step, not once a micro-batch
    # Between steps, a forward in training mode updates them as it would anywhere.
    model(torch.randn(4, 4))
    assert int(model[1].num_batches_tracked) == 4
    session.close()


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_in_deterministic_mode_the_statistics_move_once_per_micro_batch(
        momentum: float | None) -> None:
    """Deterministic mode cuts a step the same at any world size, so the statistics move
    once per micro-batch of the cut, as BatchNorm moves them in the script alone: after
    each step, as a BatchNorm run over the step's micro-batches in order leaves them
    (to rounding: the session replays each micro-batch's own update), while within the
    step they stay the step's."""
    model = bn_model()
    model[1].momentum = momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ElasticSession(model, optimizer, data(), global_batch=BATCH,
                             micro_batch_size=MICRO, deterministic=True)
    for step in session.steps(3):
        before = bn_model()
        before[1].momentum = momentum
        before.load_state_dict(copy.deepcopy(model.state_dict()))
        inputs = []
        for x, y in step:
            inputs.append(x)
            step.backward(torch.nn.functional.mse_loss(model(x), y))
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(model.state_dict()[name], before.state_dict()[name]), name
        assert step.commit()
        with torch.no_grad():  # BatchNorm's own update, micro-batch after micro-batch
            for x in inputs:
                before(x)
        for name in ("1.running_mean", "1.running_var"):
            torch.testing.assert_close(model.state_dict()[name], before.state_dict()[name],
                                       rtol=1e-6, atol=1e-7)
        assert torch.equal(model[1].num_batches_tracked, before[1].num_batches_tracked)
    assert int(model[1].num_batches_tracked) == 9  # three micro-batches a step
    session.close()


def test_broadcast_buffers_false_keeps_every_micro_batchs_update_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    module = bn_model()
    wrapper = DistributedDataParallel(module, broadcast_buffers=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, "phalanx.runtime"):
        session = ElasticSession(wrapper, optimizer, data(), global_batch=BATCH,
                                 micro_batch_size=MICRO)
    assert "broadcast_buffers=False: each rank keeps its own buffers" in caplog.text
    for step in session.steps(2):
        for x, y in step:
            step.backward(torch.nn.functional.mse_loss(wrapper(x), y))
        assert step.commit()
    assert int(module[1].num_batches_tracked) == 6  # three micro-batches a step
    session.close()
