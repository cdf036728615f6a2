"""The rank-local runtime a training script imports: elastic data-parallel training.

The public API, importable from here::

    from phalanx.runtime import ElasticSession, MemmapDataset, write_arrays

* :class:`ElasticSession`, :class:`Step`, :class:`MembershipChange`,
  :class:`JobCompletedWithoutThisReplica` and :class:`LeftTheJob` (:mod:`.elastic`):
  the session that replaces ``init_process_group``, DDP and the ``DistributedSampler``;
  its DDP-shaped loop (``session.epochs``, ``session.loader``, ``session.backward``,
  ``session.commit``) is :mod:`.epochs`.
* :class:`MemmapDataset` and :func:`write_arrays` (:mod:`.dataset`): a dataset
  written once and opened by memory map; :func:`write_tokens` and
  :class:`TokenWindows`, the same for a language model's token stream.
* :class:`ElasticOrder` (:mod:`.data`): the exactly-once data order.
* :func:`sharded_optimizer` (:mod:`.sharded`): a ZeroRedundancyOptimizer the session
  partitions over each generation.
* :func:`device` (:mod:`.placement`): the device this rank trains on (its GPU, or
  the CPU), where the script puts its model.

The names load on first use (PEP 562), so importing a small part of the
runtime (:mod:`.priority`) does not import torch.
See docs/runtime.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import phalanx.bus  # noqa: F401  (first: nats-py without aiohttp, :mod:`phalanx.bus.transport`)

_EXPORTS = {
    "ElasticSession": "elastic",
    "Step": "elastic",
    "MembershipChange": "elastic",
    "JobCompletedWithoutThisReplica": "elastic",
    "LeftTheJob": "elastic",
    "Dropped": "elastic",
    "MemmapDataset": "dataset",
    "write_arrays": "dataset",
    "TokenWindows": "dataset",
    "write_tokens": "dataset",
    "ElasticOrder": "data",
    "sharded_optimizer": "sharded",
    "device": "placement",
}

__all__ = [
    "Dropped",
    "ElasticOrder",
    "ElasticSession",
    "JobCompletedWithoutThisReplica",
    "LeftTheJob",
    "MembershipChange",
    "MemmapDataset",
    "Step",
    "TokenWindows",
    "device",
    "sharded_optimizer",
    "write_arrays",
    "write_tokens",
]

if TYPE_CHECKING:
    from phalanx.runtime.data import ElasticOrder
    from phalanx.runtime.dataset import MemmapDataset, TokenWindows, write_arrays, write_tokens
    from phalanx.runtime.elastic import (
        Dropped,
        ElasticSession,
        JobCompletedWithoutThisReplica,
        LeftTheJob,
        MembershipChange,
        Step,
    )
    from phalanx.runtime.placement import device
    from phalanx.runtime.sharded import sharded_optimizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
