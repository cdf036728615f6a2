"""Train the character-level GPT sharded with FSDP2: plain HSDP under torchrun, and its port.

    python examples/chargpt_model.py --data-dir /tmp/phalanx-gpt-data    # tokenize once
    torchrun --nproc-per-node 4 examples/chargpt_hsdp_torchrun.py --shard 2  # plain HSDP
    phalanx submit examples/gpt_hsdp.yaml                                  # the port
    torchrun --nproc-per-node 2 examples/chargpt_hsdp.py                   # one group alone

chargpt_hsdp_torchrun.py shards the model as torchtitan's trainer does: a 2-D
device mesh, ``replicate`` x ``shard`` (R groups of ``--shard`` ranks), FSDP2's
``fully_shard`` on every block and on the model, so each rank holds a slice of
the parameters, gradients and optimizer state. Its loop is chargpt_ddp.py's: a
``DistributedSampler`` (``global_batch / world_size`` windows per rank and
step), AdamW, warmup and cosine decay, clipping at norm 1.0, and the whole
state gathered and saved on rank 0. chargpt_hsdp.py is the same trainer under
phalanx: the mesh spans one replica group (the job's ``ranks_per_replica``),
and the session replicates across the groups, elastic and recovering in
process. The two files share this
text so that ``diff examples/chargpt_hsdp_torchrun.py examples/chargpt_hsdp.py``
is the port; docs/runtime.md (HSDP) says what each changed line does.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from phalanx.examples.chargpt_model import (
    GPT,
    arguments,
    build_optimizer,
    build_scheduler,
    dataset,
    next_token_loss,
    save_sharded,
    shard,
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
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    data = dataset(args)
    model = shard(GPT(args.layers, args.heads, args.embd, args.block_size).to(device), mesh)
    optimizer = build_optimizer(model, args.lr)
    steps = args.epochs * math.ceil(len(data) / args.global_batch)
    scheduler = build_scheduler(optimizer, steps, args.warmup)
    session = ElasticSession.from_env(model, optimizer, data, args.global_batch, seed=args.seed)
    loader = session.loader
    for epoch in session.epochs(args.epochs):
        for x, y in loader:
            loss = next_token_loss(model, x.to(device), y.to(device))
            session.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not session.commit():
                continue
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step = scheduler.last_epoch  # the steps taken
            if dist.get_rank() == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step:5d} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if session.is_primary and args.save:
        save_sharded(args.save, model, optimizer, scheduler)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
