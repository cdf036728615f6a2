"""nats-py over TCP only: its websocket transport's aiohttp is not imported.

nats-py imports aiohttp, when it is installed, for ``ws://`` servers, which phalanx
never uses (it connects over ``nats://`` and ``tls://``). That import was 0.1-0.2 s of
every process's start, services, commands and ranks alike, about half of what importing
the bus cost. :func:`tcp_only` makes that one import fail as if aiohttp were absent;
anything else that imports aiohttp (s3fs, for the durable tier) gets it as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import FrameType, ModuleType

#: The module of nats-py whose optional ``import aiohttp`` is refused.
WEBSOCKET_TRANSPORT = "nats.aio.transport"


class _NoWebsocketTransport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "aiohttp":
            return None
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == WEBSOCKET_TRANSPORT:
                raise ModuleNotFoundError("aiohttp is left out of nats-py's websocket "
                                          "transport: phalanx connects over TCP",
                                          name=fullname)
            frame = frame.f_back
        return None


def tcp_only() -> None:
    """Refuse aiohttp to nats-py's websocket transport (idempotent; before nats loads)."""
    if not any(isinstance(finder, _NoWebsocketTransport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NoWebsocketTransport())
