"""A replica that is a group of rank processes: a model sharded inside the group.

With ``ranks_per_replica: S`` in the job spec a replica is S processes on one
node, started together by their agent. torchrun's variables describe the group,
so the script's own ``init_process_group()`` makes the group's default process
group, and its device mesh (``init_device_mesh(device, (S,))``, or a 2-D one for
tensor parallelism inside the group) spans the group alone. The script shards
its model over that mesh with FSDP2's ``fully_shard``: each rank holds a part of
the parameters, gradients and optimizer state, so the model need not fit on one
rank. What runs inside the group is the script's; the session never looks in.

The replicate dimension is the session's. Rank ``s`` of a group trains with rank
``s`` of every other group: the generation's *column* ``s``, a process group
of its own per generation (rendezvoused under ``<namespace>/g<s>`` in the
generation's rank 0 store), over which the session all-reduces the rank's
gradient shards (its parameters' local tensors), abortably, as it all-reduces a
whole model's gradients with one rank per replica. FSDP2 sums inside the group
(:func:`prepare`), the columns sum across groups, and every micro-batch's mean
loss is weighted by its share of the global batch, so the gradient is the mean
over the global batch whatever R and S are. A state copy goes column by column:
rank ``s`` of a joining group receives rank ``s``'s shard from a live group,
never the whole model.

A group commits a step or gives it up as one (:meth:`ReplicaGroup.agree`): its
columns' all-reduces can end differently (one column's peer died mid-step while
another column completed), and a group whose ranks held different steps could
not run its own collectives again. The agreement also sums the columns' loss and
metrics into the step's, and makes a switch to a newer generation that any
column agreed on the whole group's.

Alone (no ``PHALANX_JOB_ID``), the same script under ``torchrun
--nproc-per-node S`` is one group and R = 1: the reference a phalanx run of any R
is compared with.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from phalanx.schemas import environment

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Placement

#: How a mesh is named across processes: its ranks and its dimensions' names.
MeshKey = tuple[tuple[Any, ...], tuple[str, ...] | None]
#: A replica group's sum over its ranks (:meth:`ReplicaGroup.agree`), as the restores
#: take it: the columns of a group restore one step or none.
Agree = Callable[[torch.Tensor], torch.Tensor]


class GroupMismatch(ValueError):
    """The model's sharding does not match the replica group the job asked for."""


class GroupLost(RuntimeError):
    """A rank of this process's replica group is gone: the group is out of the job (its
    agent stops its other ranks). Uncaught, the process exits
    :data:`~phalanx.schemas.environment.EXIT_DROPPED`, the job's doing, not the script's."""

    exit_status = environment.EXIT_DROPPED


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What makes a local tensor a DTensor again in another process of the same shape of
    group: the mesh (named by its ranks and dimensions), placements, global shape and
    stride."""

    mesh: MeshKey
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """This process's place in its replica's group: its rank and the group's size, and
    its rank among the group's ranks that take different data (``data_size`` of them:
    all of them under FSDP alone; with tensor parallelism, a tensor-parallel set of
    ranks takes the same batch)."""

    rank: int
    size: int
    data_rank: int = 0
    data_size: int = 0  # 0: ``size``, each rank its own data
    #: The first of the ranks that share its data shard: the one whose record says what
    #: the shard trained on (each sample once).
    records_data: bool = True

    def __post_init__(self) -> None:
        if not self.data_size:
            object.__setattr__(self, "data_rank", self.rank)
            object.__setattr__(self, "data_size", self.size)

    @property
    def copies(self) -> int:
        """How many of the group's ranks train on each of its data shards."""
        return self.size // self.data_size

    def agree(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (float64) summed over the group's ranks, on the group's default
        process group. Not abortable: a rank of the group that dies takes the group with
        it (its agent stops the others), so no rank of the group waits here for long."""
        summed = values.to(torch.float64).clone()
        try:
            dist.all_reduce(summed)
        except RuntimeError as exc:  # gloo's word for a peer that died
            raise GroupLost(f"rank {self.rank} of a replica group of {self.size}: a peer of "
                            f"the group is gone ({exc})") from exc
        return summed


def _dtensor() -> type[DTensor] | None:
    """DTensor's class once torch.distributed.tensor is imported (FSDP2 and tensor
    parallelism import it), else None: no tensor can be one then, and importing it for
    every rank would cost each ~0.5 s of start-up."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(tensor: object) -> bool:
    cls = _dtensor()
    return cls is not None and isinstance(tensor, cls)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local tensor (the same memory),
    any other tensor itself."""
    if is_dtensor(tensor):
        return tensor._local_tensor  # type: ignore[attr-defined, no-any-return]
    return tensor


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """``tensor``'s :class:`ShardSpec` if it is a DTensor, else None."""
    if not is_dtensor(tensor):
        return None
    sharded = cast("DTensor", tensor)
    return ShardSpec(mesh_key(sharded.device_mesh), tuple(sharded.placements),
                     tuple(sharded.shape), tuple(sharded.stride()))


#: Where a local tensor lies in its DTensor: the global shape, and the local box's offsets.
GlobalBox = tuple[tuple[int, ...], tuple[int, ...]]


def global_box(tensor: torch.Tensor) -> GlobalBox | None:
    """Where ``tensor``'s local part lies in it, if it is a DTensor: its global shape and
    the offsets of the local box (as DCP writes it: ``__create_chunk_list__``)."""
    if not is_dtensor(tensor):
        return None
    chunks = tensor.__create_chunk_list__()  # type: ignore[attr-defined]
    if len(chunks) != 1:
        raise GroupMismatch(f"a DTensor of shape {list(tensor.shape)} whose local part is "
                            f"{len(chunks)} boxes of it: not a layout the durable tier writes")
    return tuple(tensor.shape), tuple(chunks[0].offsets)


def mesh_key(mesh: Any) -> MeshKey:
    names = mesh.mesh_dim_names
    return (tuple(mesh.mesh.shape), *mesh.mesh.reshape(-1).tolist()), \
        None if names is None else tuple(names)


def meshes_of(model: torch.nn.Module) -> dict[MeshKey, Any]:
    """The device meshes the model's parameters are sharded over, by key."""
    meshes = (cast("DTensor", p).device_mesh for p in model.parameters() if is_dtensor(p))
    return {mesh_key(mesh): mesh for mesh in meshes}


def rewrap(tensor: torch.Tensor, spec: ShardSpec | None,
           meshes: dict[MeshKey, Any]) -> torch.Tensor:
    """``tensor`` (a local shard) as the DTensor ``spec`` describes, over this process's
    mesh of the same key; ``tensor`` itself when ``spec`` is None.

    Raises:
        GroupMismatch: this process's model has no such mesh.
    """
    if spec is None:
        return tensor
    from torch.distributed.tensor import DTensor

    mesh = meshes.get(spec.mesh)
    if mesh is None:
        raise GroupMismatch(f"a shard over the mesh {spec.mesh} came from a peer, but this "
                            f"rank's model is sharded over {sorted(meshes)}")
    return DTensor.from_local(tensor, mesh, spec.placements, shape=torch.Size(spec.shape),
                              stride=spec.stride, run_check=False)


def assign_gradient(param: torch.Tensor, gradient: torch.Tensor) -> None:
    """Make ``gradient`` (shaped as ``param``'s local tensor) ``param``'s gradient: a
    DTensor over it, sharing its memory, for a sharded parameter."""
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor

        param = cast(DTensor, param)
        param.grad = DTensor.from_local(gradient, param.device_mesh, param.placements,
                                        shape=param.shape, stride=param.stride(),
                                        run_check=False)
    else:
        param.grad = gradient


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (FSDP2, tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())


def of(model: torch.nn.Module, ranks_per_replica: int | None,
       data_parallel: Any = None) -> ReplicaGroup | None:
    """The group this process is a rank of, checked against how ``model`` is sharded;
    None for a model every rank holds whole (one rank per replica).

    ``data_parallel``: the 1-D device mesh (a dimension of the group's) whose ranks take
    different data; None: every rank of the group takes its own.

    ``ranks_per_replica``: the job's (its agent set it); None alone, where the group is
    the script's default process group (``torchrun --nproc-per-node S``).

    Raises:
        GroupMismatch: the job asks for a group but the model is not sharded, or the model
            is sharded over a mesh that is not the group (its size, or a replicate
            dimension the script kept from a plain HSDP script), naming the fix.
    """
    sharded = is_sharded(model)
    expected = ranks_per_replica
    if expected is None:
        expected = dist.get_world_size() if sharded and dist.is_initialized() else 1
    if not sharded:
        if expected > 1:
            raise GroupMismatch(
                f"the job runs {expected} ranks per replica, but the model is not sharded: "
                "shard it over the group's mesh (init_device_mesh(device, "
                f"({expected},)) and fully_shard), or set ranks_per_replica: 1")
        return None
    if not dist.is_initialized() or dist.get_world_size() != expected:
        size = dist.get_world_size() if dist.is_initialized() else 1
        raise GroupMismatch(
            f"the model is sharded, but this process's default group has {size} ranks and "
            f"its replica group {expected}: call dist.init_process_group() (torchrun's "
            "variables, which phalanx sets to the group's) before building the mesh")
    for key, mesh in meshes_of(model).items():
        if mesh.size() != expected or sorted(mesh.mesh.reshape(-1).tolist()) \
                != list(range(expected)):
            raise GroupMismatch(
                f"the model is sharded over a mesh of {mesh.size()} ranks {key}, but the "
                f"replica group has {expected}: build the mesh over the group alone, "
                f"init_device_mesh(device, ({expected},)) (or a 2-D one for tensor "
                "parallelism within it); the replicate dimension is phalanx's, which "
                "all-reduces across the groups")
    if data_parallel is None:
        return ReplicaGroup(dist.get_rank(), expected)
    if data_parallel.ndim != 1 or expected % data_parallel.size():
        raise GroupMismatch(f"data_parallel must be one dimension of the group's mesh, got "
                            f"a mesh of shape {tuple(data_parallel.shape)} in a group of "
                            f"{expected}: pass mesh[\"dp\"]")
    data_rank = data_parallel.get_local_rank()
    shards = torch.zeros(expected, dtype=torch.int64)
    shards[dist.get_rank()] = data_rank
    dist.all_reduce(shards)  # every rank's data shard, once, as the group starts
    return ReplicaGroup(dist.get_rank(), expected, data_rank, data_parallel.size(),
                        records_data=shards.tolist().index(data_rank) == dist.get_rank())


def prepare(model: torch.nn.Module) -> None:
    """Make FSDP2 *sum* gradients inside the group (the session weights each micro-batch
    by its share of the global batch, and the columns sum across groups): no division,
    and gloo's SUM rather than an average or a pre-multiplied sum, which gloo lacks."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
