"""torch.distributed's default group under the session: ``dist.get_rank()`` and
``dist.get_world_size()`` answer for the generation this replica applied last.

A DDP script asks the default group who it is wherever it decides something
per rank: the log line and the save on rank 0, a data path, a seed. Under the
session the membership changes, so each time this replica applies a
generation the default group is made again, with no communication: a process
group of this module's backend, ``phalanx``, that holds the rank and the size
and nothing else. Alone it is rank 0 of 1. Before a replica's first
generation, and once it is no longer a member (dropped, or left in a planned
shrink), the process has no default group (``dist.is_initialized()`` is
False).

A collective on it is refused by name. The session's collectives are
abortable: a peer that dies aborts them and the step runs again in the next
generation. A collective on a default group would block on a dead peer, or
mix members of two generations, so a rank's number goes into the step's own
reduce instead (``metrics=`` and :meth:`~.step.Step.add`).

The session owns the default group, also one the script made itself before
it: a DDP script keeps its own ``dist.init_process_group(...)``, which under
phalanx makes the first gang's group (torchrun's variables) or, for a replica
of a job that has a generation, a world of one; alone, a world of one too
(``torchrun --nproc-per-node 1``). That group says nothing true once the
membership changes, so the session destroys it (:func:`take_over`) and makes
its own. Alone, a script's group of more than one rank is refused: a session
outside phalanx trains alone.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist

from phalanx.schemas.environment import JOB_ID, WORLD_OF_ONE_MARK

#: The backend's name, as ``dist.get_backend()`` gives it.
BACKEND = "phalanx"

#: The collectives a ``ProcessGroup`` offers, each refused on this one.
_COLLECTIVES = (
    "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base",
    "allreduce", "allreduce_coalesced", "alltoall", "alltoall_base", "barrier", "broadcast",
    "gather", "monitored_barrier", "recv", "recv_anysource", "reduce", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "scatter", "send")


class MembershipGroup(dist.ProcessGroup):
    """A default process group that is a rank and a size: its collectives are refused."""

    def refuse(self) -> NoReturn:
        raise RuntimeError(
            f"a collective on the default process group (rank {self.rank()} of "
            f"{self.size()}): under phalanx it only says who this rank is; the session's "
            "collectives are the abortable ones (add a number to the step's reduce with "
            "metrics= and step.add, or use session.pg)")


def _refused(self: MembershipGroup, *args: Any, **kwargs: Any) -> NoReturn:
    self.refuse()  # a subclass says what the collective was for


for _name in _COLLECTIVES:
    if hasattr(dist.ProcessGroup, _name):
        setattr(MembershipGroup, _name, _refused)


def _create(store: dist.Store, rank: int, world_size: int, timeout: Any) -> MembershipGroup:
    # The (rank, size) constructor: the only one a Python subclass may use (torch's stub
    # lists the one with a store alone).
    return MembershipGroup(rank, world_size)  # type: ignore[call-arg]


def _registered() -> None:
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def ours() -> bool:
    """Whether the process's default group is the session's (not one of the script's)."""
    return dist.is_initialized() and dist.get_backend() == BACKEND


def take_over(alone: bool) -> None:
    """Destroy a default group the script made before the session (see the module
    docstring); ``alone``: outside phalanx, where only a world of one is the session's.

    Raises:
        RuntimeError: alone, the script's default group has more than one rank.
    """
    if not dist.is_initialized() or ours():
        return
    if alone and dist.get_world_size() > 1:
        raise RuntimeError(
            f"this process's default group has {dist.get_world_size()} ranks, but outside "
            f"phalanx (no {JOB_ID}) the session trains alone: submit the script to "
            "phalanx, or run one process (torchrun --nproc-per-node 1)")
    dist.destroy_process_group()


def _without_rank_prefixes(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` less the wrappers torch's ``init_process_group`` put around it, each of
    which prefixes a traceback's lines with the rank it was made for."""
    while getattr(hook, "__name__", "") == "_distributed_excepthook":
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=True))
        if "old_hook" not in cells:  # a torch that wraps it otherwise: left as it is
            break
        hook = cells["old_hook"].cell_contents
    return hook


def answer(rank: int, world_size: int) -> None:
    """Make the default group say ``rank`` of ``world_size``."""
    if dist.is_initialized():
        if ours() and (dist.get_rank(), dist.get_world_size()) == (rank, world_size):
            return
        dist.destroy_process_group()
    _registered()
    # Each group made wraps the exception hook once more: a traceback then said every
    # rank this process ever had ("[rank1]: [rank2]: [rank0]: ..."). Only this one's.
    sys.excepthook = _without_rank_prefixes(sys.excepthook)
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)


def clear() -> None:
    """No default group: this replica is no longer a member."""
    if ours():
        dist.destroy_process_group()


def _warns_before_the_session(get_rank: Callable[..., int]) -> Callable[..., int]:
    """``dist.get_rank`` that warns, asked of a world of one the agent started (every
    replica of a job that declares ``session: true``) before the session took it over:
    the answer, 0, is every replica's, so a ``rank = dist.get_rank()`` kept from before
    the session makes each one rank 0 (all validate, all write the same file)."""
    @functools.wraps(get_rank)
    def guarded(group: Any = None) -> int:
        if group is None and os.environ.get(WORLD_OF_ONE_MARK) == "1" \
                and dist.is_initialized() and not ours():
            warnings.warn(
                "dist.get_rank() before the phalanx session is 0 in every replica (each "
                "process's own group is a world of one until the session knows the "
                "membership): ask it after ElasticSession.from_env(...), which makes it "
                "the rank of each generation, or use session.is_primary",
                RuntimeWarning, stacklevel=2)
        return get_rank(group)

    guarded.phalanx_guard = True  # type: ignore[attr-defined]
    return guarded


if not getattr(dist.get_rank, "phalanx_guard", False):
    dist.get_rank = _warns_before_the_session(dist.get_rank)
