"""One torchft replica group training workload W: bench/goodput.py's torchft arm.

Run by ``torch.distributed.run`` (one process, ``--nproc-per-node 1``: a replica group
of one rank, as torchft's ``train_ddp.py`` runs each group; its torchrun restarts it
after a crash), with ``TORCHFT_LIGHTHOUSE`` set to the lighthouse's address. The loop
is the one torchft's example writes for DDP, on W (``examples/workload_w.py``):

* ``torchft.Manager`` over a ``ProcessGroupGloo`` (its ``timeout`` and the manager's:
  ``--timeout``), ``min_replica_size`` ``--min-replicas``, its state (model and
  optimizer) sent to a recovering group by the default HTTP transport;
* ``torchft.DistributedDataParallel`` and ``OptimizerWrapper``: ``zero_grad`` starts
  the quorum, the gradients are averaged over the step's participants, ``step``
  applies them only if every participant votes to commit;
* ``torchft.data.DistributedSampler``: the dataset sharded over ``--groups`` replica
  groups, each group reading its shard in batches of ``--batch`` (W's global batch
  over the groups). As in torchft's example the loader's position is not saved: a
  group that starts again reads its shard from the start, and a batch trained in a
  step that was not committed is not read again. That is torchft's documented lossy
  data behaviour, which the records let bench/goodput.py count.

The group appends one JSON line per step to ``<record-dir>/group-<g>.jsonl``:
``start`` (before the imports), ``ready`` (manager, model and optimizer built),
then ``step`` lines with the manager's step after it, whether it committed, the
quorum's participants, the time the step began, and the batch's place in the shard
(``epoch``, ``position``) and its sample indices when it committed. Lines are whole
or missing under SIGKILL.
"""

# The clock is read before the imports, which are part of what it times.
# ruff: noqa: E402
import time

STARTED = time.time()

import argparse
import datetime as dt
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.data import DistributedSampler
from torchft.optim import OptimizerWrapper

from phalanx.examples import workload_w
from phalanx.runtime.dataset import MemmapDataset


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, required=True, help="this replica group's id")
    parser.add_argument("--groups", type=int, required=True, help="replica groups in all")
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--widths", type=lambda s: tuple(int(w) for w in s.split(",")),
                        default=workload_w.W_WIDTHS)
    parser.add_argument("--record-dir", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds a collective, quorum or state transfer may take")
    parser.add_argument("--steps", type=int, default=1_000_000, help="stop after this step")
    return parser


def batches(sampler: DistributedSampler, size: int) -> Iterator[tuple[int, int, list[int]]]:
    """``(epoch, position, indices)`` of each batch of this group's shard, from the first
    epoch's start (drop_last: only full batches)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        shard = list(sampler)
        for position in range(len(shard) // size):
            yield epoch, position, shard[position * size:(position + 1) * size]
        epoch += 1


def main() -> None:
    args = arguments().parse_args()
    args.record_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(args.record_dir / f"group-{args.group}.jsonl",
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(**fields: Any) -> None:
        os.write(fd, (json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n")
                 .encode())

    record(kind="start", t=STARTED)
    torch.set_num_threads(1)
    dataset = MemmapDataset(args.data_dir)
    model = workload_w.build_model(args.widths)
    inner = workload_w.build_optimizer(model)
    timeout = dt.timedelta(seconds=args.timeout)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=args.min_replicas,
                      replica_id=f"goodput-{args.group}", timeout=timeout,
                      quorum_timeout=timeout * 3, connect_timeout=timeout)
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    sampler = DistributedSampler(dataset, replica_rank=args.group,
                                 num_replica_groups=args.groups, group_rank=0, num_replicas=1,
                                 shuffle=True, seed=0, drop_last=True)
    batch = workload_w.W_GLOBAL_BATCH // args.groups
    record(kind="ready")
    for epoch, position, indices in batches(sampler, batch):
        began = time.time()
        optimizer.zero_grad()
        inputs, targets = dataset.batch(indices)
        torch.nn.functional.mse_loss(ddp(inputs), targets).backward()
        committed = manager.should_commit()
        if committed:
            inner.step()
        record(kind="step", step=manager.current_step(), committed=committed, began=began,
               participants=manager.num_participants(), epoch=epoch, position=position,
               **({"indices": indices} if committed else {}))
        if manager.current_step() >= args.steps:
            break
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    main()
