"""The LR schedulers built on the session's optimizer: carried with it, registered or not.

A scheduler's state moves with the optimizer's or the two part: a replica that
receives its peers' optimizer (a joiner, a replacement) or restores it from a
snapshot, with its own scheduler fresh, would set its learning rate from step 0
while its peers' is at step 500, and the replicas would silently train apart.
So the session carries every scheduler built on its optimizer, as if the script
had registered it (``state=`` / :meth:`~.elastic.ElasticSession.register`):
they are found when the session is made (a scheduler built after it must be
registered), by the reference each keeps to its optimizer. A scheduler that
drives others (``SequentialLR``, ``ChainedScheduler``) is carried whole, its
children inside its own state; one the script registered keeps its name. Two
or more unregistered are refused: no order of finding them names them alike in
every replica.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

#: The name a found scheduler is carried under.
NAME = "lr_scheduler"


def _subclasses(base: type) -> set[type]:
    found = {base}
    subclasses: list[type] = base.__subclasses__()
    for sub in subclasses:
        found |= _subclasses(sub)
    return found


def alive(*bases: type) -> list[object]:
    """Every object of this process whose type is one of ``bases`` or a subclass of one.

    One pass over the collector's objects, each one's type looked up in the set of those
    classes: ~10 ms over the 300,000 objects of a rank, where ``issubclass`` on each took
    60 (several looks at every session start cost a suite of rank processes a minute of
    CPU). ``type()``, not ``isinstance()``: isinstance reads ``__class__``, and some of
    torch's objects warn when it is read (``torch.distributed.reduce_op`` said it was
    deprecated on every rank, at every session's start).
    """
    kinds = set().union(*(_subclasses(base) for base in bases))
    return [obj for obj in gc.get_objects() if type(obj) in kinds]


#: What :func:`unregistered` looks among (:func:`alive`).
KINDS = (LRScheduler, ReduceLROnPlateau)


def unregistered(optimizer: torch.optim.Optimizer, registered: Iterable[object],
                 candidates: Iterable[object]) -> dict[str, object]:
    """The outermost scheduler of ``optimizer`` among ``candidates`` (:func:`alive`) and
    not among ``registered``, by name (none: empty).

    Raises:
        ValueError: more than one.
    """
    found = [obj for obj in candidates
             if issubclass(type(obj), KINDS) and getattr(obj, "optimizer", None) is optimizer]
    inner = {id(child) for obj in found for child in getattr(obj, "_schedulers", ())}
    known = {id(obj) for obj in registered}
    outer = [obj for obj in found if id(obj) not in inner and id(obj) not in known]
    if len(outer) > 1:
        kinds_found = ", ".join(sorted(type(obj).__name__ for obj in outer))
        raise ValueError(f"{len(outer)} LR schedulers of the optimizer are not registered "
                         f"({kinds_found}): register each by name (state= or "
                         "session.register), so that every replica carries them alike")
    return {NAME: outer[0]} if outer else {}
