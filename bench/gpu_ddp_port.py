"""The char-GPT's DDP script as GPU users write it (NCCL, one GPU per process), ported.

bench/gpu.py's phase (d) runs it: alone (one process, torchrun's variables a
world of one) as the reference, and as a phalanx job whose only rank is killed.
It is examples/chargpt.py with the lines a GPU adds: ``init_process_group`` of
NCCL, the model on the process's GPU (the one ``CUDA_VISIBLE_DEVICES`` leaves
it, ``cuda:0``), ``DDP(model, device_ids=[0])`` and each batch moved there.
The session takes the NCCL group over and trains the module inside DDP; the
scheduler is carried without being registered. Where there is no GPU (the
bench's ``--cpu`` run) the same script runs on the CPU over gloo.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from phalanx.examples.chargpt_model import (
    GPT,
    arguments,
    build_optimizer,
    build_scheduler,
    dataset,
    next_token_loss,
    save,
)
from phalanx.runtime import ElasticSession


def main() -> None:
    args = arguments(__doc__).parse_args()
    torch.manual_seed(args.seed)
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    data = dataset(args)
    model: torch.nn.Module = GPT(args.layers, args.heads, args.embd, args.block_size).to(device)
    optimizer = build_optimizer(model, args.lr)
    steps = args.epochs * math.ceil(len(data) / args.global_batch)
    scheduler = build_scheduler(optimizer, steps, args.warmup)
    model = DDP(model, device_ids=[0] if on_gpu else None)
    session = ElasticSession.from_env(model, optimizer, data, args.global_batch, seed=args.seed)
    for epoch in session.epochs(args.epochs):
        for x, y in session.loader:
            loss = next_token_loss(model, x.to(device), y.to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not session.commit():
                continue
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step = session.committed
            if dist.get_rank() == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step:5d} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if dist.get_rank() == 0 and args.save:
        save(args.save, model, optimizer, scheduler)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
