"""The character-level GPT of the examples: model, optimizer, LR schedule, data, options.

Shared by the plain DDP script ``chargpt_ddp.py``, its phalanx port
``chargpt.py``, the plain FSDP2 HSDP script ``chargpt_hsdp_torchrun.py`` and its
port ``chargpt_hsdp.py``, and ``train_gpt.py`` (the same training in the session's
``steps(n)`` form; bench/ runs it). Run alone, it tokenizes the corpus once::

    python examples/chargpt_model.py --data-dir /tmp/phalanx-gpt-data [--max-bytes N]

A decoder-only transformer (token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, the output layer tied to the token
embedding; about 2.7 M parameters by default) learns the next byte of
``examples/data/tinyshakespeare.txt`` (Shakespeare's plays, public domain,
1.1 MB), tokenized as bytes (a vocabulary of 256) and read as windows of
``--block-size`` tokens (:class:`~phalanx.runtime.TokenWindows`). AdamW with
weight decay on the matrices only, a linear warmup then cosine decay of the
learning rate.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from phalanx.runtime import TokenWindows, write_tokens

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

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
        out: torch.Tensor = self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, embd: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(embd)
        self.attn = CausalSelfAttention(embd, heads)
        self.ln2 = nn.LayerNorm(embd)
        self.mlp = nn.Sequential(nn.Linear(embd, 4 * embd), nn.GELU(), nn.Linear(4 * embd, embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


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
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


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


def dataset(args: argparse.Namespace) -> TokenWindows:
    """The tokens ``prepare`` wrote into ``--data-dir``, as windows of ``--block-size``."""
    return TokenWindows(args.data_dir, args.block_size)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Write the model (unwrapped from DDP), optimizer and scheduler state to ``path``."""
    model = getattr(model, "module", model)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, path)


def shard(model: GPT, mesh: DeviceMesh) -> GPT:
    """Shard ``model`` with FSDP2 over ``mesh``, block by block, as torchtitan does: each
    rank holds a slice of every parameter, gradient and optimizer state (over a 2-D
    ``("replicate", "shard")`` mesh, plain HSDP: the slices repeat across replicate)."""
    from torch.distributed.fsdp import fully_shard  # FSDP2's import is ~0.5 s: only here

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Gather a sharded model's and optimizer's whole state (a collective of the ranks of
    its mesh) and write it, with the scheduler's, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state,
                    "scheduler": scheduler.state_dict()}, path)


def arguments(description: str, length: str = "epochs") -> argparse.ArgumentParser:
    """The training options; ``length``: how the run's length is given, ``"epochs"`` or
    ``"steps"``."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--data-dir", default="/tmp/phalanx-gpt-data")
    if length == "epochs":
        parser.add_argument("--epochs", type=int, default=1)
    else:
        parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--embd", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=32, help="windows per step")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="the most windows one forward pass takes")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save", help="write model, optimizer and scheduler state here")
    parser.add_argument("--shard", type=int, default=2,
                        help="plain HSDP's ranks per replica group (a phalanx job's group "
                        "is its ranks_per_replica)")
    return parser


if __name__ == "__main__":
    options = argparse.ArgumentParser(description="tokenize the corpus once")
    options.add_argument("--data-dir", default="/tmp/phalanx-gpt-data")
    options.add_argument("--corpus", default=str(CORPUS))
    options.add_argument("--max-bytes", type=int, help="use only the corpus's first bytes")
    given = options.parse_args()
    prepare(given.data_dir, given.corpus, given.max_bytes)
