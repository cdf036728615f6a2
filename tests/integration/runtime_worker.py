"""A rank of the runtime integration tests: a small model trained as a language-model loop is.

AdamW, a warmup + cosine LR schedule (``SequentialLR``), clipping by global
norm, an EMA of the weights registered with the session, ``step.backward`` and
the step's global loss. Alone (no ``PHALANX_JOB_ID``) it is the reference.
Every replica that finishes writes ``<out>/<replica>.pt``: parameters,
optimizer, scheduler and EMA state, and the loss and gradient norm of every
step it committed. It exits with ``--exit-code`` from inside ``with session:``, and an
``atexit`` handler registered before the session writes ``<out>/<replica>.atexit``.

    python runtime_worker.py --prepare DIR
    python runtime_worker.py --data DIR --out OUT --steps N [--clip X] [--nan-step S]
        [--collective-timeout SECONDS] [--batchnorm]
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path

import numpy as np
import torch

from phalanx.runtime import ElasticOrder, ElasticSession, MemmapDataset, write_arrays

SAMPLES, GLOBAL_BATCH, MICRO_BATCH = 96, 16, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prepare")
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--clip", type=float)
    parser.add_argument("--nan-step", type=int, help="a sample of this step's loss is nan")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--batchnorm", action="store_true",
                        help="a BatchNorm layer, and an EMA that averages its statistics")
    parser.add_argument("--collective-timeout", type=float,
                        help="the session's store and gloo timeout, seconds")
    args = parser.parse_args()
    if args.prepare:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((SAMPLES, 8), dtype=np.float32)
        y = np.tanh(x[:, :4] * 2).astype(np.float32)
        write_arrays(args.prepare, {"x": x, "y": y, "i": np.arange(SAMPLES)})
        return

    replica = os.environ.get("PHALANX_REPLICA_ID", "local")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atexit.register(lambda: (out / f"{replica}.atexit").touch())
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dataset = MemmapDataset(args.data)
    norm = [torch.nn.BatchNorm1d(32)] if args.batchnorm else []
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), *norm, torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps - warmup, 1e-4)],
        milestones=[warmup])
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9),
        use_buffers=args.batchnorm)
    order = ElasticOrder(SAMPLES, GLOBAL_BATCH, seed=0)
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    session = ElasticSession.from_env(model, optimizer, dataset, global_batch=GLOBAL_BATCH,
                                      micro_batch_size=MICRO_BATCH,
                                      state={"scheduler": scheduler, "ema": ema},
                                      **({} if args.collective_timeout is None else {
                                          "collective_timeout_s": args.collective_timeout}))
    with session:
        for step in session.steps(args.steps):
            poisoned = -1
            if step.index == args.nan_step:
                poisoned = order.batch(*divmod(step.index, order.steps_per_epoch))[0]
            for x, y, i in step:
                loss = torch.nn.functional.mse_loss(model(x), y)
                if (i == poisoned).any():
                    loss = loss * float("nan")
                step.backward(loss)
            if args.clip is not None:
                norm = step.clip_grad_norm_(args.clip)
                if norm is not None:
                    norms[step.index] = float(norm)
            if step.commit():
                scheduler.step()
                ema.update_parameters(model)
                losses[step.index] = step.loss
        torch.save({"params": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "ema": ema.state_dict(),
                    "lr": optimizer.param_groups[0]["lr"], "losses": losses, "norms": norms},
                   out / f"{replica}.pt")
        sys.exit(args.exit_code)  # inside the block: the session sees the status


if __name__ == "__main__":
    main()
