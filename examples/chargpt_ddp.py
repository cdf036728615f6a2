"""Train a character-level GPT on Shakespeare: plain DDP (chargpt_ddp.py) and its port.

    python examples/chargpt_model.py --data-dir /tmp/phalanx-gpt-data   # tokenize once
    torchrun --nproc-per-node 4 examples/chargpt_ddp.py --epochs 2       # plain DDP
    phalanx submit examples/gpt.yaml                                      # the port, elastic
    torchrun --nproc-per-node 1 examples/chargpt.py --epochs 2           # the port alone

chargpt_ddp.py is a DDP loop as users write it: NCCL and ``cuda:LOCAL_RANK``
where there is a GPU, else gloo on the CPU; a ``DistributedSampler`` and a
``DataLoader`` (each rank takes ``global_batch / world_size`` windows a step),
AdamW, a linear warmup then cosine decay of the learning rate, clipping at
norm 1.0, a log line every ``--log-every`` steps and the save on rank 0.
chargpt.py is the same script under phalanx: elastic, recovering from faults
in process, and alone (one process, no phalanx) the reference. The two
files share this text so that ``diff examples/chargpt_ddp.py
examples/chargpt.py`` is the port; docs/runtime.md (The diff) says what each
changed line does.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from phalanx.examples.chargpt_model import (
    GPT,
    arguments,
    build_optimizer,
    build_scheduler,
    dataset,
    next_token_loss,
    save,
)


def main() -> None:
    args = arguments(__doc__).parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    data = dataset(args)
    model = GPT(args.layers, args.heads, args.embd, args.block_size).to(device)
    optimizer = build_optimizer(model, args.lr)
    steps = args.epochs * math.ceil(len(data) / args.global_batch)
    scheduler = build_scheduler(optimizer, steps, args.warmup)
    model = DDP(model, device_ids=[device.index] if cuda else None)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(data, args.global_batch // dist.get_world_size(), sampler=sampler)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = next_token_loss(model, x.to(device), y.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if dist.get_rank() == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step:5d} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if dist.get_rank() == 0 and args.save:
        save(args.save, model, optimizer, scheduler)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
