"""The GPT example in the session's ``steps(n)`` form: what bench/ measures.

    python examples/train_gpt.py --prepare --data-dir /tmp/phalanx-gpt-data  # tokenize once
    python examples/train_gpt.py --data-dir /tmp/phalanx-gpt-data --steps 300  # alone

The model, data and options of examples/chargpt.py (``chargpt_model.py``),
trained for ``--steps`` steps with the session's step loop instead of the
DDP-shaped epochs/loader loop: ``for step in session.steps(n)``, ``for x, y
in step``, ``step.backward``, ``step.clip_grad_norm_``, ``if step.commit():
scheduler.step()``. It logs the loss of the whole global batch (``step.loss``)
and tokens per second. bench/recovery.py runs it under phalanx, and
bench/torchrun_worker.py its plain DDP twin, with the same options.

On a GPU (its agent lists GPUs, or alone where torch sees CUDA) the model and
each batch go to ``device()``, the rank's GPU (docs/gpu.md); ``--amp bf16`` runs
the forward pass under bf16 autocast (no loss scaler needed: bf16 keeps float32's
range).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from phalanx.examples.chargpt_model import (
    GPT,
    build_optimizer,
    build_scheduler,
    dataset,
    next_token_loss,
    prepare,
    save,
)
from phalanx.examples.chargpt_model import arguments as training_arguments
from phalanx.runtime import ElasticSession, device


def arguments() -> argparse.ArgumentParser:
    """The options: chargpt's, with ``--steps`` for ``--epochs``, and ``--prepare``."""
    parser = training_arguments(__doc__, length="steps")
    parser.add_argument("--prepare", action="store_true", help="tokenize the corpus and exit")
    parser.add_argument("--amp", choices=("off", "bf16"), default="off",
                        help="bf16 autocast for the forward pass")
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.prepare:
        prepare(args.data_dir)
        return

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    windows = dataset(args)
    on = device()  # this rank's GPU, or the CPU
    model = GPT(args.layers, args.heads, args.embd, args.block_size).to(on)
    optimizer = build_optimizer(model, args.lr)
    scheduler = build_scheduler(optimizer, args.steps, args.warmup)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(on.type, torch.bfloat16) if args.amp == "bf16" \
                else contextlib.nullcontext():
            return next_token_loss(model, x.to(on), y.to(on))

    def warmup() -> None:  # optional: a joining replica's first step is then not cold
        loss(*windows.batch(range(args.micro_batch))).backward()

    session = ElasticSession.from_env(model, optimizer, windows, global_batch=args.global_batch,
                                      micro_batch_size=args.micro_batch, seed=args.seed,
                                      state={"scheduler": scheduler}, warmup=warmup)
    if session.is_primary:
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(windows):,} windows of {args.block_size} tokens", flush=True)
    since, started = time.perf_counter(), session.committed
    for step in session.steps(args.steps):
        for x, y in step:
            step.backward(loss(x, y))
        step.clip_grad_norm_(1.0)
        if step.commit():
            scheduler.step()
            if step.index % args.log_every == 0 or step.index == args.steps - 1:
                now = time.perf_counter()
                tokens = (step.index + 1 - started) * args.global_batch * args.block_size
                if session.is_primary:
                    print(f"step {step.index:5d}  loss {step.loss:.4f}  "
                          f"lr {scheduler.get_last_lr()[0]:.2e}  "
                          f"{tokens / (now - since):,.0f} tokens/s", flush=True)
                since, started = now, step.index + 1
    # Only a member that trained to the end gets here; every member holds the same state.
    if args.save and session.is_primary:
        save(args.save, model, optimizer, scheduler)
    session.close()


if __name__ == "__main__":
    main()
