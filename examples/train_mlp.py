"""Train the reference workload W under phalanx: elastic, recovering from faults in process.

    python examples/train_mlp.py --prepare --data-dir /tmp/w-data   # write the dataset once
    phalanx submit examples/mlp.yaml                                # 4 ranks under phalanx
    python examples/train_mlp.py --data-dir /tmp/w-data             # alone: the reference

Compared with a plain DDP script, the phalanx lines are the session (instead
of ``init_process_group``, ``DistributedDataParallel`` and a
``DistributedSampler``), the step loop and ``step.commit()`` (instead of
``optimizer.step()``); see docs/runtime.md for the diff.
"""

from __future__ import annotations

import argparse

import torch

from phalanx.examples import workload_w
from phalanx.runtime.dataset import MemmapDataset
from phalanx.runtime.elastic import ElasticSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/tmp/phalanx-w-data")
    parser.add_argument("--prepare", action="store_true", help="write the dataset and exit")
    parser.add_argument("--samples", type=int, default=64 * 40)
    parser.add_argument("--widths", default=",".join(map(str, workload_w.W_WIDTHS)))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=workload_w.W_GLOBAL_BATCH)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the final parameters here (the primary replica)")
    parser.add_argument("--sharded-optimizer", action="store_true",
                        help="shard AdamW's state over the ranks (ZeroRedundancyOptimizer)")
    parser.add_argument("--schedule", action="store_true",
                        help="what a real loop adds after each commit: a warmup + cosine LR "
                             "schedule, an EMA of the weights and a step counter (saved "
                             "with the parameters), and clipping at 1.0")
    parser.add_argument("--schedule-steps", type=int,
                        help="the schedule's length (default: --steps): a run stopped early")
    args = parser.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    if args.prepare:
        workload_w.prepare(args.data_dir, args.samples, widths, args.seed)
        return

    torch.set_num_threads(1)
    dataset = MemmapDataset(args.data_dir)
    model = workload_w.build_model(widths, args.seed)
    optimizer = workload_w.build_optimizer(model, sharded=args.sharded_optimizer)
    loss_fn = torch.nn.MSELoss()

    def warmup() -> None:  # optional: a joining replica's first step is then not cold
        inputs, targets = dataset.batch(range(args.micro_batch))
        loss_fn(model(inputs), targets).backward()

    after_commit = workload_w.AfterCommit(
        model, optimizer, args.schedule_steps or args.steps) if args.schedule \
        else None
    session = ElasticSession.from_env(model, optimizer, dataset, global_batch=args.global_batch,
                                      micro_batch_size=args.micro_batch, seed=args.seed,
                                      warmup=warmup,
                                      state=after_commit.state() if after_commit else None)
    for step in session.steps(args.steps):
        loss = 0.0
        for (inputs, targets), weight in step.batches():
            micro_loss = loss_fn(model(inputs), targets) * weight
            micro_loss.backward()
            loss += micro_loss.item()
        if after_commit is None:
            step.commit(loss=loss)
            continue
        if step.reduce(loss=loss):
            step.clip_grad_norm_(1.0)
        if step.commit():
            after_commit.step(model)
    # Only a member that trained to the end gets here (a replica the job completed
    # without leaves inside steps()); every member holds the same model: one saves it.
    if args.save and session.is_primary:
        result = model.state_dict()
        if after_commit is not None:
            result.update(after_commit.saved())
        torch.save(result, args.save)
    session.close()


if __name__ == "__main__":
    main()
