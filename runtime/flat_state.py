"""A rank's state as one flat byte sequence, and back.

The state (the tensors and skeletons :mod:`.state` copies: the model's ``state_dict``,
the optimizer's, every registered object's, the RNG, the step) is laid out as one flat
byte sequence of ``N`` bytes, the tensors in that order at the offsets
:func:`~phalanx.schemas.snapshot_file.layout` gives (:func:`flat_state`, no copy: the
byte views alias the live tensors), with a *meta* (what is not in a tensor) that turns
the bytes back into the state. :func:`copy_range` copies any byte range of it out, one
memcpy per tensor; :func:`load_flat` and :func:`load_tensors` load such bytes back into
a model, an optimizer and the registered objects, refusing a state that does not fit.
The in-memory snapshots (:mod:`.snapshot`) and the durable tier (:mod:`.durable`) both
write and read this layout.

A model sharded in a replica group (:mod:`.replica_group`: FSDP2's DTensors) is laid
out as this rank's local shards, with what makes each optimizer tensor a DTensor again
(its :class:`~.replica_group.ShardSpec`, in the meta): rank ``s`` of a group writes and
loads shard ``s`` only, never the model whole. The meta also names where each local
tensor lies in its global one (``meta["global"]``: its global shape and offsets), so the
durable tier writes it as its box of the global tensor (:mod:`.durable`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from phalanx.runtime.replica_group import global_box, local, meshes_of, rewrap, shard_spec
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.state import _fill, _strip
from phalanx.schemas import snapshot_file
from phalanx.schemas.snapshot_file import SnapshotFileError


@dataclasses.dataclass(frozen=True)
class FlatState:
    """The state as one flat byte sequence: its tensors in order, and the meta (what is
    not in a tensor) that turns those bytes back into the state."""

    tensors: list[torch.Tensor]  # each as contiguous uint8 bytes
    meta: dict[str, Any]  # also names each tensor's offset (snapshot_file.layout)
    #: A sharded optimizer's entries this rank owns (no other rank holds them): a second
    #: extent, written after the rank's share (its meta is ``meta["owned"]``).
    owned: FlatState | None = None

    @property
    def offsets(self) -> list[int]:
        return cast(list[int], self.meta["offsets"])

    @property
    def total(self) -> int:
        return cast(int, self.meta["total"])

    @property
    def device(self) -> torch.device:
        """Where its tensors are: a GPU if any of them is on one, else the CPU."""
        return next((t.device for t in self.tensors if t.device.type != "cpu"),
                    torch.device("cpu"))

    def extent(self, shard: int, shards: int) -> tuple[int, int]:
        """Shard ``shard``'s bytes in a snapshot: ``(offset, length)``, the length counting
        its owned extent after its share of the replicated bytes."""
        offset, length = snapshot_file.share(self.total, shard, shards)
        return offset, length + (0 if self.owned is None else self.owned.total)


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | Sharded,
               extra: Mapping[str, Any], step: int) -> FlatState:
    """``model``, ``optimizer`` and ``extra``'s state at ``step`` as a :class:`FlatState`
    (no copy: the byte views alias the live tensors).

    A sharded optimizer's param groups are replicated state; its per-parameter entries
    are this rank's alone (:attr:`FlatState.owned`).
    """
    model_state = model.state_dict()
    boxes = [global_box(t) for t in model_state.values()]
    model_tensors = [local(t).detach() for t in model_state.values()]
    stripped: list[torch.Tensor] = []
    optimizer_skeleton = _strip(optimizer.replicated_state() if isinstance(optimizer, Sharded)
                                else optimizer.state_dict(), stripped)
    extra_skeletons = {name: _strip(obj.state_dict(), stripped) for name, obj in extra.items()}
    shards = [shard_spec(t) for t in stripped]  # a DTensor's, to make it one again
    boxes += [global_box(t) for t in stripped]
    stripped = [local(t) for t in stripped]
    tensors = [_bytes_of(t.detach()) for t in model_tensors + stripped]
    offsets, total = snapshot_file.layout([t.numel() for t in tensors])
    # The RNG state as bytes: pickled as a tensor it took 0.1 ms of the meta's 0.12 ms,
    # a fixed cost of every snapshot that a small model's step notices.
    meta = {"step": step, "rng": torch.get_rng_state().numpy().tobytes(),
            "optimizer": optimizer_skeleton,
            "extra": extra_skeletons, "model_tensors": len(model_tensors),
            "model_names": list(model_state),
            "tensors": [(tuple(t.shape), str(t.dtype)) for t in model_tensors + stripped],
            "offsets": offsets, "total": total}
    if any(spec is not None for spec in shards):
        meta["shards"] = shards
    if any(box is not None for box in boxes):
        meta["global"] = boxes
    owned = _owned_flat(optimizer.owned_state()) if isinstance(optimizer, Sharded) else None
    if owned is not None:
        meta["owned"] = owned.meta
    return FlatState(tensors, meta, owned)


def _owned_flat(owned: dict[int, Any]) -> FlatState:
    """A sharded optimizer's entries owned by this rank, keyed by global parameter index,
    as a flat state of their own."""
    stripped: list[torch.Tensor] = []
    skeleton = _strip(owned, stripped)
    tensors = [_bytes_of(t.detach()) for t in stripped]
    offsets, total = snapshot_file.layout([t.numel() for t in tensors])
    return FlatState(tensors, {"state": skeleton, "offsets": offsets, "total": total,
                               "tensors": [(tuple(t.shape), str(t.dtype)) for t in stripped]})


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return (flat if flat.is_contiguous() else flat.contiguous()).view(torch.uint8)


def copy_range(state: FlatState, start: int, out: torch.Tensor,
               non_blocking: bool = False) -> None:
    """Copy bytes ``[start, start + len(out))`` of the flat ``state`` into ``out``: one
    memcpy per overlapped tensor, nothing concatenated, the alignment gaps zeroed;
    ``non_blocking``: a device tensor's copy into pinned ``out`` is only enqueued."""
    end, done = start + out.numel(), start
    for tensor, at in zip(state.tensors, state.offsets, strict=True):
        lo, hi = max(start, at), min(end, at + tensor.numel())
        if lo < hi:
            out[done - start:lo - start].zero_()
            out[lo - start:hi - start].copy_(tensor[lo - at:hi - at], non_blocking=non_blocking)
            done = hi
        if at >= end:
            break
    out[done - start:].zero_()


def tensors_in(flat: torch.Tensor, meta: dict[str, Any],
               only: set[int] | None = None) -> list[torch.Tensor]:
    """Copies of the tensors ``meta`` lays out in ``flat`` (:func:`flat_state`); ``only``:
    just those indices (the others are empty placeholders)."""
    tensors = []
    for i, ((shape, dtype), at) in enumerate(zip(meta["tensors"], meta["offsets"],
                                                 strict=True)):
        if only is not None and i not in only:
            tensors.append(torch.empty(0))
            continue
        tensor = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
        size = tensor.numel() * tensor.element_size()
        tensor.reshape(-1).view(torch.uint8).copy_(flat[at:at + size])
        tensors.append(tensor)
    return tensors


def load_flat(flat: torch.Tensor, meta: dict[str, Any], model: torch.nn.Module,
              optimizer: torch.optim.Optimizer | Sharded, extra: Mapping[str, Any],
              owned: dict[int, Any] | None = None,
              keep: Callable[[int], bool] | None = None) -> None:
    """Load the state ``flat`` holds (laid out as :func:`flat_state` says in ``meta``);
    ``owned``: a sharded optimizer's per-parameter entries, gathered from every owner;
    ``keep``: as for :func:`load_tensors`.

    Raises:
        SnapshotFileError: the snapshot does not fit this model or these registered objects.
    """
    load_tensors(tensors_in(flat, meta), meta, model, optimizer, extra, owned, keep)


def load_tensors(tensors: list[torch.Tensor], meta: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | Sharded, extra: Mapping[str, Any],
                 owned: dict[int, Any] | None = None,
                 keep: Callable[[int], bool] | None = None) -> None:
    """Load the state whose tensors (in :func:`flat_state`'s order) are ``tensors``; a
    sharded optimizer's entries (``owned``) complete its state (the consolidated state
    loads into a plain optimizer as well as a sharded one). ``keep``: ``optimizer`` is a
    sharded one's handle, given only the entries of its new partition (the indices
    ``keep`` accepts: :meth:`~.sharded.Sharded.load_partition`).

    Raises:
        SnapshotFileError: the snapshot does not fit this model or these registered objects.
    """
    model_tensors = [local(t).detach() for t in model.state_dict().values()]
    if meta["model_tensors"] != len(model_tensors) or sorted(meta["extra"]) != sorted(extra):
        raise SnapshotFileError(
            f"the snapshot holds {meta['model_tensors']} model tensors and "
            f"{sorted(meta['extra'])}; this rank has {len(model_tensors)} and {sorted(extra)}")
    for i, tensor in enumerate(tensors):
        shape, kind = tuple(tensor.shape), tensor.dtype
        if i < len(model_tensors):
            mine = model_tensors[i]
            if tuple(mine.shape) != tuple(shape) or mine.dtype != kind:
                raise SnapshotFileError(f"model tensor {i}: the snapshot has {kind}"
                                        f"{list(shape)}, this model {mine.dtype}"
                                        f"{list(mine.shape)}")
            with torch.no_grad():
                mine.copy_(tensor)
    rest = tensors[len(model_tensors):]
    if "shards" in meta:  # a replica group rank's shards: DTensors over its group's mesh
        meshes = meshes_of(model)
        device = model_tensors[0].device
        rest = [rewrap(t if spec is None else t.to(device), spec, meshes)
                for t, spec in zip(rest, meta["shards"], strict=True)]
    optimizer_state = _fill(meta["optimizer"], rest)
    if owned is not None:
        optimizer_state = {**optimizer_state, "state": dict(sorted(owned.items()))}
    if keep is None:
        optimizer.load_state_dict(optimizer_state)
    else:
        assert isinstance(optimizer, Sharded)
        optimizer.load_partition({**optimizer_state, "state": {
            index: entry for index, entry in optimizer_state["state"].items() if keep(index)}})
    for name, skeleton in meta["extra"].items():
        extra[name].load_state_dict(_fill(skeleton, rest))
    rng = meta["rng"]  # a tensor in snapshots and durable steps written before 2026-11-23
    torch.set_rng_state(rng if isinstance(rng, torch.Tensor)
                        else torch.frombuffer(bytearray(rng), dtype=torch.uint8))

