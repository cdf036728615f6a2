"""A state on a GPU copied off the device on a side CUDA stream, behind the training.

A snapshot of a state on a GPU (:mod:`.snapshot`) first copies this rank's extent into a
pinned host buffer on a side stream, so the step's forward and backward overlap the
copy; the host-side write (the agent's buffer, the checksum) waits for the copy on a
writer thread, and whatever writes the state next waits for it on the training stream
(:meth:`DeviceStaging.fence`).
"""

from __future__ import annotations

import torch

from phalanx.runtime.flat_state import FlatState, copy_range


class DeviceStaging:
    """A state's extent copied off its GPU into pinned host memory, on a side stream.

    :meth:`start` enqueues the copy behind what the training stream has enqueued so far
    (the committed step's last writes) and returns at once; :meth:`fence` makes the
    training stream wait for the copy before anything writes the state again. The pinned
    buffer is kept for the next snapshot (grown when the extent grows).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.copied: torch.cuda.Event | None = None  # the last copy's end, on the stream
        self._pinned: torch.Tensor | None = None

    def start(self, state: FlatState, shard: int, shards: int) -> torch.Tensor:
        """Enqueue the copy of shard ``shard`` of ``shards`` of ``state`` (its share, then
        its owned extent); returns the pinned bytes it lands in (complete once
        :attr:`copied` is)."""
        offset, length = state.extent(shard, shards)
        if self._pinned is None or self._pinned.numel() < length:
            self._pinned = None  # the old buffer goes before the new one is pinned
            self._pinned = torch.empty(max(length, 1), dtype=torch.uint8, pin_memory=True)
        out = self._pinned[:length]
        owned = state.owned
        shared = length - (0 if owned is None else owned.total)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for flat in (state, owned):
                for tensor in [] if flat is None else flat.tensors:
                    if tensor.device.type == "cuda":  # not freed while the copy reads it
                        tensor.record_stream(self.stream)
            copy_range(state, offset, out[:shared], non_blocking=True)
            if owned is not None:
                copy_range(owned, 0, out[shared:], non_blocking=True)
            self.copied = torch.cuda.Event(blocking=True)  # a waiter sleeps, not spins
            self.copied.record(self.stream)
        return out

    def fence(self) -> None:
        """The training stream waits for the last copy (the host does not)."""
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
