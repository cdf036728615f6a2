"""The DDP-shaped loop of the session (epochs, loader, backward, commit) outside phalanx."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.runtime.dataset import MemmapDataset, write_arrays
from phalanx.runtime.elastic import ElasticSession

SAMPLES, BATCH = 44, 8  # 6 steps an epoch, the last one partial


def dataset(tmp_path: Path) -> MemmapDataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 4), dtype=np.float32)
    return MemmapDataset(write_arrays(tmp_path / "data", {"x": x, "y": np.tanh(x[:, :2] * 3)}))


def parts(tmp_path: Path, deterministic: bool = False, micro: int | None = 3,
          **kwargs) -> tuple[ElasticSession, torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, 18)
    session = ElasticSession(model, optimizer, dataset(tmp_path), global_batch=BATCH,
                             micro_batch_size=micro, deterministic=deterministic,
                             state={"scheduler": scheduler}, **kwargs)
    return session, model, optimizer, scheduler


def ddp_shaped(session: ElasticSession, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, scheduler, epochs: int,
               plain: bool = False) -> list[tuple]:
    """A DDP loop as users write it: zero_grad before backward, torch's clip after it
    (``plain``: the script's own ``loss.backward()``, else ``session.backward(loss)``)."""
    seen = []
    for epoch in session.epochs(epochs):
        for x, y in session.loader:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if plain:
                loss.backward()
            else:
                session.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if not session.commit():
                continue
            scheduler.step()
        seen.append((epoch, session.committed))  # after the epoch's last step
    session.close()
    return seen


def step_shaped(session: ElasticSession, model: torch.nn.Module, scheduler,
                steps: int) -> None:
    for step in session.steps(steps):
        for x, y in step:
            step.backward(torch.nn.functional.mse_loss(model(x), y))
        step.clip_grad_norm_(0.05)
        if step.commit():
            scheduler.step()
    session.close()


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_ddp_shaped_loop_is_bitwise_the_step_loop_with_the_gradient_safe_between_batches(
        tmp_path: Path, deterministic: bool) -> None:
    # 3 micro-batches a step: zero_grad and a clip on the first two must not touch the
    # step's gradient, and the clip after the last one acts on the whole (reduced) gradient.
    a = parts(tmp_path, deterministic)
    ddp_shaped(*a, epochs=3)
    b = parts(tmp_path, deterministic)
    step_shaped(b[0], b[1], b[3], 3 * a[0].order.steps_per_epoch)
    for p, q in zip(a[1].parameters(), b[1].parameters(), strict=True):
        assert torch.equal(p, q)
    assert a[3].state_dict() == b[3].state_dict()
    c = parts(tmp_path, deterministic, micro=BATCH)  # one batch a step: the same model
    ddp_shaped(*c, epochs=3)
    for p, q in zip(a[1].parameters(), c[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_each_epoch_ends_after_its_last_step_and_every_sample_is_trained_once_an_epoch(
        tmp_path: Path) -> None:
    session, model, optimizer, scheduler = parts(tmp_path, record_dir=str(tmp_path / "rec"))
    per_epoch = session.order.steps_per_epoch
    assert ddp_shaped(session, model, optimizer, scheduler, 3) == [
        (0, per_epoch), (1, 2 * per_epoch), (2, 3 * per_epoch)]
    assert scheduler.last_epoch == 3 * per_epoch  # stepped once per committed step
    records = record.read(tmp_path / "rec")
    assert record.verify(records, ElasticOrder(SAMPLES, BATCH), 3 * per_epoch) == []


def test_drop_last_makes_an_epoch_as_long_as_ddps_loader_and_trains_its_samples_once(
        tmp_path: Path) -> None:
    # The DDP script's loader on 4 ranks, and a one-cycle schedule sized by it (stepped
    # once too often, it raises): 44 samples, 2 a rank, the last 4 dropped.
    data = dataset(tmp_path)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=4, rank=0,
                                                  drop_last=True)
    ddp_loader = torch.utils.data.DataLoader(data, BATCH // 4, sampler=sampler,
                                             drop_last=True)
    assert len(ddp_loader) == SAMPLES // BATCH == 5
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1,
                                                    total_steps=3 * len(ddp_loader))
    session = ElasticSession(model, optimizer, data, global_batch=BATCH, drop_last=True,
                             record_dir=str(tmp_path / "rec"))
    assert ddp_shaped(session, model, optimizer, scheduler, 3) == [(0, 5), (1, 10), (2, 15)]
    records = record.read(tmp_path / "rec")
    order = ElasticOrder(SAMPLES, BATCH, drop_last=True)
    assert record.verify(records, order, 15) == []
    trained = [i for lines in records.values() for line in lines if line["kind"] == "batch"
               for i in line["indices"]]
    assert len(trained) == 3 * len(ddp_loader) * BATCH  # DDP's count: 40 an epoch
    for epoch in range(3):
        assert len(set(trained[epoch * 40:(epoch + 1) * 40])) == 40


def test_commit_and_clip_answer_per_batch_and_the_last_batch_commits(tmp_path: Path) -> None:
    session, model, _, _ = parts(tmp_path, micro=3)  # batches of 3, 3, 2 a step
    answers = []
    for _ in session.epochs(1):
        for x, y in session.loader:
            session.backward(torch.nn.functional.mse_loss(model(x), y))
            norm = session.clip_grad_norm_(1.0)
            answers.append((len(x), norm is not None, session.commit()))
    assert answers[:3] == [(3, False, False), (3, False, False), (2, True, True)]
    assert len(answers) == 3 * (session.order.steps_per_epoch - 1) + 2  # the last: 4 samples


def test_misuses_of_the_loop_are_refused_by_name(tmp_path: Path) -> None:
    session, model, _, _ = parts(tmp_path)
    loss = torch.nn.functional.mse_loss(model(torch.zeros(1, 4)), torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="belongs in the loop over session.loader"):
        session.backward(loss)
    with pytest.raises(RuntimeError, match="follows the batch's loss.backward"):
        session.commit()
    with pytest.raises(RuntimeError, match="inside `for epoch in session.epochs"):
        next(iter(session.loader))
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        next(session.epochs(0))

    epochs = session.epochs(2)
    next(epochs)
    batches = iter(session.loader)
    x, y = next(batches)
    with pytest.raises(RuntimeError, match="follows the batch's loss.backward"):
        session.commit()
    with pytest.raises(RuntimeError, match="call loss.backward"):
        next(batches)
    with pytest.raises(RuntimeError, match="runs once per session"):
        next(session.epochs(2))

    session, model, _, _ = parts(tmp_path, micro=None)  # one batch a step
    epochs = session.epochs(2)
    next(epochs)
    batches = iter(session.loader)
    x, y = next(batches)
    session.backward(torch.nn.functional.mse_loss(model(x), y))
    with pytest.raises(RuntimeError, match="step 0 was not committed"):
        next(batches)
    assert session.commit()
    with pytest.raises(RuntimeError, match="step 0 was committed already"):
        session.commit()
    with pytest.raises(RuntimeError, match="left epoch 0 at step 0"):
        next(epochs)  # the loop over the loader left the epoch after one step


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_scripts_own_loss_backward_trains_as_session_backward_does(
        tmp_path: Path, deterministic: bool) -> None:
    # The hooks weight each micro-batch's gradient where session.backward weights its loss:
    # the same sums, rounded at another point, so close rather than bitwise; and the plain
    # form is as deterministic as the other (the same run twice is bitwise the same).
    runs = []
    for plain in (False, True, True):
        session, model, optimizer, scheduler = parts(
            tmp_path, deterministic, record_dir=str(tmp_path / f"rec{len(runs)}"))
        ddp_shaped(session, model, optimizer, scheduler, 3, plain=plain)
        runs.append((model, scheduler))
    (told, told_scheduler), (plain, plain_scheduler), (again, _) = runs
    for p, q, r in zip(told.parameters(), plain.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert torch.equal(q, r)
    assert told_scheduler.state_dict() == plain_scheduler.state_dict()
    # The records say what each step trained on either way; only a told loss is recorded.
    told_lines, plain_lines = (record.read(tmp_path / rec) for rec in ("rec0", "rec1"))
    order = ElasticOrder(SAMPLES, BATCH)
    steps = 3 * order.steps_per_epoch
    assert record.verify(plain_lines, order, steps) == []
    batches = [[line for lines in replicas.values() for line in lines
                if line["kind"] == "batch"] for replicas in (told_lines, plain_lines)]
    assert all(line["loss"] > 0 for line in batches[0])
    assert all(line["loss"] is None for line in batches[1])
    assert len(batches[0]) == len(batches[1]) == steps


def test_a_second_backward_of_a_batch_and_a_backward_within_a_backward_are_refused(
        tmp_path: Path) -> None:
    session, model, _, _ = parts(tmp_path, micro=3)
    # Outside the loop the script's passes are its own: nothing weighted, nothing held.
    outside = torch.ones(2, 4), torch.zeros(2, 2)
    torch.nn.functional.mse_loss(model(outside[0]), outside[1]).backward()
    alone = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for _ in session.epochs(1):
        for x, y in session.loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="a backward with no batch awaiting one"):
                loss.backward()
            break
        break
    session.close()
    model.zero_grad()
    torch.nn.functional.mse_loss(model(outside[0]), outside[1]).backward()  # hooks are gone
    assert all(torch.equal(p.grad, a) for p, a in zip(model.parameters(), alone, strict=True))

    session, model, _, _ = parts(tmp_path, micro=3)
    for _ in session.epochs(1):
        for x, y in session.loader:
            first, second = model[0], torch.nn.Sequential(model[1], model[2])
            hidden = torch.utils.checkpoint.checkpoint(first, x.requires_grad_(),
                                                       use_reentrant=True)
            out = torch.utils.checkpoint.checkpoint(second, hidden, use_reentrant=True)
            with pytest.raises(RuntimeError, match="use_reentrant=False"):
                torch.nn.functional.mse_loss(out, y).backward()
            break
        break


def test_non_reentrant_activation_checkpointing_trains_as_without(tmp_path: Path) -> None:
    models = []
    for checkpointed in (False, True):
        session, model, _, _ = parts(tmp_path, micro=3)
        for _ in session.epochs(1):
            for x, y in session.loader:
                out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) \
                    if checkpointed else model(x)
                torch.nn.functional.mse_loss(out, y).backward()
                if not session.commit():
                    continue
        session.close()
        models.append(model)
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(p, q)
