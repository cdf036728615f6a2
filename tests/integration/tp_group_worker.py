"""A replica group that is tensor parallel inside: an MLP split over ``tp`` and sharded by
FSDP2 over ``dp`` of a ``("dp", "tp")`` mesh of the group's 2 ranks (dp = 1).

The two ranks of a group take the same batch (``data_parallel=mesh["dp"]``); the session
replicates across the groups. Alone (no ``PHALANX_JOB_ID``, ``torchrun --nproc-per-node
2``) it is one group, the reference. The primary group's rank 0 writes the gathered state.

    python tp_group_worker.py --out FILE [--steps N]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from phalanx.runtime import ElasticSession


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2),
                            mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 1))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(96)]
    session = ElasticSession.from_env(model, optimizer, data, 16, seed=0,
                                      data_parallel=mesh["dp"])
    for step in session.steps(args.steps):
        for x, y in step:
            step.backward(torch.nn.functional.mse_loss(model(x), y))
        step.clip_grad_norm_(1.0)
        step.commit()
    if session.is_primary:
        state, optim = get_state_dict(model, optimizer,
                                      options=StateDictOptions(full_state_dict=True))
        if dist.get_rank() == 0:
            torch.save({"model": state, "optimizer": optim}, args.out)
    session.close()


if __name__ == "__main__":
    main()
