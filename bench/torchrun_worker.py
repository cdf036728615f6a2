"""The torchrun baseline of the recovery benchmark: plain DDP training of W or the GPT example.

Run by ``torch.distributed.run`` (one process per rank; ``bench/recovery_baseline.py``
launches it). Each rank trains with DDP over gloo (``--device cuda``: the GPT on GPU
``LOCAL_RANK`` over NCCL, for bench/gpu.py), one of two workloads:

* ``--workload w`` (default): workload W (``examples/workload_w.py``), AdamW, global
  batch 64 split in contiguous shares by :class:`phalanx.runtime.data.ElasticOrder`,
  MSE loss; options ``--steps --widths --samples --data-dir``.
* ``--workload gpt``: the plain DDP loop of ``examples/train_gpt.py``, with its model,
  AdamW groups and warmup + cosine schedule imported from it and the same options
  (``--data-dir``, ``--layers``, ``--global-batch``, ``--micro-batch`` ...): a
  ``DistributedSampler`` feeding a ``DataLoader`` of micro-batches, gradient
  accumulation under ``no_sync``, ``clip_grad_norm_(1.0)``, ``optimizer.step()``,
  ``scheduler.step()`` — the loop docs/runtime.md starts its diff from. The LR
  scheduler is checkpointed with the model and optimizer.
* ``--workload hsdp``: the same GPT loop as plain FSDP2 HSDP, as
  ``examples/chargpt_hsdp_torchrun.py`` shards it: a 2-D device mesh ``replicate`` x
  ``shard`` (``world / --shard`` groups of ``--shard`` ranks) and
  ``chargpt_model.shard`` (``fully_shard`` per block and on the model), gradient sync
  turned off but for the last micro-batch. Its DCP checkpoint is sharded: each rank
  writes its own shards.

Steps are counted 1..N; after
every ``--ckpt-every``-th committed step (0: never) the group saves a DCP checkpoint
(``torch.distributed.checkpoint``) into ``<ckpt-dir>/step-<n>``: all ranks write
into ``step-<n>.partial``, and rank 0 renames it to ``step-<n>`` after a barrier,
so a kill mid-save never leaves a directory that looks complete. On start (and
on every torchrun restart) the workers load the newest complete checkpoint and
continue at the step after it. ``--ckpt-keep N`` deletes all but the newest N
complete checkpoints after each save (bench/goodput.py saves every few seconds);
``--pg-timeout`` bounds every collective, so that a hung peer fails the group and
torchrun restarts it (torch's default would wait 30 min).

Each rank appends JSON lines ``{"step", "t", "attempt", "phase", ...}`` to
``<record-dir>/rank-<r>.jsonl`` (``attempt`` = ``TORCHELASTIC_RESTART_COUNT``):

* ``start``: the first statement of the script, before any import;
* ``torch``: ``import torch`` done;
* ``imported``: everything else imported too (``torch.distributed``, the workloads, phalanx);
* ``process_group``: the gloo process group is up (rendezvous with the peers);
* ``built``: model, DDP (which broadcasts rank 0's parameters) and optimizer built;
* ``loaded``: the checkpoint is loaded (``step`` = its step, 0 if there was none);
* ``step``: step ``step`` is committed (after ``optimizer.step()``), with the
  process's CPU time so far (``process_cpu_s``);
* ``saved``: the checkpoint of step ``step`` is complete;
* ``kill``: this rank is about to SIGKILL itself (fault injection);
* ``done``: all ranks have finished the last step (and its checkpoint, if due), with
  the process's peak resident memory (``peak_rss_kb``: ``VmHWM`` of /proc/self/status).

Fault injection, on the first attempt only, with ``BASELINE_KILL="<rank>:<step>:<phase>"``:

* ``between``: rank ``<rank>`` kills itself once step ``<step>-1`` is committed,
  recorded and, if due, checkpointed, before it reads step ``<step>``'s batch;
  the other ranks then block in step ``<step>``'s gradient all-reduce.
* ``allreduce``: rank ``<rank>`` kills itself while its gradient all-reduce of
  step ``<step>`` is in flight: a DDP comm hook starts the default all-reduce of
  a bucket, waits ``KILL_DELAY_S`` and kills the process if the all-reduce has
  not completed yet (else it tries again on the next bucket, and kills anyway
  after the last one). The ``kill`` record carries ``bucket`` and ``in_flight``
  to show where it landed; with workload W's widths it is always in flight. With
  ``hsdp`` (no DDP) the rank kills itself in step ``<step>``'s backward, when FSDP2
  has all-reduced the last block's gradient shards across the replicas (its
  all-reduce hook): the other blocks' reductions are still to come.
"""

# The clock is read before the imports, which are part of what it times.
# ruff: noqa: E402
# No ``from __future__ import annotations``: DDP checks the comm hook's annotations
# against the real types.
import time

STARTED = time.time()

import argparse
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, cast

import torch

TORCH_IMPORTED = time.time()

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from phalanx.bench.recovery_baseline import peak_rss_kb
from phalanx.examples import chargpt_model, train_gpt, workload_w
from phalanx.runtime.data import ElasticOrder
from phalanx.runtime.dataset import MemmapDataset, TokenWindows

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
    world = dist.group.WORLD
    assert world is not None  # the hook runs inside the initialized default group
    future = default_hooks.allreduce_hook(world, bucket)
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
                    optimizer: torch.optim.Optimizer, extra: dict[str, Any],
                    keep: int = 0) -> None:
    """Save the group's checkpoint of ``step`` synchronously; a collective.

    ``extra``: more state to save, objects with ``state_dict``/``load_state_dict``
    (DCP's ``Stateful``: an LR scheduler). ``keep``: rank 0 then deletes all but the
    newest ``keep`` complete checkpoints (0: none deleted).
    """
    partial = ckpt_dir / f"step-{step}{PARTIAL}"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, **extra}, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        partial.rename(ckpt_dir / f"step-{step}")
        complete = sorted(int(p.name.removeprefix("step-")) for p in ckpt_dir.glob("step-*")
                          if not p.name.endswith(PARTIAL))
        for old in complete[:-keep] if keep else []:
            shutil.rmtree(ckpt_dir / f"step-{old}", ignore_errors=True)
    dist.barrier()


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any]) -> None:
    """Load a checkpoint saved by :func:`save_checkpoint` into model, optimizer and
    ``extra`` (DCP loads a ``Stateful`` in place)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, **extra}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def fsdp_kill_hook(state: KillState) -> Callable[[torch.Tensor], None]:
    """FSDP2 all-reduce hook: the ``allreduce`` fault injection without DDP; the process
    SIGKILLs itself in step ``kill_step`` once the module's shards are all-reduced."""
    def hook(_: torch.Tensor) -> None:
        if state.step == state.kill_step:
            state.record("kill", state.step, in_flight=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


@dataclasses.dataclass
class Training:
    """A workload under DDP or FSDP2: what the checkpoint holds, how to train one step,
    and where the ``allreduce`` fault goes in."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    extra: dict[str, Any]  # more state for the checkpoint (DCP ``Stateful`` objects)
    step: Callable[[int], float]  # trains global step n (1-based); this rank's mean loss
    install_kill: Callable[[KillState], None]  # registers the ``allreduce`` kill


def build_w(options: argparse.Namespace, rank: int, world: int,
            device: torch.device) -> Training:
    """Workload W: the global batch's contiguous share per rank, one micro-batch."""
    if device.type != "cpu":
        raise ValueError("workload W runs on the CPU")
    dataset = MemmapDataset(options.data_dir)
    order = ElasticOrder(len(dataset), workload_w.W_GLOBAL_BATCH, seed=0)
    model = DistributedDataParallel(workload_w.build_model(options.widths))
    optimizer = workload_w.build_optimizer(model)
    epoch_orders: dict[int, list[int]] = {}

    def step(n: int) -> float:
        nonlocal epoch_orders
        epoch, index = divmod(n - 1, order.steps_per_epoch)
        if epoch not in epoch_orders:
            epoch_orders = {epoch: order.epoch_order(epoch)}
        (micro,) = order.plan(epoch, index, world, rank, micro_batch_size=order.global_batch,
                              order=epoch_orders[epoch])
        inputs, targets = dataset.batch(micro.indices)
        # DDP averages gradients over the ranks: scaling by weight * world makes the
        # result the gradient of the mean loss over the global batch.
        loss = torch.nn.functional.mse_loss(model(inputs), targets) * micro.weight * world
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item() / (micro.weight * world)

    return Training(model, optimizer, {}, step, ddp_kill(model))


def ddp_kill(model: DistributedDataParallel) -> Callable[[KillState], None]:
    return lambda state: model.register_comm_hook(state, kill_hook)


def build_gpt(options: argparse.Namespace, rank: int, world: int,
              device: torch.device) -> Training:
    """The GPT example's loop as a DDP user writes it (docs/runtime.md's starting point)."""
    torch.manual_seed(options.seed)
    model = DistributedDataParallel(chargpt_model.GPT(options.layers, options.heads, options.embd,
                                                  options.block_size).to(device))
    return gpt_loop(options, rank, world, device, model, model.module,
                    lambda sync: contextlib.nullcontext() if sync else model.no_sync(),
                    ddp_kill(model))


def build_hsdp(options: argparse.Namespace, rank: int, world: int,
               device: torch.device) -> Training:
    """The same loop with the model sharded as plain FSDP2 HSDP
    (``examples/chargpt_hsdp_torchrun.py``'s mesh and ``chargpt_model.shard``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(options.seed)
    if world % options.shard:
        raise ValueError(f"--shard {options.shard} does not divide {world} ranks")
    mesh = init_device_mesh(device.type, (world // options.shard, options.shard),
                            mesh_dim_names=("replicate", "shard"))
    model = chargpt_model.shard(chargpt_model.GPT(options.layers, options.heads, options.embd,
                                                  options.block_size).to(device), mesh)
    fsdp = cast(FSDPModule, model)

    @contextlib.contextmanager
    def sync(on: bool) -> Iterator[None]:
        fsdp.set_requires_gradient_sync(on)
        yield

    def install_kill(state: KillState) -> None:
        cast(FSDPModule, model.blocks[-1]).set_all_reduce_hook(fsdp_kill_hook(state))

    return gpt_loop(options, rank, world, device, model, model, sync, install_kill)


def gpt_loop(options: argparse.Namespace, rank: int, world: int, device: torch.device,
             model: torch.nn.Module, inner: torch.nn.Module,
             sync: Callable[[bool], contextlib.AbstractContextManager[Any]],
             install_kill: Callable[[KillState], None]) -> Training:
    """The GPT example's loop over ``model`` (``inner``: the GPT it wraps); ``sync(on)``
    turns the gradient reduction off (False) for the micro-batches but the last."""
    windows = TokenWindows(options.data_dir, options.block_size)
    optimizer = chargpt_model.build_optimizer(inner, options.lr)
    scheduler = chargpt_model.build_scheduler(optimizer, options.steps, options.warmup)
    accumulation, rest = divmod(options.global_batch, world * options.micro_batch)
    if rest or not accumulation:
        raise ValueError(f"--global-batch {options.global_batch} is not a multiple of "
                         f"{world} ranks x --micro-batch {options.micro_batch}")
    sampler: DistributedSampler[int] = DistributedSampler(
        windows, world, rank, shuffle=True, seed=options.seed, drop_last=True)
    loader = DataLoader(windows, batch_size=options.micro_batch, sampler=sampler,
                        drop_last=True)
    steps_per_epoch = len(loader) // accumulation
    position: tuple[int, int] | None = None  # (epoch, step in it) the iterator is at
    batches: Any = None

    def step(n: int) -> float:
        nonlocal position, batches
        epoch, index = divmod(n - 1, steps_per_epoch)
        if position != (epoch, index):  # the first step, a new epoch, or a resume
            sampler.set_epoch(epoch)
            batches = itertools.islice(iter(loader), index * accumulation, None)
        position = (epoch, index + 1)
        loss = 0.0
        for micro in range(accumulation):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            # Gradients are all-reduced in the last micro-batch's backward only.
            with sync(micro == accumulation - 1):
                micro_loss = chargpt_model.next_token_loss(model, x, y) / accumulation
                micro_loss.backward()
            loss += micro_loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss

    return Training(model, optimizer, {"scheduler": scheduler}, step, install_kill)


def w_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun_worker.py --workload w")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--widths", type=lambda s: tuple(int(w) for w in s.split(",")),
                        default=workload_w.W_WIDTHS)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    return parser


WORKLOADS = {"w": (w_arguments, build_w), "gpt": (train_gpt.arguments, build_gpt),
             "hsdp": (train_gpt.arguments, build_hsdp)}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """The worker's own options, and the workload's (the rest of the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="w")
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--record-dir", type=Path, required=True)
    parser.add_argument("--ckpt-every", type=int, default=10, help="0: never")
    parser.add_argument("--ckpt-keep", type=int, default=0,
                        help="keep this many newest checkpoints, delete older ones (0: all)")
    parser.add_argument("--pg-timeout", type=float,
                        help="seconds a collective may block before it fails (default: "
                        "torch's): how a hung peer is noticed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: GPU LOCAL_RANK, NCCL")
    args, rest = parser.parse_known_args(argv)
    arguments, _ = WORKLOADS[args.workload]
    return args, arguments().parse_args(rest)


def main() -> None:
    args, options = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = Recorder(args.record_dir, rank, attempt)
    record("start", t=STARTED)
    record("torch", t=TORCH_IMPORTED)
    record("imported", t=IMPORTED)
    kill_step, kill_phase = parse_kill(os.environ.get("BASELINE_KILL", ""), rank, attempt)
    torch.set_num_threads(1)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    timeout = None if args.pg_timeout is None else dt.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    record("process_group")

    _, build = WORKLOADS[args.workload]
    training = build(options, rank, world, device)
    hook = KillState(record, kill_step if kill_phase == "allreduce" else None)
    training.install_kill(hook)
    record("built")

    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    done, path = latest_checkpoint(args.ckpt_dir)
    if path is not None:
        load_checkpoint(path, training.model, training.optimizer, training.extra)
    record("loaded", done)

    for step in range(done + 1, options.steps + 1):
        if kill_phase == "between" and step == kill_step:
            record("kill", step)
            os.kill(os.getpid(), signal.SIGKILL)
        hook.step = step
        loss = training.step(step)
        record("step", step, loss=loss, process_cpu_s=time.process_time())
        if args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step, training.model, training.optimizer,
                            training.extra, keep=args.ckpt_keep)
            record("saved", step)

    # Every rank is done (and the checkpoint complete) after this barrier. Exit without
    # tearing down: gloo's process-group destructor can hang joining its threads once
    # the peers are gone (seen on rank 0 with torch 2.13), and nothing is left to flush.
    dist.barrier()
    record("done", options.steps, peak_rss_kb=peak_rss_kb())
    os._exit(0)


if __name__ == "__main__":
    main()
