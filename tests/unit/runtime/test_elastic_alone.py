"""The elastic session outside phalanx (world size 1), its data, and its configuration."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.runtime.dataset import MemmapDataset, write_arrays
from phalanx.runtime.elastic import ElasticSession, JobCompletedWithoutThisReplica
from phalanx.schemas.errors import ConfigError


def dataset(tmp_path: Path, n: int = 40) -> MemmapDataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4), dtype=np.float32)
    return MemmapDataset(write_arrays(tmp_path / "data", {"x": x, "y": x[:, :2] * 2}))


def train(data, *, deterministic: bool, steps: int = 12, micro: int = 3,
          record_dir: Path | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = ElasticSession.from_env(
        model, optimizer, data, env={"PHALANX_RECORD_DIR": str(record_dir or "")},
        global_batch=8, micro_batch_size=micro, deterministic=deterministic)
    for step in session.steps(steps):
        loss = 0.0
        for (x, y), weight in step.batches():
            micro_loss = torch.nn.functional.mse_loss(model(x), y) * weight
            micro_loss.backward()
            loss += micro_loss.item()
        assert step.commit(loss=loss)
    session.close()
    return model


def test_alone_it_trains_every_sample_once_per_epoch_and_records_it(tmp_path: Path) -> None:
    data = dataset(tmp_path)
    train(data, deterministic=False, record_dir=tmp_path / "rec")
    records = record.read(tmp_path / "rec")
    assert list(records) == ["local"]
    assert record.verify(records, ElasticOrder(40, 8), 12) == []
    losses = [s.loss for s in record.timeline(records)]
    assert losses[-1] < losses[0]


def test_deterministic_mode_gives_the_same_model_as_one_big_batch(tmp_path: Path) -> None:
    data = dataset(tmp_path)
    a = train(data, deterministic=True, micro=3)
    b = train(data, deterministic=True, micro=3)
    c = train(data, deterministic=False, micro=8)
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_a_step_that_is_not_committed_is_an_error(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    session = ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             dataset(tmp_path), global_batch=8)
    steps = session.steps(3)
    next(steps)
    with pytest.raises(RuntimeError, match="step 0 was not committed"):
        next(steps)


def test_alone_the_replica_is_the_primary(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    session = ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             dataset(tmp_path), global_batch=8)
    assert (session.rank, session.world_size, session.is_primary) == (0, 1, True)


def test_a_process_events_never_share_an_id_with_another_process_of_that_replica(
        tmp_path: Path) -> None:
    """A requeued job's next admission runs r0-0 again, at generation 0 again: the stream
    would drop its events as the first admission's repeats (tests/e2e/test_requeue.py)."""
    sessions = []
    for _ in range(2):
        model = torch.nn.Linear(4, 2)
        sessions.append(ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       dataset(tmp_path), global_batch=8, job_id="j",
                                       replica_id="r0-0"))
    first, second = (session.replica for session in sessions)
    assert first.event_id("ready") == first.event_id("ready")  # its repeats: stored once
    assert first.event_id("ready") != second.event_id("ready")
    assert first.event_id("g0-applied") != second.event_id("g0-applied")
    for session in sessions:
        session.close()


def test_a_replica_the_job_completed_without_exits_with_status_0_past_except_exception() -> None:
    completed = JobCompletedWithoutThisReplica("j", "r1-1", 700)
    assert isinstance(completed, SystemExit) and completed.code == 0
    assert not isinstance(completed, Exception)  # a script's `except Exception` lets it pass
    assert str(completed) == "j completed (step 700) before r1-1 became a member: it holds " \
        "no trained state"


@pytest.mark.parametrize("value", ["r0-0:5", "r0-0:x:boundary", "r0-0:5:middle"])
def test_a_malformed_chaos_kill_is_refused_by_name(tmp_path: Path, value: str) -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="PHALANX_CHAOS_KILL"):
        ElasticSession.from_env(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                dataset(tmp_path), global_batch=8,
                                env={"PHALANX_JOB_ID": "j", "PHALANX_NATS_URL": "nats://x:1",
                                     "PHALANX_CHAOS_KILL": value})


def test_a_dataset_is_written_once_and_opened_by_memory_map(tmp_path: Path) -> None:
    data = dataset(tmp_path, n=10)
    assert len(data) == 10 and data.fields == ["x", "y"]
    x, y = data[3]
    assert x.shape == (4,) and torch.equal(y, x[:2] * 2)
    xs, _ = data.batch([1, 3, 5])
    assert xs.shape == (3, 4) and torch.equal(xs[1], x)
    assert isinstance(data.arrays[0], np.memmap)


def test_bad_datasets_are_refused_naming_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a prepared dataset"):
        MemmapDataset(tmp_path / "nothing")
    with pytest.raises(ValueError, match="same number of samples"):
        write_arrays(tmp_path / "d", {"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="not an identifier"):
        write_arrays(tmp_path / "d", {"a b": np.zeros(3)})
    with pytest.raises(ValueError, match="at least one field"):
        write_arrays(tmp_path / "d", {})


def test_the_public_api_is_exported_from_phalanx_runtime() -> None:
    import phalanx.runtime as runtime
    from phalanx.runtime import elastic

    for name in ("ElasticSession", "Step", "MembershipChange",
                 "JobCompletedWithoutThisReplica"):
        assert getattr(runtime, name) is getattr(elastic, name)
    assert runtime.MemmapDataset is MemmapDataset and runtime.write_arrays is write_arrays
    assert runtime.ElasticOrder is ElasticOrder
    assert set(runtime.__all__) <= set(dir(runtime))


def session_of(tmp_path: Path, **kwargs) -> tuple[ElasticSession, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("micro_batch_size", 3)
    return ElasticSession(model, optimizer, dataset(tmp_path), global_batch=8,
                          **kwargs), model


def test_step_backward_weights_the_micro_batch_and_the_loss_is_the_whole_batchs(
        tmp_path: Path) -> None:
    weighted, model = session_of(tmp_path, metrics=("samples",))
    raw, raw_model = session_of(tmp_path)
    for step, raw_step in zip(weighted.steps(6), raw.steps(6), strict=True):
        for x, y in step:
            step.backward(torch.nn.functional.mse_loss(model(x), y))
            step.add("samples", len(x))
        for (x, y), weight in raw_step.batches():
            (torch.nn.functional.mse_loss(raw_model(x), y) * weight).backward()
        assert step.reduce() and step.commit() and raw_step.commit()
        assert step.metrics == {"samples": 8.0}
        assert step.loss is not None and step.loss > 0
    for p, q in zip(model.parameters(), raw_model.parameters(), strict=True):
        assert torch.equal(p, q)  # the same update as the raw form


def test_step_loss_is_the_mean_loss_over_the_global_batch(tmp_path: Path) -> None:
    session, model = session_of(tmp_path)
    step = next(session.steps(1))
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in step:
        step.backward(torch.nn.functional.mse_loss(model(x), y))
    step.commit()
    x, y = session.dataset.batch(step.indices)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(torch.nn.functional.linear(x, *before), y)
    assert step.loss == pytest.approx(float(expected), rel=1e-6)


def test_misuses_of_a_step_are_refused_by_name(tmp_path: Path) -> None:
    session, model = session_of(tmp_path, metrics=("tokens",))
    step = next(session.steps(2))
    with pytest.raises(RuntimeError, match="inside the loop"):
        step.backward(model(torch.zeros(1, 4)).sum())
    with pytest.raises(KeyError, match="not declared"):
        step.add("accuracy", 1.0)
    with pytest.raises(RuntimeError, match="after reduce"):
        step.skip()  # decided before the gradients are reduced: ranks could disagree
    for x, y in step:
        step.backward(torch.nn.functional.mse_loss(model(x), y))
    assert step.reduce()
    with pytest.raises(ValueError, match="reduced already"):
        step.commit(loss=1.0)
    with pytest.raises(ValueError, match="distinct names other than 'loss'"):
        session_of(tmp_path, metrics=("loss",))


def test_a_skipped_step_commits_without_an_update(tmp_path: Path) -> None:
    session, model = session_of(tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    for step in session.steps(1):
        for x, y in step:
            step.backward(torch.nn.functional.mse_loss(model(x), y) * float("inf"))
        norm = step.clip_grad_norm_(1.0)
        assert norm is not None and not torch.isfinite(norm) and not step.updated
        assert step.commit()
    assert session.committed == 1
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_clipping_acts_on_the_step_gradient_whatever_the_micro_batches(tmp_path: Path) -> None:
    """Alone, a clip to 1e-3 and one to 1e9 differ; and clipping the accumulated gradient
    gives what clipping the whole batch's gradient in one pass gives."""
    def run(max_norm: float, micro: int) -> list[torch.Tensor]:
        session, model = session_of(tmp_path, deterministic=True, micro_batch_size=micro)
        for step in session.steps(4):
            for x, y in step:
                step.backward(torch.nn.functional.mse_loss(model(x), y))
            step.clip_grad_norm_(max_norm)
            assert step.commit()
        return [p.detach().clone() for p in model.parameters()]

    tight, loose = run(1e-3, 3), run(1e9, 3)
    assert not torch.equal(tight[0], loose[0])
    for a, b in zip(tight, run(1e-3, 8), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_loss_scaler_unscales_the_reduced_gradient_and_an_overflow_skips_the_step(
        tmp_path: Path) -> None:
    """torch.amp.GradScaler where a DDP user puts it: the scaled loss through
    ``step.backward``, ``unscale_`` after the reduce, clipping (which skips a step whose
    gradient overflowed), ``update`` after a committed step. A power-of-two scale is
    undone exactly, so the run equals the one without a scaler, the overflowed step
    skipped in both, and the scale halved once."""
    def run(enabled: bool) -> tuple[list[torch.Tensor], float]:
        session, model = session_of(tmp_path)
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        session.register("scaler", scaler)
        for step in session.steps(6):
            for x, y in step:
                loss = torch.nn.functional.mse_loss(model(x), y)
                step.backward(scaler.scale(loss * (float("inf") if step.index == 2 else 1.0)))
            if step.reduce():
                scaler.unscale_(session.optimizer)
                step.clip_grad_norm_(1e9)
                assert step.updated is (step.index != 2)
            if step.commit():
                scaler.update()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    (scaled, scale), (plain, _) = run(True), run(False)
    assert scale == 2.0 ** 15  # the default 2 ** 16, halved by the one overflow
    for a, b in zip(scaled, plain, strict=True):
        assert torch.equal(a, b)


def test_registered_state_is_checked_and_fixed_at_the_first_step(tmp_path: Path) -> None:
    session, model = session_of(tmp_path)
    scheduler = torch.optim.lr_scheduler.StepLR(session.optimizer, 2)
    session.register("scheduler", scheduler)
    with pytest.raises(ValueError, match="registered already"):
        session.register("scheduler", scheduler)
    with pytest.raises(TypeError, match="no state_dict"):
        session.register("lr", 0.1)
    next(session.steps(1))
    with pytest.raises(ValueError, match="before the first step"):
        session.register("ema", torch.optim.swa_utils.AveragedModel(model))


def test_the_session_is_a_context_manager_that_closes(tmp_path: Path) -> None:
    def record_open() -> bool:
        return any(os.readlink(fd).startswith(str(tmp_path / "rec"))
                   for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink())

    with session_of(tmp_path, record_dir=str(tmp_path / "rec"))[0]:
        assert record_open()
    assert not record_open()


def test_a_token_stream_is_read_as_windows_and_their_next_tokens(tmp_path: Path) -> None:
    from phalanx.runtime import TokenWindows, write_tokens

    text = np.frombuffer(b"to be, or not to be: that is the question", dtype=np.uint8)
    write_tokens(tmp_path / "t", text, 256)
    windows = TokenWindows(tmp_path / "t", 8)
    assert len(windows) == (len(text) - 1) // 8 == 5
    assert np.load(tmp_path / "t" / "tokens.npy").dtype == np.uint8
    x, y = windows.batch([2, 0])
    assert x.dtype == torch.int64 and x.shape == y.shape == (2, 8)
    assert bytes(x[1].tolist()) == b"to be, o" and bytes(y[1].tolist()) == b"o be, or"
    assert bytes(x[0].tolist()) == text[16:24].tobytes()
    assert torch.equal(windows[2][1], y[0])
    with pytest.raises(IndexError, match="outside 0..4"):
        windows.batch([5])
    with pytest.raises(ValueError, match="0..99"):
        write_tokens(tmp_path / "u", [1, 100], 100)
    write_tokens(tmp_path / "w", [1, 300], 50_000)
    assert np.load(tmp_path / "w" / "tokens.npy").dtype == np.uint16


class Squares(torch.utils.data.Dataset):
    """Map-style, without batch(): read sample by sample, as most datasets are."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(1)
        self.x = torch.from_numpy(rng.standard_normal((n, 4), dtype=np.float32))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.x[index, :2] ** 2, "i": torch.tensor(index)}


def stacked(samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack([s[k] for s in samples]) for k in ("x", "y", "i"))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_without_batch_is_read_by_the_dataloader_with_the_users_options(
        tmp_path: Path, workers: int) -> None:
    def run(loader: dict | None) -> tuple[list[torch.Tensor], list[list[int]]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        session = ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 Squares(40), global_batch=8, micro_batch_size=3,
                                 deterministic=True, loader=loader)
        seen = []
        with session:  # its end stops the loader's workers
            for step in session.steps(10):
                for x, y, i in step:
                    step.backward(torch.nn.functional.mse_loss(model(x), y))
                    seen.append(i.tolist())
                assert step.commit()
            if loader and loader.get("num_workers"):
                assert multiprocessing.active_children()  # persistent, until the end
        assert not multiprocessing.active_children()  # the end stopped them
        return [p.detach().clone() for p in model.parameters()], seen

    params, seen = run({"num_workers": workers, "collate_fn": stacked})
    order = ElasticOrder(40, 8)
    expected = [list(mb.indices) for s in range(10)
                for mb in order.plan(*divmod(s, order.steps_per_epoch), 1, 0, 3, aligned=True)]
    assert seen == expected  # the session's exactly-once order, whatever the workers do
    reference, _ = run({"collate_fn": stacked})
    for p, q in zip(params, reference, strict=True):
        assert torch.equal(p, q)


def test_the_session_owns_the_sampling_options(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"decides \['batch_size', 'shuffle'\]"):
        ElasticSession(model, torch.optim.SGD(model.parameters(), lr=0.1), Squares(8),
                       global_batch=4, loader={"shuffle": True, "batch_size": 2})
