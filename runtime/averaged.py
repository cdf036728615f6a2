"""Averaged models (``torch.optim.swa_utils.AveragedModel``): carried, registered or not.

An EMA or SWA average of the weights is training state as much as the
optimizer's: a replica that restores or receives its peers' model with its own
average fresh would average from scratch, and a whole-job restore would lose
the average outright (``n_averaged`` and the weights: silently, the run goes
on). An ``AveragedModel`` holds a copy of the model, not a reference to it, so
it is found by its type and shape: every one alive when the session is made, or
when its first step starts, whose copy has the session's model's parameter
shapes, is carried as if registered, under :data:`NAME`. Two or
more unregistered are refused by name: no order of finding them names them
alike in every replica.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.swa_utils import AveragedModel

#: The name a found averaged model is carried under.
NAME = "averaged_model"
#: What :func:`unregistered` looks among.
KIND = AveragedModel


def _shapes(model: torch.nn.Module) -> list[torch.Size]:
    return [p.shape for p in model.parameters()]


def unregistered(model: torch.nn.Module, registered: Iterable[object],
                 candidates: Iterable[object]) -> dict[str, object]:
    """The averaged model of ``model`` among ``candidates`` (the process's objects of
    :data:`KIND`: :func:`.schedulers.alive`) and not among ``registered``, by name (none:
    empty).

    Raises:
        ValueError: more than one.
    """
    known, shapes = {id(obj) for obj in registered}, _shapes(model)
    found = [obj for obj in candidates if isinstance(obj, AveragedModel)
             and id(obj) not in known and _shapes(obj.module) == shapes]
    if len(found) > 1:
        raise ValueError(f"{len(found)} averaged models (AveragedModel) are not registered: "
                         "register each by name (state= or session.register), so that "
                         "every replica carries them alike")
    return {NAME: found[0]} if found else {}
