"""The image classifier of the examples: model, optimizer, LR schedule, EMA, data, options.

Shared by the plain DDP script ``cnn_ddp.py`` and its phalanx port ``cnn.py``. A
small convolutional network with BatchNorm (its running statistics are buffers
that every rank updates) classifies 3 x 8 x 8 images into 10 classes. The
images are made from a seed, not downloaded: each class is a fixed random
pattern, each image its class's pattern under noise, so the network has
something to learn and every process makes the same data. The recipe is
torchvision's reference one, in small: AdamW with weight decay on the
convolutions and the linear layer only, a one-cycle learning rate sized by the
loader's length, bf16 autocast, clipping at norm 1.0 and an EMA of the weights
that averages the buffers too (``AveragedModel(use_buffers=True)``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

CLASSES, CHANNELS, SIDE = 10, 3, 8


class CNN(nn.Module):
    """Two convolutions, each with BatchNorm, then a linear classifier."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(CHANNELS, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


def images(samples: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``samples`` labelled images made from ``seed``: each class's pattern under noise."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, CHANNELS, SIDE, SIDE, generator=generator)
    labels = torch.randint(CLASSES, (samples,), generator=generator)
    noise = torch.randn(samples, CHANNELS, SIDE, SIDE, generator=generator)
    return torch.utils.data.TensorDataset(patterns[labels] + 1.5 * noise, labels)


def dataset(args: argparse.Namespace) -> torch.utils.data.TensorDataset:
    """The training images of ``--samples`` and ``--data-seed``."""
    return images(args.samples, args.data_seed)


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW; weight decay on the convolutions and the linear layer, not on biases and
    BatchNorm's affine parameters (torchvision's ``norm_weight_decay=0``)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def build_scheduler(optimizer: torch.optim.Optimizer, steps: int,
                    lr: float) -> torch.optim.lr_scheduler.OneCycleLR:
    """One cycle over exactly ``steps`` steps: stepped once more, it raises."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps)


def build_ema(model: nn.Module) -> AveragedModel:
    """An exponential moving average of the weights and of the BatchNorm statistics."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)


def classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the model's logits, the forward under bf16 autocast."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float(), y)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, ema: AveragedModel) -> None:
    """Write the model (unwrapped from DDP), EMA, optimizer and scheduler to ``path``."""
    model = getattr(model, "module", model)
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               path)


def arguments(description: str) -> argparse.ArgumentParser:
    """The training options."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1550)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=64, help="images per step")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="the most images one forward pass takes (DDP: a rank's)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write model, EMA, optimizer and scheduler here")
    return parser
