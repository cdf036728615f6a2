"""A model the script wrapped in ``DistributedDataParallel``: trained by the session, not DDP.

A DDP script keeps its ``model = DDP(model)`` when it is ported, and hands the
wrapper to the session. The session trains the module inside (``.module``):
its hooks take each gradient into the session's abortable all-reduce, whose
membership changes between steps. DDP's own reducer would all-reduce the same
gradients again, over the group the script made before the session (the
first gang's, or a world of one), which says nothing true after the first
membership change and blocks on a dead peer. So the session quiets it:

* DDP is pointed at a :class:`QuietGroup`, a group whose collectives are
  refused by name, and lets go of the script's group, which the session then
  destroys (:func:`.default_group.take_over`) while nothing else holds it;
* its backward hooks stay unarmed (``require_backward_grad_sync`` False, as
  inside ``no_sync()``) and its buffers are not broadcast before a forward
  (``require_forward_param_sync`` False).

* its ``no_sync()`` is refused at the first batch, naming the fix. A script
  that accumulates gradients itself (``no_sync()`` on all but the last of every
  ``accumulation`` batches, ``loss / accumulation``, the update under an ``if``)
  fixes the count before training; under the session a rank's micro-batches a
  step follow the membership (the global batch stays, and so does each
  micro-batch, so that any membership trains as the script alone does: 8 at
  world size 1, 2 at 4, 3 or 2 at 3), so no fixed count ends each of the
  rank's steps on its last batch, and a loss divided by it would be weighted
  twice. The micro-batches are the session's (``micro_batch_size``): each is
  weighted by its share of the global batch, and ``commit()`` returns False
  until the step's last. So the script's count becomes 1
  (``accumulation = 1``): its ``no_sync()``, division and ``if`` then stay
  and do nothing (examples/cnn.py).

What is left of DDP is its forward (the module's, with its input moves to
``device_ids``) and its ``state_dict`` (the module's under ``module.``), so
code that saves or loads the wrapper keeps working. Its gradient buckets stay
allocated (one copy of the gradients, as under DDP): the reducer has no way
to free them. Anything that arms DDP again (``require_backward_grad_sync =
True``) reaches the quiet group and is refused, never a stale peer.
"""

from __future__ import annotations

from typing import NoReturn

import torch
from torch.nn.parallel import DistributedDataParallel

from phalanx.runtime.default_group import MembershipGroup
from phalanx.schemas import environment


class QuietGroup(MembershipGroup):
    """The process group of a DDP wrapper the session trains: it does no collective."""

    def refuse(self) -> NoReturn:
        raise RuntimeError(
            "DistributedDataParallel's own all-reduce under a phalanx session: the session "
            "all-reduces the gradients over each generation's members, so the wrapper's "
            "reducer stays off (leave require_backward_grad_sync False) and its buffers "
            "are not broadcast")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module the session trains: ``model``, or the module inside a DDP wrapper,
    which is quieted (see the module docstring)."""
    if not isinstance(model, DistributedDataParallel):
        return model
    quiet = QuietGroup(0, 1)  # type: ignore[call-arg]
    model._update_process_group(quiet)
    model.require_backward_grad_sync = False
    model.require_forward_param_sync = False
    model.no_sync = _accumulation_is_the_sessions  # type: ignore[method-assign]
    module: torch.nn.Module = model.module
    return module


def _accumulation_is_the_sessions() -> NoReturn:
    raise RuntimeError(
        "model.no_sync(): the script accumulates gradients itself over a count of batches "
        "fixed before training, and under a phalanx session a rank's batches a step change "
        "with the membership (the micro-batches are the session's), so no fixed count ends "
        "each step on its last batch. Set the script's accumulation count to 1 (no "
        "no_sync(), no division of the loss, the update after every batch) and pass "
        f"micro_batch_size= to the session (or set {environment.MICRO_BATCH_SIZE} in the "
        "job's env): each batch is weighted by its share of the global batch, and "
        "session.commit() returns False until the step's last batch (docs/runtime.md, "
        "What else a DDP script carries over)")
