"""Train a small image classifier: plain DDP (cnn_ddp.py) and its port (cnn.py).

    torchrun --nproc-per-node 4 examples/cnn_ddp.py          # plain DDP
    phalanx submit examples/cnn.yaml                          # the port, elastic
    torchrun --nproc-per-node 1 examples/cnn.py               # the port alone

cnn_ddp.py is a DDP loop as torchvision's classification recipe writes it, in
small: a ``DistributedSampler`` and a ``DataLoader`` that both drop the last,
partial batch, gradient accumulation under ``no_sync()`` up to the global
batch, bf16 autocast, clipping at norm 1.0, AdamW, a one-cycle learning rate
sized by the loader's length, an EMA of the weights and the BatchNorm
statistics, and the save on rank 0. cnn.py is the same script under phalanx:
the session samples the data, accumulates (``--micro-batch`` images a forward)
and carries the EMA, so the script's own accumulation count is 1 and its
accumulation lines stay as they are. The two files share this text so that
``diff examples/cnn_ddp.py examples/cnn.py`` is the port; docs/runtime.md
(What else a DDP script carries over) says why the count is 1.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from phalanx.examples.cnn_model import (
    CNN,
    arguments,
    build_ema,
    build_optimizer,
    build_scheduler,
    classification_loss,
    dataset,
    save,
)
from phalanx.runtime import ElasticSession


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
    model = CNN().to(device)
    optimizer = build_optimizer(model, args.lr)
    scheduler = build_scheduler(optimizer, args.epochs * (len(data) // args.global_batch),
                                args.lr)
    ema = build_ema(model)
    model = DDP(model, device_ids=[device.index] if cuda else None)
    accumulation = 1  # the session accumulates: a batch a forward, commit() ends the step
    session = ElasticSession.from_env(model, optimizer, data, args.global_batch, seed=args.seed,
                                      micro_batch_size=args.micro_batch, drop_last=True)
    loader = session.loader
    for epoch in session.epochs(args.epochs):
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(loader):
            with nullcontext() if (i + 1) % accumulation == 0 else model.no_sync():
                loss = classification_loss(model, x.to(device), y.to(device)) / accumulation
                loss.backward()
            if (i + 1) % accumulation:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not session.commit():
                continue
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            ema.update_parameters(model)
        if dist.get_rank() == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if dist.get_rank() == 0 and args.save:
        save(args.save, model, optimizer, scheduler, ema)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
