"""Loading a durable step into a model sharded over a replica group, at any group size.

A job of replica groups writes each DTensor as the boxes its ranks hold
(:func:`~.layout.shard_boxes`): a committed step is one plain DCP checkpoint of
the global tensors, whatever S and R wrote it. A group's rank restoring it asks
DCP for its own part of every tensor: it loads into a state dict of DTensors
over its own group's mesh (the placements the step's ranks had, on the mesh of
the same dimension names this job has now), and DCP reads from each file the
chunks that overlap its box. So a step written by groups of S ranks restores
into groups of any other size (DCP reshards on load), and no rank reads the
model whole.

Before anything is read the step is checked against this model
(:func:`targets`, :func:`problems`): the same tensors of the same global shapes,
a mesh of the same dimensions for every sharded one, and every element of every
tensor in some chunk of the step. A step that fails raises
:class:`DurableLayoutError`, naming what does not fit; nothing is loaded.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from phalanx.runtime.durable.layout import _flatten, dtype_of, state_dict_of
from phalanx.runtime.replica_group import ShardSpec, local, meshes_of
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.state import _fill

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

class DurableLayoutError(ValueError):
    """A committed durable step that cannot be loaded into this model: another model, a
    group layout that cannot be resharded into this one, or tensors the step does not
    hold whole (the message names which)."""


def targets(meta: dict[str, Any], model: torch.nn.Module) -> list[torch.Tensor]:
    """Empty tensors to read the step ``meta`` describes (its global meta,
    :func:`~.layout.global_meta`) into, in the flat state's order: a DTensor over this
    process's mesh for each tensor the step's ranks held sharded, its global shape.

    Raises:
        DurableLayoutError: the step's model is not this one, or a tensor was sharded over
            a mesh whose dimensions no mesh of this model has.
    """
    live = model.state_dict()
    names = meta["model_names"]
    if list(live) != list(names):
        lacks = [n for n in names if n not in live][:3]
        extra = [n for n in live if n not in names][:3]
        raise DurableLayoutError(f"the step's model is not this one: this model lacks "
                                 f"{lacks} and has {extra} the step does not")
    found: list[torch.Tensor] = []
    for name, (shape, dtype) in zip(names, meta["tensors"], strict=False):
        mine = live[name]
        if tuple(mine.shape) != tuple(shape) or str(mine.dtype) != str(dtype_of(dtype)):
            raise DurableLayoutError(f"model tensor {name}: the step has {dtype}{list(shape)}, "
                                     f"this model {mine.dtype}{list(mine.shape)}")
        found.append(torch.empty_like(mine))
    rest = meta["tensors"][len(names):]
    specs: list[ShardSpec | None] | None = meta.get("shards")
    if specs is None:
        raise DurableLayoutError("the step was written by a job whose replicas hold the model "
                                 "whole (ranks_per_replica 1): its optimizer state is not "
                                 "sharded as this replica group's")
    meshes = {key[1]: mesh for key, mesh in meshes_of(model).items()}
    device = found[0].device if found else torch.device("cpu")
    for (shape, dtype), spec in zip(rest, specs, strict=True):
        if spec is None:
            found.append(torch.empty(shape, dtype=dtype_of(dtype), device=device))
            continue
        mesh = meshes.get(spec.mesh[1])
        if mesh is None or mesh.ndim != len(spec.placements):
            raise DurableLayoutError(
                f"the step's optimizer state is sharded over a mesh of dimensions "
                f"{spec.mesh[1]} ({len(spec.placements)}-D, {spec.mesh[0][0]} ranks); this "
                f"model's meshes are {sorted(map(str, meshes))}: it cannot be resharded "
                "into this group's layout")
        from torch.distributed.tensor import empty

        found.append(empty(*shape, dtype=dtype_of(dtype), device_mesh=mesh,
                           placements=spec.placements))
    return found


def problems(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """What the DCP checkpoint whose ``.metadata`` entries are ``stored`` lacks of the flat
    state dict ``wanted`` (pure): a key it does not hold, a tensor of another shape, or one
    whose chunks do not cover every element (a partly written step). Empty: it fits."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found = []
    for fqn, value in wanted.items():
        entry = stored.get(fqn)
        if entry is None:
            found.append(f"{fqn}: not in the step")
        elif isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                found.append(f"{fqn}: not a tensor in the step")
                continue
            if tuple(entry.size) != tuple(value.shape):
                found.append(f"{fqn}: the step has shape {list(entry.size)}, this rank "
                             f"{list(value.shape)}")
                continue
            held = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
            if held != math.prod(value.shape):
                found.append(f"{fqn}: the step's chunks hold {held} of its "
                             f"{math.prod(value.shape)} elements (incomplete)")
    return found


def load_sharded(reader: dcp.StorageReader, meta: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | Sharded, extra: Mapping[str, Any],
                 column: int) -> None:
    """Load the committed step that ``reader`` reads (its global meta ``meta``) into
    ``model`` (sharded over a replica group), ``optimizer``, ``extra`` and the RNG
    (column ``column``'s, the rank's in its group), each rank reading its own part.

    Raises:
        DurableLayoutError: the step does not fit this model; nothing is loaded.
    """
    import torch.distributed.checkpoint as dcp

    if sorted(meta["extra"]) != sorted(extra):
        raise DurableLayoutError(f"the step carries {sorted(meta['extra'])}; this rank "
                                 f"registers {sorted(extra)}")
    tensors = targets(meta, model)
    wanted = state_dict_of(meta, tensors)
    flat, _ = _flatten(wanted)
    found = problems(reader.read_metadata().state_dict_metadata, flat)
    if found:
        raise DurableLayoutError(f"durable step {meta['step']} cannot be loaded into this "
                                 f"model: {'; '.join(found[:4])}")
    with warnings.catch_warnings():
        # Each rank reads its own part, on purpose (restore.load says why).
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    with torch.no_grad():
        for name, mine in model.state_dict().items():
            local(mine).copy_(local(wanted["model"][name]))
    n = meta["model_tensors"]
    rest = tensors[n:]
    optimizer.load_state_dict(_fill(meta["optimizer"], rest))
    for name, skeleton in meta["extra"].items():
        extra[name].load_state_dict(_fill(skeleton, rest))
    rngs = meta.get("rngs") or [meta["rng"]]
    rng = rngs[column % len(rngs)]
    torch.set_rng_state(rng if isinstance(rng, torch.Tensor)
                        else torch.frombuffer(bytearray(rng), dtype=torch.uint8))
