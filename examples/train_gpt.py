"""Train a small GPT on Shakespeare under phalanx: elastic, recovering from faults in process.

    python examples/train_gpt.py --prepare --data-dir /tmp/phalanx-gpt-data  # tokenize once
    phalanx submit examples/gpt.yaml                                         # 4 ranks
    python examples/train_gpt.py --data-dir /tmp/phalanx-gpt-data            # alone: the reference

A decoder-only transformer (token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, the output layer tied to the token
embedding; about 2.7 M parameters by default) learns the next byte of
``examples/data/tinyshakespeare.txt`` (Shakespeare's plays, public domain,
1.1 MB), tokenized at prepare time as bytes (a vocabulary of 256). AdamW with
weight decay on the matrices only, a linear warmup then cosine decay of the
learning rate, clipping at norm 1.0; it logs the loss of the whole global
batch and tokens per second.

Compared with the plain DDP loop, the phalanx lines are the session (instead
of ``init_process_group``, ``DistributedDataParallel`` and a
``DistributedSampler``; the scheduler is handed to it so that a joiner gets
its state), the step loop, ``step.backward``, ``step.clip_grad_norm_`` and
``if step.commit(): scheduler.step()``; docs/runtime.md shows the diff.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from phalanx.runtime import ElasticSession, TokenWindows, write_tokens

CORPUS = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
VOCAB = 256  # bytes


class CausalSelfAttention(nn.Module):
    def __init__(self, embd: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embd, 3 * embd)
        self.proj = nn.Linear(embd, embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, embd: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(embd)
        self.attn = CausalSelfAttention(embd, heads)
        self.ln2 = nn.LayerNorm(embd)
        self.mlp = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, embd: int, block_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, embd)
        self.wpe = nn.Embedding(block_size, embd)
        self.blocks = nn.ModuleList(Block(embd, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(embd)
        self.head = nn.Linear(embd, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                     "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices (and the embedding), not on biases and norms."""
    params = list(model.parameters())  # the tied weight once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def build_scheduler(optimizer: torch.optim.Optimizer, steps: int,
                    warmup: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth."""
    lr = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, steps - warmup),
                                                   lr / 10)], milestones=[warmup])


def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the model's next-token predictions."""
    return F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1))


def prepare(data_dir: str | Path, corpus: str | Path = CORPUS,
            max_bytes: int | None = None) -> None:
    """Tokenize the corpus (its first ``max_bytes``) as bytes into ``data_dir``, once."""
    text = Path(corpus).read_bytes()[:max_bytes]
    write_tokens(data_dir, np.frombuffer(text, dtype=np.uint8), VOCAB)


def arguments() -> argparse.ArgumentParser:
    """The script's options (bench/torchrun_worker.py's plain DDP twin takes the same)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/tmp/phalanx-gpt-data")
    parser.add_argument("--prepare", action="store_true", help="tokenize the corpus and exit")
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--max-bytes", type=int, help="use only the corpus's first bytes")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--embd", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32, help="windows per step")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save", help="write model, optimizer and scheduler state here")
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.prepare:
        prepare(args.data_dir, args.corpus, args.max_bytes)
        return

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    windows = TokenWindows(args.data_dir, args.block_size)
    model = GPT(args.layers, args.heads, args.embd, args.block_size)
    optimizer = build_optimizer(model, args.lr)
    scheduler = build_scheduler(optimizer, args.steps, args.warmup)

    def warmup() -> None:  # optional: a joining replica's first step is then not cold
        next_token_loss(model, *windows.batch(range(args.micro_batch))).backward()

    session = ElasticSession.from_env(model, optimizer, windows, global_batch=args.global_batch,
                                      micro_batch_size=args.micro_batch, seed=args.seed,
                                      state={"scheduler": scheduler}, warmup=warmup)
    if session.is_primary:
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(windows):,} windows of {args.block_size} tokens", flush=True)
    since, started = time.perf_counter(), session.committed
    for step in session.steps(args.steps):
        for x, y in step:
            step.backward(next_token_loss(model, x, y))
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
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.save)
    session.close()


if __name__ == "__main__":
    main()
