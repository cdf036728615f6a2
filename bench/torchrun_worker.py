"""The torchrun baseline of the recovery benchmark: plain DDP training of workload W.

Run by ``torch.distributed.run`` (one process per rank; ``bench/recovery_baseline.py``
launches it). Each rank trains workload W (``examples/workload_w.py``) with DDP over
gloo and AdamW, global batch 64 split in contiguous shares by
:class:`phalanx.runtime.data.ElasticOrder`, MSE loss. Steps are counted 1..N; after
every ``--ckpt-every``-th committed step the group saves a DCP checkpoint
(``torch.distributed.checkpoint``) into ``<ckpt-dir>/step-<n>``: all ranks write
into ``step-<n>.partial``, and rank 0 renames it to ``step-<n>`` after a barrier,
so a kill mid-save never leaves a directory that looks complete. On start (and
on every torchrun restart) the workers load the newest complete checkpoint and
continue at the step after it.

Each rank appends JSON lines ``{"step", "t", "attempt", "phase", ...}`` to
``<record-dir>/rank-<r>.jsonl`` (``attempt`` = ``TORCHELASTIC_RESTART_COUNT``):

* ``start``: the first statement of the script, before any import;
* ``torch``: ``import torch`` done;
* ``imported``: everything else imported too (``torch.distributed``, workload W, phalanx);
* ``process_group``: the gloo process group is up (rendezvous with the peers);
* ``built``: model, DDP (which broadcasts rank 0's parameters) and optimizer built;
* ``loaded``: the checkpoint is loaded (``step`` = its step, 0 if there was none);
* ``step``: step ``step`` is committed (after ``optimizer.step()``);
* ``saved``: the checkpoint of step ``step`` is complete;
* ``kill``: this rank is about to SIGKILL itself (fault injection);
* ``done``: all ranks have finished the last step (and its checkpoint, if due).

Fault injection, on the first attempt only, with ``BASELINE_KILL="<rank>:<step>:<phase>"``:

* ``between``: rank ``<rank>`` kills itself once step ``<step>-1`` is committed,
  recorded and, if due, checkpointed, before it reads step ``<step>``'s batch;
  the other ranks then block in step ``<step>``'s gradient all-reduce.
* ``allreduce``: rank ``<rank>`` kills itself while its gradient all-reduce of
  step ``<step>`` is in flight: a DDP comm hook starts the default all-reduce of
  a bucket, waits ``KILL_DELAY_S`` and kills the process if the all-reduce has
  not completed yet (else it tries again on the next bucket, and kills anyway
  after the last one). The ``kill`` record carries ``bucket`` and ``in_flight``
  to show where it landed; with workload W's widths it is always in flight.
"""

# The clock is read before the imports, which are part of what it times.
# ruff: noqa: E402
# No ``from __future__ import annotations``: DDP checks the comm hook's annotations
# against the real types.
import time

STARTED = time.time()

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

TORCH_IMPORTED = time.time()

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import workload_w

from phalanx.runtime.data import ElasticOrder
from phalanx.runtime.dataset import MemmapDataset

IMPORTED = time.time()

KILL_PHASES = ("between", "allreduce")
KILL_DELAY_S = 0.005
PARTIAL = ".partial"


class Recorder:
    """Appends this rank's JSON lines, unbuffered, so a SIGKILL loses none of them."""

    def __init__(self, record_dir: Path, rank: int, attempt: int) -> None:
        record_dir.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt
        self.file: TextIO = open(record_dir / f"rank-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115

    def __call__(self, phase: str, step: int | None = None, t: float | None = None,
                 **extra: Any) -> None:
        line = {"step": step, "t": time.time() if t is None else t,
                "attempt": self.attempt, "phase": phase, **extra}
        self.file.write(json.dumps(line) + "\n")


@dataclasses.dataclass
class KillState:
    """The state of :func:`kill_hook`: the training loop sets ``step`` before each backward."""

    record: Recorder
    kill_step: int | None
    step: int = 0


def kill_hook(state: KillState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the default all-reduce, and the ``allreduce`` fault injection.

    The process SIGKILLs itself in the first bucket of step ``kill_step`` whose
    all-reduce is still in flight ``KILL_DELAY_S`` after it was started, or in the
    last bucket if every all-reduce was quicker (only with tiny models).
    """
    future = default_hooks.allreduce_hook(None, bucket)
    if state.step == state.kill_step:
        time.sleep(KILL_DELAY_S)
        in_flight = not future.done()
        if in_flight or bucket.is_last():
            state.record("kill", state.step, bucket=bucket.index(), in_flight=in_flight)
            os.kill(os.getpid(), signal.SIGKILL)
    return future


def parse_kill(spec: str, rank: int, attempt: int) -> tuple[int | None, str]:
    """This rank's kill step and phase from ``BASELINE_KILL`` (step None: no fault here)."""
    if not spec or attempt != 0:
        return None, ""
    kill_rank, kill_step, phase = spec.split(":")
    if phase not in KILL_PHASES:
        raise ValueError(f"BASELINE_KILL phase must be one of {KILL_PHASES}, got {phase!r}")
    return (int(kill_step), phase) if int(kill_rank) == rank else (None, "")


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path | None]:
    """The step and directory of the newest complete checkpoint, (0, None) if none."""
    steps = [(int(p.name.removeprefix("step-")), p) for p in ckpt_dir.glob("step-*")
             if p.is_dir() and not p.name.endswith(PARTIAL)]
    return max(steps, default=(0, None))


def save_checkpoint(ckpt_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    """Save the group's checkpoint of ``step`` synchronously; a collective."""
    partial = ckpt_dir / f"step-{step}{PARTIAL}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        partial.rename(ckpt_dir / f"step-{step}")
    dist.barrier()


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint saved by :func:`save_checkpoint` into model and optimizer."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--widths", type=lambda s: tuple(int(w) for w in s.split(",")),
                        default=workload_w.W_WIDTHS)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--record-dir", type=Path, required=True)
    parser.add_argument("--ckpt-every", type=int, default=10)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = Recorder(args.record_dir, rank, attempt)
    record("start", t=STARTED)
    record("torch", t=TORCH_IMPORTED)
    record("imported", t=IMPORTED)
    kill_step, kill_phase = parse_kill(os.environ.get("BASELINE_KILL", ""), rank, attempt)
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    record("process_group")

    dataset = MemmapDataset(args.data_dir)
    order = ElasticOrder(len(dataset), workload_w.W_GLOBAL_BATCH, seed=0)
    model = DistributedDataParallel(workload_w.build_model(args.widths))
    hook = KillState(record, kill_step if kill_phase == "allreduce" else None)
    model.register_comm_hook(hook, kill_hook)
    optimizer = workload_w.build_optimizer(model)
    record("built")

    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    done, path = latest_checkpoint(args.ckpt_dir)
    if path is not None:
        load_checkpoint(path, model, optimizer)
    record("loaded", done)

    epoch_orders: dict[int, list[int]] = {}
    for step in range(done + 1, args.steps + 1):
        if kill_phase == "between" and step == kill_step:
            record("kill", step)
            os.kill(os.getpid(), signal.SIGKILL)
        epoch, index = divmod(step - 1, order.steps_per_epoch)
        if epoch not in epoch_orders:
            epoch_orders = {epoch: order.epoch_order(epoch)}
        (micro,) = order.plan(epoch, index, world, rank, micro_batch_size=order.global_batch,
                              order=epoch_orders[epoch])
        inputs, targets = dataset.batch(micro.indices)
        # DDP averages gradients over the ranks: scaling by weight * world makes the
        # result the gradient of the mean loss over the global batch.
        loss = torch.nn.functional.mse_loss(model(inputs), targets) * micro.weight * world
        optimizer.zero_grad(set_to_none=True)
        hook.step = step
        loss.backward()
        optimizer.step()
        record("step", step, loss=loss.item() / (micro.weight * world))
        if step % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step, model, optimizer)
            record("saved", step)

    # Every rank is done (and the checkpoint complete) after this barrier. Exit without
    # tearing down: gloo's process-group destructor can hang joining its threads once
    # the peers are gone (seen on rank 0 with torch 2.13), and nothing is left to flush.
    dist.barrier()
    record("done", args.steps)
    os._exit(0)


if __name__ == "__main__":
    main()
