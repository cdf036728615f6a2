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
  what a restore assembles from every owner's snapshot extent
  (:meth:`Sharded.owned_state`). Loading it keeps only the entries of the new partition.
* A **planned membership change hands the partitions over** owner to owner, never
  gathering the whole state. A join: each member keeps its partition through the
  switch (:meth:`Sharded.hold`); in the new group the members check that their held
  partitions are complete (:meth:`Sharded.agree`), a joiner receives the model and
  the replicated state from one member (:meth:`Sharded.state_dict` during a hand-over
  gives only that), and each new owner receives its new partition's entries straight
  from their holders (:meth:`Sharded.take_over`). A leave: before the switch, over
  the old group, each staying member receives its new partition's entries from
  their owners, the leaving ones included (:meth:`Sharded.hand_to`).

A member whose partition alone is left after a fault cannot rebuild the whole
state from the survivors: the dead owner's entries exist only in snapshots, so
the session restores every member from the newest complete one. So does a hand-over
cut short, or one whose held partitions do not add up to the whole state.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.distributed as dist

from phalanx.runtime import default_group
from phalanx.runtime.group import Group
from phalanx.runtime.state import Wait, _fill, _strip

#: The key :meth:`Sharded.state_dict` adds to the replicated state it gives during a
#: hand-over: the receiver holds no entries yet (:meth:`Sharded.load_state_dict`).
PARTITIONED = "phalanx_partitioned"

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

    ZeRO's constructor needs a default process group: if the process has none, it gets
    the session's (:mod:`.default_group`), rank 0 of 1 until the replica applies a
    generation (the session never uses it for training: each generation has its own group).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not dist.is_initialized():  # one the process has, the session's included, is kept
        default_group.answer(0, 1)
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
        #: The consolidated state at the member's committed step, once received or
        #: restored, until the next :meth:`repartition` loads it.
        self.full: dict[str, Any] | None = None
        #: :attr:`full` holds only the entries of one partition (a restore's, :meth:`keeps`;
        #: a hand-over's).
        self.partial = False
        #: The partition (rank, world size) this member holds through a planned change:
        #: :attr:`full`'s entries if it has one, else its live ones.
        self.held: tuple[int, int] | None = None

    @property
    def holds_all(self) -> bool:
        """Whether this member can give the whole optimizer state of its committed step:
        it holds the consolidated state, or its optimizer was never partitioned."""
        if self.full is not None:
            return not self.partial
        return self.zero.world_size == 1

    def owners(self, world_size: int) -> dict[int, int]:
        """The owner of each global parameter index at ``world_size``, computed the way
        ZeRO computes its own partition."""
        zero = self.zero
        was = zero.world_size
        zero.world_size = world_size
        zero._clear_cache()
        try:
            return {zero._param_to_index[p]: owner for p, owner in zero._param_to_rank.items()}
        finally:
            zero.world_size = was
            zero._clear_cache()

    def keeps(self, rank: int, world_size: int) -> Callable[[int], bool]:
        """Whether the entry of a global parameter index belongs to ``rank``'s partition at
        ``world_size`` (a restore then builds only those: :meth:`load_partition`)."""
        owners = self.owners(world_size)
        return lambda index: owners.get(index) == rank

    def load_partition(self, state: dict[str, Any]) -> None:
        """Keep ``state``, the consolidated state's param groups with only the entries of
        the partition :meth:`repartition` will point this member at."""
        self.full, self.partial = state, True

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state (ZeRO's ``state_dict`` format); during a hand-over
        (:attr:`held`), only the replicated state, marked (:data:`PARTITIONED`): the
        entries go from owner to owner (:meth:`take_over`).

        Raises:
            RuntimeError: the member holds only a partition, outside a hand-over.
        """
        if self.held is not None:
            return {**self._base(), "state": {}, PARTITIONED: True}
        if not self.holds_all:
            raise RuntimeError(f"rank {self.zero.rank} of {self.zero.world_size} holds only "
                               "a partition of the optimizer state")
        return self._whole()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep ``state`` (consolidated, or a hand-over's replicated state: then this
        member holds no entries until :meth:`take_over`) for the next :meth:`repartition`."""
        partitioned = bool(state.get(PARTITIONED))
        self.full = {k: v for k, v in state.items() if k != PARTITIONED}
        self.partial = partitioned

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
        if self.full is None and not self.holds_all:
            raise RuntimeError(f"rank {self.zero.rank} of {self.zero.world_size} holds only "
                               "a partition of the optimizer state")
        full = self.full if self.full is not None else self._whole()
        zero = self.zero
        zero.rank, zero.global_rank, zero.world_size = rank, rank, world_size
        zero._clear_cache()
        zero._init_local_optimizer()
        self.full, self.partial, self.held = None, False, None
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

    # --- a planned membership change ------------------------------------------------------

    def hold(self) -> None:
        """A join: keep this member's live partition through the switch, for the new
        group's :meth:`agree` and :meth:`take_over`."""
        self.held = (self.zero.rank, self.zero.world_size)

    def hand_to(self, pg: Group, wait: Wait, new_ranks: list[int], world_size: int) -> int:
        """A leave, over the old group ``pg`` (the one the optimizer is partitioned over),
        before the switch: ``new_ranks[r]`` is the rank in ``pg`` of the member that is
        rank ``r`` of the ``world_size`` new ones. Each of them ends holding its new
        partition's entries (:attr:`held`), the others none. Returns the bytes this member
        sent and received; raises :class:`~.group.Aborted` from ``wait`` if ``pg`` is
        abandoned (then nothing is held: the new generation restores a snapshot)."""
        new = {index: new_ranks[owner] for index, owner in self.owners(world_size).items()}
        entries, nbytes = self._exchange(pg, wait, self.zero.rank,
                                         self.owners(self.zero.world_size), new)
        mine = new_ranks.index(self.zero.rank) if self.zero.rank in new_ranks else None
        self.load_partition({**self._base(), "state": entries})
        self.held = None if mine is None else (mine, world_size)
        return nbytes

    def agree(self, pg: Group, wait: Wait, rank: int, world_size: int,
              step: int) -> dict[int, int] | None:
        """In a new group ``pg`` (this member ``rank`` of ``world_size``, at committed
        ``step``): do the members' held partitions add up to one step's whole state? Then
        the rank in ``pg`` that holds each global parameter index; otherwise none is held
        any more (the members restore a snapshot) and None."""
        rows = torch.zeros(world_size, 4, dtype=torch.int64)
        if self.held is not None:
            rows[rank] = torch.tensor([1, *self.held, step])
        wait(pg.allreduce([rows]))
        holding = {int(r): (int(k), int(s), member)
                   for member, (flag, r, k, s) in enumerate(rows.tolist()) if flag}
        shapes = {(k, s) for k, s, _ in holding.values()}
        if len(shapes) != 1 or sorted(holding) != list(range(next(iter(shapes))[0])) \
                or len(holding) != sum(row[0] for row in rows.tolist()):
            self.held = None
            return None
        (k, _), = shapes
        return {index: holding[owner][2] for index, owner in self.owners(k).items()}

    def take_over(self, pg: Group, wait: Wait, rank: int, world_size: int,
                  holders: dict[int, int]) -> int:
        """In the new group ``pg``: each member receives its new partition's entries (rank
        ``rank`` of ``world_size``) straight from their ``holders`` (:meth:`agree`), and
        keeps them for :meth:`repartition`. Returns the bytes this member sent and
        received; raises :class:`~.group.Aborted` from ``wait`` if ``pg`` is abandoned (the
        held partitions stay as they were, for the next generation's :meth:`agree`)."""
        entries, nbytes = self._exchange(pg, wait, rank, holders, self.owners(world_size))
        self.load_partition({**self._base(), "state": entries})
        self.held = None
        return nbytes

    def _base(self) -> dict[str, Any]:
        """The replicated state this member holds: received in a hand-over, or its own."""
        return {**(self.full if self.full is not None else self.replicated_state()),
                "state": {}}

    def _whole(self) -> dict[str, Any]:
        """The consolidated state, from a member that holds it (:attr:`holds_all`)."""
        if self.full is not None:
            return self.full
        return {**self.replicated_state(), "state": self.owned_state()}

    def _held_entries(self) -> dict[int, Any]:
        """The entries this member holds for a hand-over: kept ones, else its live ones."""
        if self.full is not None:
            return dict(self.full["state"])
        return self.owned_state()

    def _exchange(self, pg: Group, wait: Wait, rank: int, old: dict[int, int],
                  new: dict[int, int]) -> tuple[dict[int, Any], int]:
        """This member being ``rank`` of ``pg``: move each entry from its holder
        (``old``: global index -> rank) to its
        new owner (``new``), point to point: a header (the entries' structure, each
        tensor's shape and dtype) then the tensors, every pair at once. Returns the entries
        this member owns at ``new`` and the bytes it sent and received."""
        held = self._held_entries()
        kept = {i: entry for i, entry in held.items() if new.get(i) == rank}
        outgoing: dict[int, dict[int, Any]] = {}
        sources: set[int] = set()
        for index, src in old.items():
            dst = new[index]
            if src == rank and dst != rank and index in held:
                outgoing.setdefault(dst, {})[index] = held[index]
            elif dst == rank and src != rank:
                sources.add(src)
        tensors: dict[int, list[torch.Tensor]] = {dst: [] for dst in outgoing}
        headers = {dst: pickle.dumps((skeleton, [(tuple(t.shape), t.dtype) for t in
                                                 tensors[dst]]))
                   for dst, skeleton in ((dst, _strip(entries, tensors[dst]))
                                         for dst, entries in outgoing.items())}
        sizes = {src: torch.zeros(1, dtype=torch.int64) for src in sorted(sources)}
        works = [pg.send([torch.tensor([len(header)], dtype=torch.int64)], dst, 0)
                 for dst, header in headers.items()]
        works += [pg.recv([size], src, 0) for src, size in sizes.items()]
        for work in works:
            wait(work)
        payloads = {src: torch.empty(int(size.item()), dtype=torch.uint8)
                    for src, size in sizes.items()}
        works = [pg.send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], dst, 1)
                 for dst, header in headers.items()]
        works += [pg.recv([payload], src, 1) for src, payload in payloads.items()]
        for work in works:
            wait(work)
        device = next(iter(self.zero._param_to_index)).device  # where the owners' lie
        received: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        for src, payload in payloads.items():
            skeleton, shapes = pickle.loads(payload.numpy().tobytes())  # from a peer rank
            received[src] = (skeleton, [torch.empty(shape, dtype=dtype, device=device)
                                        for shape, dtype in shapes])
        works = [pg.send([t.detach().reshape(-1).contiguous()], dst, 2 + i)
                 for dst, sent in tensors.items() for i, t in enumerate(sent)]
        works += [pg.recv([t.view(-1)], src, 2 + i)
                  for src, (_, into) in received.items() for i, t in enumerate(into)]
        for work in works:
            wait(work)
        for skeleton, into in received.values():
            kept.update(_fill(skeleton, into))
        moved = [t for sent in tensors.values() for t in sent] + \
            [t for _, into in received.values() for t in into]
        return dict(sorted(kept.items())), sum(t.numel() * t.element_size() for t in moved)
