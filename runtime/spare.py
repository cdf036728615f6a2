"""A warm spare waits for its identity: the replica it becomes, told by its agent.

An agent keeps *spares* of a job (:mod:`phalanx.services.agent.spares`):
processes of the job's command, started with the job's environment and
:data:`~phalanx.schemas.environment.SPARE`, but no replica identity. The
script runs as in any rank (imports torch, builds its model, opens its data)
up to :meth:`~phalanx.runtime.elastic.ElasticSession.from_env`, which calls
:func:`wait_for_identity`: the spare blocks reading one line from its
standard input, which costs nothing (no CPU, no bus connection), until its
agent writes the variables that name a replica (``PHALANX_REPLICA_ID``,
``PHALANX_RANK``, ``RANK``, ``LOCAL_RANK`` …, one JSON object) and closes the
pipe. They go into ``os.environ``, as if the process had been started with
them, and the session goes on exactly as a replica launched with that
identity: it connects, reports ready and joins.

What the script does before ``from_env`` is what a spare saves a
replacement: the model is built before, the data opened before. ``from_env``
adds what needs no identity either, before it waits: the script's ``warmup``
and the optimizer's first (throwaway) step, which makes the buffers its state
will be received into and imports what torch imports on a first step — about a
second of a replacement's start on W. A spare then holds the optimizer state's
size in host memory while it waits; it does neither for a model on a GPU, whose
memory belongs to the slot's rank. What the script does before ``from_env``
must not depend on the replica's identity (``RANK``, ``LOCAL_RANK``: a spare
has none yet). On a GPU node the agent starts a spare on the GPUs of free slots
and names it a replica in slots on those same GPUs: CUDA fixes its devices when it
starts, and a model built on the GPU before ``from_env`` is there already. If the
standard input ends with no line (the agent stopped or died), the spare exits with
status 0.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import BinaryIO

from phalanx.schemas import environment
from phalanx.schemas.errors import ConfigError

log = logging.getLogger("phalanx.runtime.spare")


def cuda_initialised() -> bool:
    """Whether this process started CUDA (torch imported and its CUDA initialised)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def wait_for_identity(env: Mapping[str, str], source: BinaryIO | None = None,
                      process_env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Block until the agent names the replica this spare becomes.

    Args:
        env: the spare's environment (``from_env``'s).
        source: where the identity is read from (default: standard input).
        process_env: the process's environment, which gets the identity too (the
            script's later reads of it, and torch's, see the replica's variables).

    Returns:
        ``env`` with the identity, and :data:`~phalanx.schemas.environment.SPARE` removed.

    Raises:
        SystemExit: status 0, the input ended with no identity (the agent is gone).
        ConfigError: the line is not a JSON object of strings.
    """
    spare_id = env.get(environment.SPARE, "")
    stream = source if source is not None else sys.stdin.buffer
    line = stream.readline()
    if not line.strip():
        log.info("spare %s: no identity came (its agent stopped); exiting", spare_id)
        raise SystemExit(0)
    try:
        identity = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"spare {spare_id}: the identity is not JSON: {exc}") from None
    if not isinstance(identity, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in identity.items()):
        raise ConfigError(f"spare {spare_id}: the identity must be an object of strings, "
                          f"got {line[:200]!r}")
    devices = identity.get("CUDA_VISIBLE_DEVICES")
    if devices is not None and devices != process_env.get("CUDA_VISIBLE_DEVICES") \
            and cuda_initialised():
        # CUDA read its devices once, at its start: the replica would run on the wrong GPU.
        raise ConfigError(f"spare {spare_id}: told to be a replica on GPUs {devices!r}, but "
                          "CUDA started on GPUs "
                          f"{process_env.get('CUDA_VISIBLE_DEVICES')!r} already")
    process_env.pop(environment.SPARE, None)
    process_env.update(identity)
    log.info("spare %s is %s now", spare_id, identity.get(environment.REPLICA_ID))
    return {**{k: v for k, v in env.items() if k != environment.SPARE}, **identity}
