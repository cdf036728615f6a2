"""Memory-mapped datasets: written once by a prepare step, opened instantly by any rank.

A dataset directory holds one ``.npy`` file per field (``inputs.npy``,
``targets.npy`` …, all with the same first dimension) and a ``dataset.json``
naming the fields and the sample count. :func:`write_arrays` writes it
(atomically: a half-written directory is never mistaken for a dataset);
:class:`MemmapDataset` opens it with ``numpy.load(mmap_mode="r")``, so a
replica that joins or restarts reads its first batch at once, without
loading or re-processing anything: pages come from the OS page cache, shared
by every rank on the node.

It is a map-style dataset (``__len__`` / ``__getitem__``) and works with a
standard :class:`torch.utils.data.DataLoader`; :meth:`MemmapDataset.batch`
gathers many indices in one fancy-indexing call, which is what the elastic
step's micro-batches use.

For language models, :func:`write_tokens` writes a token stream (one field,
``tokens``, in the smallest unsigned dtype that holds the vocabulary) and
:class:`TokenWindows` reads it as non-overlapping windows of ``block_size``
tokens: window ``i`` is ``(tokens[i*b : i*b+b], tokens[i*b+1 : i*b+b+1])``,
input and next-token target. Each window is one sample of the elastic order,
so every window is used exactly once per epoch at any world size.

A dataset without ``batch()`` (or a session given ``DataLoader`` options) is
read by :class:`StepLoader`: the standard ``DataLoader`` machinery (the
user's ``num_workers``, ``collate_fn``, ``pin_memory``), fed the step's
indices: one loader for the whole run, its batch sampler set to the step's
micro-batches before each step, its workers persistent. A step's next
micro-batches are read and collated while the current one computes
(``prefetch_factor`` per worker); nothing is read ahead across steps, since
the next step's indices depend on the membership then.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phalanx.runtime.data import MicroBatch

MANIFEST = "dataset.json"


def write_arrays(directory: str | Path, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` (field name -> array, equal first dimensions) as a dataset directory.

    Raises:
        ValueError: no fields, a bad field name, or first dimensions that differ.
    """
    directory = Path(directory)
    if not arrays:
        raise ValueError("a dataset needs at least one field")
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"fields must have the same number of samples, got {lengths}")
    for name in arrays:
        if not name.isidentifier():
            raise ValueError(f"field name {name!r} is not an identifier")
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, array in arrays.items():
        np.save(staging / f"{name}.npy", np.ascontiguousarray(array))
    (staging / MANIFEST).write_text(json.dumps(
        {"fields": list(arrays), "samples": next(iter(lengths.values()))}))
    shutil.rmtree(directory, ignore_errors=True)
    staging.replace(directory)
    return directory


class MemmapDataset(torch.utils.data.Dataset[tuple[torch.Tensor, ...]]):
    """A dataset directory opened read-only through memory maps.

    ``dataset[i]`` is a tuple of tensors, one per field, in the manifest's order.

    Raises:
        FileNotFoundError: ``directory`` is not a prepared dataset.
        ValueError: its manifest and arrays disagree.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        manifest_path = self.directory / MANIFEST
        if not manifest_path.exists():
            raise FileNotFoundError(f"{self.directory} is not a prepared dataset "
                                    f"(no {MANIFEST}; run the prepare step first)")
        manifest = json.loads(manifest_path.read_text())
        self.fields: list[str] = list(manifest["fields"])
        self.arrays = [np.load(self.directory / f"{name}.npy", mmap_mode="r")
                       for name in self.fields]
        self.samples = int(manifest["samples"])
        for name, array in zip(self.fields, self.arrays, strict=True):
            if len(array) != self.samples:
                raise ValueError(f"{self.directory}: field {name!r} has {len(array)} samples, "
                                 f"the manifest says {self.samples}")

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(np.array(a[index])) for a in self.arrays)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The samples at ``indices`` stacked per field (one gather per field)."""
        rows = np.asarray(indices, dtype=np.int64)
        return tuple(torch.from_numpy(np.ascontiguousarray(a[rows])) for a in self.arrays)


def write_tokens(directory: str | Path, tokens: np.ndarray | Sequence[int],
                 vocab_size: int) -> Path:
    """Write a token stream as a dataset directory (field ``tokens``).

    Raises:
        ValueError: a token outside ``0..vocab_size-1``, or fewer than two tokens.
    """
    array = np.asarray(tokens)
    if array.ndim != 1 or len(array) < 2:
        raise ValueError(f"tokens must be one stream of at least 2, got shape {array.shape}")
    if array.min() < 0 or array.max() >= vocab_size:
        raise ValueError(f"tokens must lie in 0..{vocab_size - 1}, got "
                         f"{array.min()}..{array.max()}")
    dtype = np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16 \
        else np.uint32
    return write_arrays(directory, {"tokens": array.astype(dtype)})


class TokenWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping ``block_size`` windows of a token stream from :func:`write_tokens`.

    ``windows[i]`` is ``(x, y)``, int64 tensors of ``block_size`` tokens, ``y`` the
    tokens that follow ``x``'s. :meth:`batch` gathers many windows at once.

    Raises:
        FileNotFoundError: ``directory`` is not a prepared dataset.
        ValueError: it has no ``tokens`` field, or is shorter than one window.
    """

    def __init__(self, directory: str | Path, block_size: int) -> None:
        data = MemmapDataset(directory)
        if data.fields != ["tokens"]:
            raise ValueError(f"{directory} holds {data.fields}, not a token stream")
        self.tokens = data.arrays[0]
        self.block_size = block_size
        self.windows = (len(self.tokens) - 1) // block_size
        if self.windows < 1:
            raise ValueError(f"{len(self.tokens)} tokens make no window of {block_size}")
        self._offsets = np.arange(block_size + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([index])
        return x[0], y[0]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows ``indices`` stacked: ``(x, y)`` of shape ``(len(indices), block_size)``."""
        if len(indices) and not 0 <= min(indices) <= max(indices) < self.windows:
            raise IndexError(f"windows {min(indices)}..{max(indices)} outside "
                             f"0..{self.windows - 1}")
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.block_size
        rows = torch.from_numpy(self.tokens[starts + self._offsets].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]


#: DataLoader options the session decides itself.
SESSION_OWNED = frozenset({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"})


class _StepBatches:
    """A batch sampler whose batches are set before each step."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class StepLoader:
    """A ``DataLoader`` over ``dataset`` that reads the micro-batches a step asks for.

    Args:
        dataset: map-style.
        options: ``DataLoader`` keyword arguments other than the sampling ones (those
            in :data:`SESSION_OWNED`); with ``num_workers > 0``, ``persistent_workers``
            defaults to True.

    Raises:
        ValueError: an option the session owns.
    """

    def __init__(self, dataset: Any, options: Mapping[str, Any]) -> None:
        owned = sorted(SESSION_OWNED & set(options))
        if owned:
            raise ValueError(f"the session decides {owned}: the elastic order samples the "
                             "data (pass the other DataLoader options)")
        options = dict(options)
        if options.get("num_workers", 0) > 0:
            options.setdefault("persistent_workers", True)
        self.sampler = _StepBatches()
        self.loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler,
                                                  **options)
        self._iterator: Iterator[Any] | None = None

    def batches(self, plan: Sequence[MicroBatch]) -> Iterator[Any]:
        """The loaded batches of ``plan``, in order."""
        if not plan:
            return iter(())
        self.sampler.batches = [list(mb.indices) for mb in plan]
        self._iterator = iter(self.loader)
        return self._iterator

    def close(self) -> None:
        """Stop the worker processes now. Left to the garbage collector, a DataLoader's
        finalizer joins its workers in whatever thread collects it, which can then stall
        for seconds (a collective's thread among them)."""
        iterator, self._iterator = self._iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)  # multi-process only
        if shutdown is not None:
            shutdown()


def step_loader(dataset: Any, options: Mapping[str, Any] | None) -> StepLoader | None:
    """The loader of a session: None when the dataset's ``batch()`` serves (no options)."""
    if options is None and hasattr(dataset, "batch"):
        return None
    return StepLoader(dataset, options or {})
