"""A sharded optimizer (torch's ``ZeroRedundancyOptimizer``) under the elastic session.

ZeRO keeps each parameter's optimizer state on one rank only, its *owner*: each
member steps the parameters it owns and then sends their new values to the
others. torch's class cannot be used on a generation's group as it is: its
constructor needs a default process group and a group registered in c10d, and its
``step()`` ends in broadcasts that a dead peer blocks for ever. So:

* :func:`sharded_optimizer` builds one over a one-process *placeholder* world
  (initialised here if the process has no default group). Pointed at that world
  it is the whole optimizer: alone, a script runs with it unchanged.
* :class:`Sharded` is the session's handle on it. At each generation it is
  re-pointed at the member's rank and the world size (its partition is a pure
  function of the parameters and the world size: :meth:`Sharded.repartition`);
  a step is the owner's local step followed by a broadcast of every owner's
  parameters that the session waits on abortably (:meth:`Sharded.step`).
* Its **consolidated state** is ZeRO's own ``state_dict`` format (every owner's
  entries keyed by global parameter index, the param groups' hyperparameters):
  what a joiner receives, what a planned membership change gathers over the
  old group before it switches (:meth:`Sharded.gather`), and what a restore
  assembles from every owner's snapshot extent (:meth:`Sharded.owned_state`).
  Loading it keeps only the entries of the new partition.

A member whose partition alone is left after a fault cannot rebuild the whole
state from the survivors: the dead owner's entries exist only in snapshots, so
the session restores every member from the newest complete one.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.distributed as dist

from phalanx.runtime.group import Group
from phalanx.runtime.state import Wait, _fill, _strip, broadcast_bytes

#: Where torch keeps the class. Importing ``torch.distributed.optim`` costs a rank's
#: start about 0.4 s of CPU (FSDP and more come with it), so only a script that builds
#: a sharded optimizer pays it (:func:`sharded_optimizer`, :func:`is_sharded`).
ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class _Zero(ZeroRedundancyOptimizer):
        """The optimizer with the private parts :class:`Sharded` drives it by, which torch's
        stub (``zero_redundancy_optimizer.pyi``) leaves out; their code is in
        ``zero_redundancy_optimizer.py``."""

        _param_to_index: dict[torch.Tensor, int]
        _param_to_rank: dict[torch.Tensor, int]

        def _clear_cache(self) -> None: ...
        def _init_local_optimizer(self) -> None: ...
        def _partition_parameters(self, params_per_rank: list[list[torch.Tensor]] | None = None,
                                  ) -> list[list[dict[str, Any]]]: ...


def sharded_optimizer(params: Any, optimizer_class: type[torch.optim.Optimizer],
                      **defaults: Any) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` of ``optimizer_class`` over ``params``, for
    :class:`~.elastic.ElasticSession` (which partitions it over each generation).

    Initialises a one-process gloo world as the default process group if the process
    has none (the session never uses it for training: each generation has its own group).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError("the process already has a default group of "
                           f"{dist.get_world_size()} ranks: under the session a sharded "
                           "optimizer is partitioned over each generation's own group")
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)


def is_sharded(optimizer: object) -> TypeGuard[ZeroRedundancyOptimizer]:
    """Is ``optimizer`` a ``ZeroRedundancyOptimizer``? (Without importing it: an object
    of the class exists only once its module was imported.)"""
    module = sys.modules.get(ZERO_MODULE)
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


class Sharded:
    """The session's handle on a ``ZeroRedundancyOptimizer``: its partition per generation,
    its step, and its consolidated state.

    It stands in for the optimizer where state travels whole (a joiner's copy, a restore):
    ``state_dict()`` is the consolidated state, when this member holds it, and
    ``load_state_dict()`` keeps a consolidated state until :meth:`repartition` loads it.
    """

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        if zero._overlap_with_ddp or zero.parameters_as_bucket_view:
            raise ValueError("a sharded optimizer under the session takes neither "
                             "overlap_with_ddp nor parameters_as_bucket_view")
        self.zero = cast("_Zero", zero)
        #: The consolidated state at the member's committed step, once gathered, received
        #: or restored, until the next :meth:`repartition` loads it.
        self.full: dict[str, Any] | None = None
        #: :attr:`full` holds only the entries of one partition (a restore's, :meth:`keeps`).
        self.partial = False

    @property
    def holds_all(self) -> bool:
        """Whether this member can give the whole optimizer state of its committed step:
        it holds the consolidated state, or its optimizer was never partitioned."""
        if self.full is not None:
            return not self.partial
        return self.zero.world_size == 1

    def keeps(self, rank: int, world_size: int) -> Callable[[int], bool]:
        """Whether the entry of a global parameter index belongs to ``rank``'s partition at
        ``world_size`` (a restore then builds only those: :meth:`load_partition`)."""
        zero = self.zero
        was = zero.world_size
        zero.world_size = world_size
        zero._clear_cache()
        try:  # the partition at world_size, computed the way ZeRO computes its own
            owners = {zero._param_to_index[p]: owner for p, owner in zero._param_to_rank.items()}
        finally:
            zero.world_size = was
            zero._clear_cache()
        return lambda index: owners.get(index) == rank

    def load_partition(self, state: dict[str, Any]) -> None:
        """Keep ``state``, the consolidated state's param groups with only the entries of
        the partition :meth:`repartition` will point this member at."""
        self.full, self.partial = state, True

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state (ZeRO's ``state_dict`` format).

        Raises:
            RuntimeError: the member holds only a partition.
        """
        if not self.holds_all:
            raise RuntimeError(f"rank {self.zero.rank} of {self.zero.world_size} holds only "
                               "a partition of the optimizer state")
        if self.full is not None:
            return self.full
        return {**self.replicated_state(), "state": self.owned_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (consolidated) for the next :meth:`repartition`."""
        self.full, self.partial = state, False

    def replicated_state(self) -> dict[str, Any]:
        """What every member holds alike: the param groups (hyperparameters, global
        indices), with no per-parameter state."""
        return {"state": {}, "param_groups": torch.optim.Optimizer.state_dict(
            self.zero)["param_groups"]}

    def owned_state(self) -> dict[int, Any]:
        """This member's entries of the optimizer state, keyed by global parameter index
        (the tensors are the live ones: no copy)."""
        index = self.zero._param_to_index
        return {index[p]: state for p, state in self.zero.optim.state.items()}

    def repartition(self, rank: int, world_size: int) -> None:
        """Point the optimizer at ``rank`` of ``world_size`` and load the state it holds
        (the whole, or this partition's: the new partition's entries are kept).

        Raises:
            RuntimeError: the member holds only its partition (no consolidated state).
        """
        # The whole state (never partitioned, or consolidated), or the new partition's.
        full = self.full if self.full is not None else self.state_dict()
        zero = self.zero
        zero.rank, zero.global_rank, zero.world_size = rank, rank, world_size
        zero._clear_cache()
        zero._init_local_optimizer()
        self.full, self.partial = None, False
        # ZeRO's load voids the entries of other partitions in the dict it is given.
        zero.load_state_dict({**full, "state": dict(full["state"])})

    def step(self, pg: Group | None, wait: Wait,
             posted: Callable[[], None] | None = None) -> None:
        """The optimizer step: this member's partition, then every owner's new parameters
        broadcast to the others (each wait abortable; ``posted`` is called once all are
        posted). A broadcast cut short leaves the step torn (owners updated, others not):
        the caller must not count it."""
        self.zero._local_step()
        if pg is None or self.zero.world_size == 1:
            return
        works = [pg.broadcast(p.data, owner)
                 for owner, groups in enumerate(self.zero._partition_parameters())
                 for group in groups for p in group["params"]]
        if posted is not None:
            posted()
        for work in works:
            wait(work)

    def gather(self, pg: Group, wait: Wait) -> None:
        """Every member of ``pg`` (the generation the optimizer is partitioned over) ends
        holding the consolidated state (:attr:`full`): each owner's entries broadcast.
        Raises :class:`~.group.Aborted` from ``wait`` if the group is abandoned."""
        rank = self.zero.rank
        everything: dict[int, Any] = {}
        for owner in range(self.zero.world_size):
            tensors: list[torch.Tensor] = []
            skeleton = _strip(self.owned_state(), tensors) if owner == rank else None
            described = pickle.dumps((skeleton, [(tuple(t.shape), t.dtype) for t in tensors])) \
                if owner == rank else None
            skeleton, shapes = pickle.loads(  # from a peer rank
                broadcast_bytes(pg, wait, rank, owner, described))
            if owner != rank:  # on the parameters' device, as the owner's are
                device = next(iter(self.zero._param_to_index)).device
                tensors = [torch.empty(shape, dtype=dtype, device=device)
                           for shape, dtype in shapes]
            works = [pg.broadcast(t.detach().view(-1), owner) for t in tensors]
            for work in works:
                wait(work)
            everything.update(_fill(skeleton, tensors))
        self.full = {**self.replicated_state(), "state": dict(sorted(everything.items()))}
