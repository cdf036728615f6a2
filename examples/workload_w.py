"""The reference workload W: an MLP regression on a memory-mapped synthetic dataset.

MLP 1024→2048→2048→2048→2048→1024 (16.8 M parameters), AdamW lr 1e-3, MSE
against targets from a fixed random linear map plus noise, global batch 64.
``examples/train_mlp.py`` trains it under phalanx; ``bench/recovery.py`` also
runs it under torchrun as the baseline. Smaller widths give the same workload
at test size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from phalanx.runtime.dataset import MemmapDataset, write_arrays
from phalanx.runtime.sharded import sharded_optimizer

W_WIDTHS = (1024, 2048, 2048, 2048, 2048, 1024)
W_GLOBAL_BATCH = 64
W_LR = 1e-3


def build_model(widths: Sequence[int] = W_WIDTHS, seed: int = 0) -> torch.nn.Sequential:
    """The MLP with ReLU between layers; the same initial parameters for a given seed."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def build_optimizer(model: torch.nn.Module, lr: float = W_LR,
                    sharded: bool = False) -> torch.optim.Optimizer:
    """AdamW; ``sharded``: as a ZeroRedundancyOptimizer, each rank holding the state of
    its partition of the parameters only (the same updates)."""
    if sharded:
        return sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr)


def prepare(directory: str | Path, samples: int, widths: Sequence[int] = W_WIDTHS,
            seed: int = 0) -> MemmapDataset:
    """Write the synthetic dataset once (skipped if it is already there) and open it."""
    directory = Path(directory)
    try:
        dataset = MemmapDataset(directory)
        if len(dataset) == samples and dataset.arrays[0].shape[1] == widths[0] \
                and dataset.arrays[1].shape[1] == widths[-1]:
            return dataset
    except FileNotFoundError:
        pass
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((samples, widths[0]), dtype=np.float32)
    mixing = rng.standard_normal((widths[0], widths[-1]), dtype=np.float32) / widths[0] ** 0.5
    targets = np.tanh(inputs @ mixing) + 0.01 * rng.standard_normal(
        (samples, widths[-1]), dtype=np.float32)
    write_arrays(directory, {"inputs": inputs, "targets": targets.astype(np.float32)})
    return MemmapDataset(directory)


class StepCounter:
    """A registered object of the script's own: the steps it saw committed."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


class AfterCommit:
    """What a real loop changes after each committed step, beyond the model and the
    optimizer: a warmup + cosine LR schedule (``SequentialLR``), an EMA of the weights and
    a step counter. A restore from any tier must bring all three back as the script left
    them at the step it resumes from, or the run differs from the uninterrupted one."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 steps: int) -> None:
        lr = torch.optim.lr_scheduler
        warmup = max(1, steps // 10)
        self.scheduler = lr.SequentialLR(optimizer, [
            lr.LinearLR(optimizer, 0.01, 1.0, warmup),
            lr.CosineAnnealingLR(optimizer, max(1, steps - warmup))], milestones=[warmup])
        self.ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        self.counter = StepCounter()

    def state(self) -> dict[str, object]:
        """The objects to register with the session."""
        return {"scheduler": self.scheduler, "ema": self.ema, "counter": self.counter}

    def step(self, model: torch.nn.Module) -> None:
        """After a committed step."""
        self.scheduler.step()
        self.ema.update_parameters(model)
        self.counter.steps += 1

    def saved(self) -> dict[str, torch.Tensor]:
        """What to save beside the parameters, as tensors a test compares."""
        return {**{f"ema.{k}": v for k, v in self.ema.state_dict().items()},
                "lr": torch.tensor(self.scheduler.get_last_lr(), dtype=torch.float64),
                "scheduler.last_epoch": torch.tensor(self.scheduler.last_epoch),
                "counter.steps": torch.tensor(self.counter.steps)}
