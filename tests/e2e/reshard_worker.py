"""One rank of a group of 4 that restores the char-GPT port's newest durable step, written
by groups of 2, and trains on (``test_hsdp.py``'s resharding test; run under
``torchrun --nproc-per-node 4``).

Each rank builds the port's model, sharded over the 4-rank group with FSDP2, and loads
the step with the durable tier's own loader (``phalanx.runtime.durable.load``): DCP reads
each rank's quarter of every tensor from the 2 x 2 files the job wrote. Rank 0 saves the
state gathered whole (``restored``), the losses of 3 more steps at S = 4 and the model
after them (``trained``).
"""

from __future__ import annotations

import copy
import math

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh

from phalanx.examples.chargpt_model import (
    GPT,
    arguments,
    build_optimizer,
    build_scheduler,
    dataset,
    next_token_loss,
    shard,
)
from phalanx.runtime import durable


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    return get_state_dict(model, optimizer,
                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--durable", required=True, help="the job's durable directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("shard",))
    data = dataset(args)
    model = shard(GPT(args.layers, args.heads, args.embd, args.block_size), mesh)
    optimizer = build_optimizer(model, args.lr)
    scheduler = build_scheduler(optimizer, args.epochs * math.ceil(len(data)
                                                                   / args.global_batch),
                                args.warmup)
    fs = fsspec.filesystem("file")
    step = durable.committed_steps(fs, args.durable)[0]
    durable.load(fs, step, durable.verify(fs, step), model, optimizer,
                 {"lr_scheduler": scheduler}, column=rank)
    model_state, optimizer_state = gathered(model, optimizer)
    # A copy: the gathered state holds the live step counters, which training moves.
    restored = copy.deepcopy({"model": model_state, "optimizer": optimizer_state,
                              "scheduler": scheduler.state_dict()})
    losses = []
    per_rank = args.global_batch // size
    for i in range(3):
        first = (i * args.global_batch + rank * per_rank) % (len(data) - per_rank)
        x, y = (torch.stack(t) for t in zip(*(data[j] for j in range(first, first + per_rank)),
                                              strict=True))
        loss = next_token_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append(float(summed) / size)
    trained, _ = gathered(model, optimizer)
    if rank == 0:
        torch.save({"restored": restored, "losses": losses, "trained": trained}, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
