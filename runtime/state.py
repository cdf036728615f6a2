"""A rank's training state, copied straight from one process to another.

The state is the model's ``state_dict``, the optimizer's, the committed step,
the RNG state and the ``state_dict`` of every object the script registered
with the session (LR schedulers, an EMA of the weights, a loss scaler: any
object with ``state_dict``/``load_state_dict``). It travels over the
generation's process group (point-to-point: gloo, or NCCL from device to
device), never through NATS: first a small header (the step, the RNG state, the
optimizer's non-tensor state, and each tensor's shape, dtype and byte count,
optionally its Adler-32), then
every tensor as it is, received in place into the model's own parameters. The
receiver checks every tensor against its own model before anything moves and
every checksum after, so a state that does not fit, or arrives damaged, is
refused whole with an error naming the tensor.
"""

from __future__ import annotations

import dataclasses
import pickle
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from phalanx.runtime.group import Group, GroupWork
from phalanx.runtime.replica_group import local, meshes_of, rewrap, shard_spec

#: Waits for a work item of the generation's group; raises if it failed or was aborted.
Wait = Callable[[GroupWork], None]


class Stateful(Protocol):
    """What state is taken from and put back into: an optimizer, or the session's handle
    on a sharded one (:class:`~.sharded.Sharded`)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


class StateTransferError(RuntimeError):
    """The state received does not match this rank's model, or arrived damaged."""


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    index: int


@dataclasses.dataclass(frozen=True)
class TransferStats:
    nbytes: int
    tensors: int


def _checksum(tensor: torch.Tensor) -> int:
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
    return zlib.adler32(np.ascontiguousarray(data).data)


def _describe(tensors: list[torch.Tensor], checksum: bool) -> list[tuple[Any, ...]]:
    return [(tuple(t.shape), str(t.dtype), t.numel() * t.element_size(),
             _checksum(t) if checksum else None) for t in tensors]


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a reference into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: Sequence[object]) -> Any:
    """``obj`` with every reference replaced by its item of ``tensors`` (the tensors
    :func:`_strip` took out, or anything else that stands for them)."""
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def tensor_refs(skeleton: Any) -> set[int]:
    """The tensor indices a skeleton (:func:`_strip`'s) refers to."""
    if isinstance(skeleton, _TensorRef):
        return {skeleton.index}
    if isinstance(skeleton, dict):
        return set().union(*map(tensor_refs, skeleton.values())) if skeleton else set()
    if isinstance(skeleton, list | tuple):
        return set().union(*map(tensor_refs, skeleton)) if skeleton else set()
    return set()


def broadcast_tensor(pg: Group, wait: Wait, rank: int, source: int,
                     data: torch.Tensor | None) -> torch.Tensor:
    """The uint8 tensor ``data`` of member ``source`` (None on the others), on every
    member: its length, then its bytes."""
    size = torch.tensor([data.numel() if rank == source and data is not None else 0],
                        dtype=torch.int64)
    wait(pg.broadcast(size, source))
    payload = data if rank == source else torch.empty(int(size), dtype=torch.uint8)
    assert payload is not None
    if payload.numel():
        wait(pg.broadcast(payload, source))
    return payload


def broadcast_bytes(pg: Group, wait: Wait, rank: int, source: int,
                    data: bytes | None) -> bytes:
    """``data`` of member ``source`` (None on the others), on every member."""
    payload = broadcast_tensor(pg, wait, rank, source, None if data is None else
                               torch.frombuffer(bytearray(data), dtype=torch.uint8)
                               if data else torch.empty(0, dtype=torch.uint8))
    return payload.numpy().tobytes()


def send_state(pg: Group, dst: int, model: torch.nn.Module,
               optimizer: Stateful, step: int, wait: Wait, *,
               checksum: bool = False, extra: Mapping[str, Any] | None = None) -> TransferStats:
    """Send this rank's state to rank ``dst`` of ``pg``.

    ``extra``: name -> object with ``state_dict()``, sent after the optimizer's state
    (the receiver must hold objects of the same names).
    """
    model_tensors = [local(t) for t in model.state_dict().values()]
    optim_tensors: list[torch.Tensor] = []
    optim_skeleton = _strip(optimizer.state_dict(), optim_tensors)
    extra_skeletons = {name: _strip(obj.state_dict(), optim_tensors)
                       for name, obj in (extra or {}).items()}
    # A sharded model's state goes as this rank's shards, each with what makes it a
    # DTensor again on the receiver (rank s of a group sends to rank s of another).
    shards = [shard_spec(t) for t in optim_tensors]
    tensors = model_tensors + [local(t) for t in optim_tensors]
    header = pickle.dumps({
        "step": step, "rng": torch.get_rng_state(), "optimizer": optim_skeleton,
        "extra": extra_skeletons, "model_tensors": len(model_tensors),
        "tensors": _describe(tensors, checksum), "shards": shards})
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    wait(pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0))
    wait(pg.send([payload], dst, 1))
    # All posted at once: gloo moves the next tensor while the previous one is consumed.
    works = [pg.send([tensor.detach().reshape(-1).contiguous()], dst, 2 + i)
             for i, tensor in enumerate(tensors)]
    for work in works:
        wait(work)
    return TransferStats(sum(t.numel() * t.element_size() for t in tensors), len(tensors))


def receive_state(pg: Group, src: int, model: torch.nn.Module,
                  optimizer: Stateful, wait: Wait,
                  landing: list[torch.Tensor] | None = None, *,
                  extra: Mapping[str, Any] | None = None) -> tuple[int, TransferStats]:
    """Receive rank ``src``'s state into ``model``, ``optimizer`` and ``extra``'s objects
    (``load_state_dict`` of each); returns its step.

    ``landing``: tensors the optimizer's state may be received into (from
    :func:`landing_buffers`), used where shape and dtype match; the rest is allocated.

    Raises:
        StateTransferError: a tensor does not fit this model, a checksum differs, the
            peer registered other objects than ``extra``'s names, or one of them refused
            its state.
    """
    size = torch.zeros(1, dtype=torch.int64)
    wait(pg.recv([size], src, 0))
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    wait(pg.recv([payload], src, 1))
    header = pickle.loads(payload.numpy().tobytes())  # from a peer of the same job
    described = header["tensors"]
    extra = dict(extra or {})
    if sorted(header["extra"]) != sorted(extra):
        raise StateTransferError(f"the peer carries the state of {sorted(header['extra'])}, "
                                 f"this rank registered {sorted(extra)}")
    model_tensors = [local(t).detach() for t in model.state_dict().values()]
    # What is not received straight into the model lands on its device (the optimizer's
    # load_state_dict then keeps each entry where its parameter wants it).
    device = model_tensors[0].device if model_tensors else torch.device("cpu")
    if header["model_tensors"] != len(model_tensors):
        raise StateTransferError(f"the peer's model has {header['model_tensors']} tensors, "
                                 f"this one {len(model_tensors)}")
    for i, (mine, (shape, dtype, _, _)) in enumerate(zip(model_tensors, described,
                                                         strict=False)):
        if tuple(mine.shape) != tuple(shape) or str(mine.dtype) != dtype:
            raise StateTransferError(f"model tensor {i}: the peer sends {dtype}{list(shape)}, "
                                     f"this model has {mine.dtype}{list(mine.shape)}")
    spare: dict[tuple[tuple[int, ...], str], list[torch.Tensor]] = {}
    for tensor in landing or []:
        if tensor.is_contiguous():
            spare.setdefault((tuple(tensor.shape), str(tensor.dtype)), []).append(tensor)
    received: list[torch.Tensor] = []
    for i, (shape, dtype, nbytes, _) in enumerate(described):
        if i < len(model_tensors) and model_tensors[i].is_contiguous():
            target = model_tensors[i]  # straight into the parameter
        elif spare.get((tuple(shape), dtype)):
            target = spare[(tuple(shape), dtype)].pop()  # memory already touched
        else:
            target = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                                 device=device)
        if target.numel() * target.element_size() != nbytes:
            raise StateTransferError(f"tensor {i}: {nbytes} bytes announced, "
                                     f"{target.numel() * target.element_size()} expected")
        received.append(target)
    works = [pg.recv([target.view(-1)], src, 2 + i) for i, target in enumerate(received)]
    for work in works:
        wait(work)
    for i, (tensor, (_, _, _, expected)) in enumerate(zip(received, described, strict=True)):
        if expected is not None and _checksum(tensor) != expected:
            raise StateTransferError(f"tensor {i}: checksum mismatch (damaged in transit)")
    with torch.no_grad():
        for mine, tensor in zip(model_tensors, received, strict=False):
            if mine.data_ptr() != tensor.data_ptr():
                mine.copy_(tensor)
    meshes = meshes_of(model)
    rest = [rewrap(tensor, spec, meshes) for tensor, spec in
            zip(received[len(model_tensors):], header["shards"], strict=True)]
    optimizer.load_state_dict(_fill(header["optimizer"], rest))
    for name, skeleton in header["extra"].items():
        try:
            extra[name].load_state_dict(_fill(skeleton, rest))
        except Exception as exc:  # the object's own check: a state it cannot take
            raise StateTransferError(f"{name!r} refused the peer's state: {exc}") from exc
    torch.set_rng_state(header["rng"])
    return header["step"], TransferStats(sum(d[2] for d in described), len(described))


def landing_buffers(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer``'s state will hold, allocated and written once.

    A replica about to receive its state from a peer would otherwise allocate the
    optimizer's state as it arrives, and first writes to fresh memory (page faults)
    made that copy three to four times slower than the transfer itself. So, before
    it is ready, the replica takes one throwaway optimizer step on zero gradients
    (which creates the state whatever the optimizer), keeps the state's tensors for
    :func:`receive_state`, and puts the parameters, gradients and optimizer back as
    they were. Returns [] for an optimizer that already has state, or whose step
    cannot run so (one that needs a closure).
    """
    if optimizer.state:
        return []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        buffers: list[torch.Tensor] = []
        _strip(optimizer.state_dict()["state"], buffers)
        return buffers
    except Exception:  # the optimizer's own: it cannot step without more; nothing lost
        return []
    finally:
        optimizer.state.clear()
        with torch.no_grad():
            for p, value, grad in zip(params, saved, grads, strict=True):
                p.copy_(value)
                p.grad = grad
