"""A ported DDP script's own parts under the session: its ``init_process_group``, its
``DDP(model)`` wrapper, its LR scheduler, and ``from_env``'s short form."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime import averaged, default_group, schedulers
from phalanx.runtime.ddp import QuietGroup
from phalanx.runtime.default_group import MembershipGroup
from phalanx.runtime.elastic import ElasticSession
from phalanx.schemas.errors import ConfigError

SAMPLES, BATCH = 24, 8


pytestmark = pytest.mark.usefixtures("no_default_group")


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator)
    return list(zip(x, torch.tanh(x[:, :2] * 3), strict=True))


def train(wrap: bool) -> tuple[torch.nn.Module, ElasticSession, torch.nn.Module]:
    """Two epochs of the DDP-shaped loop as a ported script runs it: its own default group
    (a world of one), its model wrapped in DDP when ``wrap``, its scheduler not registered."""
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                                 torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(module.parameters(), lr=5e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, 6)
    model = DistributedDataParallel(module) if wrap else module
    session = ElasticSession.from_env(model, optimizer, data(), BATCH, env={})
    for _ in session.epochs(2):
        for x, y in session.loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if not session.commit():
                continue
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
    session.close()
    return module, session, model


def test_a_ddp_wrapped_model_trains_as_the_module_alone_and_ddp_never_communicates() -> None:
    bare, _, _ = train(wrap=False)
    dist.destroy_process_group()
    module, session, wrapper = train(wrap=True)
    assert session.model is module  # the session trains the module inside
    for name, value in bare.state_dict().items():  # the buffers too: none broadcast
        assert torch.equal(module.state_dict()[name], value), name
    assert isinstance(wrapper, DistributedDataParallel)
    assert isinstance(wrapper.process_group, QuietGroup)
    # The script's gloo group is gone: the default group is the session's.
    assert dist.get_backend() == default_group.BACKEND
    # Accumulating under no_sync() is the session's: refused at the first batch, with the
    # fix (the script's count becomes 1, as in examples/cnn.py).
    with pytest.raises(RuntimeError, match=r"accumulates gradients itself.*fixed count.*"
                                           r"accumulation count to 1.*micro_batch_size="
                                           r".*PHALANX_MICRO_BATCH_SIZE"):
        wrapper.no_sync()
    # Armed again, DDP's reducer reaches the quiet group, which refuses by name.
    wrapper.require_backward_grad_sync = True
    with pytest.raises(RuntimeError, match="DistributedDataParallel's own all-reduce"):
        wrapper(torch.randn(3, 4)).sum().backward()


def script_group(world_size: int) -> None:
    """A default group of ``world_size`` ranks the script made (no peer needed: it is a
    rank and a size, under a backend that is not the session's)."""
    if not hasattr(dist.Backend, "SCRIPT"):
        dist.Backend.register_backend(
            "script", lambda store, rank, size, timeout: MembershipGroup(rank, size),
            devices=["cpu"])
    dist.init_process_group("script", store=dist.HashStore(), rank=0, world_size=world_size)


def test_the_session_takes_the_scripts_default_group_over() -> None:
    script_group(4)  # the first gang's, under phalanx
    default_group.take_over(alone=False)
    assert not dist.is_initialized()  # until the replica applies its first generation
    script_group(4)  # alone, a gang is not the session's: refused, and kept
    with pytest.raises(RuntimeError, match="default group has 4 ranks.*trains alone"):
        default_group.take_over(alone=True)
    assert dist.get_world_size() == 4
    dist.destroy_process_group()
    script_group(1)  # alone, a world of one is taken over
    default_group.take_over(alone=True)
    assert not dist.is_initialized()


def test_the_lr_scheduler_of_the_optimizer_is_carried_without_being_registered() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    others = torch.optim.lr_scheduler.StepLR(other, 5)  # another optimizer's: not carried
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, 3)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)
    sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], [3])
    # The outermost one, whose state holds its children's.
    alive = schedulers.alive(*schedulers.KINDS)
    assert schedulers.unregistered(optimizer, [], alive) == {"lr_scheduler": sequential}
    assert schedulers.unregistered(optimizer, [sequential], alive) == {}  # registered: its name
    session = ElasticSession(model, optimizer, data(), global_batch=BATCH)
    assert dict(session.carried) == {"lr_scheduler": sequential}
    session.close()
    named = ElasticSession(model, optimizer, data(), global_batch=BATCH,
                           state={"scheduler": sequential})
    assert dict(named.carried) == {"scheduler": sequential}
    named.close()
    assert others.optimizer is other


def test_finding_a_scheduler_raises_no_warning_of_torchs_own(
        recwarn: pytest.WarningsRecorder) -> None:
    """Looking at every object must not read attributes torch warns about: every rank
    printed ``torch.distributed.reduce_op is deprecated`` at its session's start."""
    assert dist.reduce_op is not None  # the deprecated object exists
    recwarn.clear()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    alive = schedulers.alive(*schedulers.KINDS)
    assert schedulers.unregistered(optimizer, [], alive) == {"lr_scheduler": step}
    assert [str(w.message) for w in recwarn] == []


def test_an_averaged_model_of_the_model_is_carried_without_being_registered() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # torchvision's recipe: an EMA that averages the buffers too.
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99),
        use_buffers=True)
    other = torch.optim.swa_utils.AveragedModel(torch.nn.Linear(2, 2))  # not this model's
    session = ElasticSession(model, optimizer, data(), global_batch=BATCH)
    assert dict(session.carried) == {averaged.NAME: ema}
    session.close()
    named = ElasticSession(model, optimizer, data(), global_batch=BATCH, state={"ema": ema})
    assert dict(named.carried) == {"ema": ema}
    named.close()
    del session, named, ema
    gc.collect()  # the sessions hold it in reference cycles
    # Built after the session, before its first step: found when the step starts.
    late_session = ElasticSession(model, optimizer, data(), global_batch=BATCH)
    assert dict(late_session.carried) == {}
    late = torch.optim.swa_utils.AveragedModel(model)
    next(late_session.steps(1))
    assert dict(late_session.carried) == {averaged.NAME: late}
    late_session.close()
    assert other.module.weight.shape == (2, 2)


def test_two_unregistered_averaged_models_are_refused_by_name() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = [torch.optim.swa_utils.AveragedModel(model) for _ in range(2)]
    with pytest.raises(ValueError, match=r"2 averaged models \(AveragedModel\) are not "
                                         r"registered: register each by name"):
        ElasticSession(model, optimizer, data(), global_batch=BATCH)
    session = ElasticSession(model, optimizer, data(), global_batch=BATCH,
                             state={"ema": kept[0]})
    assert dict(session.carried) == {"ema": kept[0], averaged.NAME: kept[1]}
    third = torch.optim.swa_utils.AveragedModel(model)
    with pytest.raises(ValueError, match="another AveragedModel than the one carried"):
        next(session.steps(1))
    session.close()
    assert third is not None


def test_two_unregistered_schedulers_are_refused_by_name() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = [torch.optim.lr_scheduler.StepLR(optimizer, 5),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)]
    with pytest.raises(ValueError, match=r"2 LR schedulers .*\(ExponentialLR, StepLR\)"):
        ElasticSession(model, optimizer, data(), global_batch=BATCH)
    assert len(kept) == 2


def test_from_env_takes_the_global_batch_and_the_micro_batch_of_the_job(
        tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ElasticSession.from_env(model, optimizer, data(), BATCH,
                                      env={"PHALANX_MICRO_BATCH_SIZE": "3"})
    assert (session.order.global_batch, session.micro_batch_size) == (BATCH, 3)
    session.close()
    session = ElasticSession.from_env(model, optimizer, data(), BATCH, micro_batch_size=2,
                                      env={"PHALANX_MICRO_BATCH_SIZE": "3"})
    assert session.micro_batch_size == 2  # the script's own wins
    session.close()
    for value in ("0", "x", "-2"):
        with pytest.raises(ConfigError, match="PHALANX_MICRO_BATCH_SIZE"):
            ElasticSession.from_env(model, optimizer, data(), BATCH,
                                    env={"PHALANX_MICRO_BATCH_SIZE": value})
