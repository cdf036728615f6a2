"""Liveness and readiness of one phalanx process, judged over the bus (an exec probe).

    python /opt/phalanx/deploy/probe.py ready phalanx-admission
    python /opt/phalanx/deploy/probe.py live phalanx-agent --instance node-7

Every phalanx service and agent registers with the NATS service API
(``$SRV.INFO.<name>``, see ``services/base.py``) and answers there from its own
event loop, so an answer says the process is connected and its loop is not stuck.
Nothing else to answer a probe exists: the services serve no HTTP. This asks
``$SRV.INFO.<name>`` and gathers the replies of every instance for up to
``--timeout`` seconds, looking for *this* one: the instance named by
``--instance`` (default ``$PHALANX_PROBE_INSTANCE``; dots read as dashes, as an
agent's node id is made of a node name), else one whose instance is
this host's short name or starts with it and a dash (the services' default instance
names, ``<host>-<pid>-<random>``, and an agent's default node id).

``ready`` passes only when this instance answered. ``live`` fails only when the bus
was reached and this instance did not answer: a bus that cannot be reached says
nothing about this process (every service rides out a NATS restart on its own),
so an outage must not have the orchestrator restart the whole control plane.
Exit codes: 0 pass, 1 fail, 2 bad usage; one line on stdout says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable


def short_host() -> str:
    return socket.gethostname().split(".")[0]


def is_this(instance: str, wanted: str | None, host: str) -> bool:
    """Whether an instance name is the one this probe is about. ``wanted`` is compared
    as a subject token, the way an agent makes one of a node name (``a.b`` → ``a-b``)."""
    if wanted:
        return instance == re.sub(r"[^A-Za-z0-9_\-]", "-", wanted)
    return instance == host or instance.startswith(host + "-")


async def answering(service: str, timeout_s: float,
                    enough: Callable[[str], bool] = lambda _: False) -> list[str]:
    """Instance names of ``service`` that answer ``$SRV.INFO`` within ``timeout_s``, or
    up to the first one that is ``enough``.

    Raises:
        BusUnavailable: the bus could not be reached.
    """
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig
    from phalanx.schemas import subjects

    config = BusConfig.load(connect_timeout_s=min(timeout_s, 5.0))
    async with await Bus.connect(config, name=f"probe:{service}") as bus:
        nc = bus.nc
        inbox = nc.new_inbox()
        found: list[str] = []
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.service_info(service), b"", reply=inbox)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            try:
                found.append(str(json.loads(msg.data)["metadata"]["instance"]))
            except (ValueError, KeyError, TypeError):
                continue
            if enough(found[-1]):
                break
        await sub.unsubscribe()
        return found


def probe(kind: str, service: str, instance: str | None, timeout_s: float) -> tuple[int, str]:
    """(exit code, reason) of one probe."""
    from phalanx.bus.errors import BusUnavailable

    host = short_host()
    who = instance or f"{host}[-*]"
    try:
        found = asyncio.run(answering(service, timeout_s,
                                      lambda name: is_this(name, instance, host)))
    except BusUnavailable as exc:
        if kind == "live":
            return 0, f"live: bus unreachable, {service} {who} not judged ({exc})"
        return 1, f"not ready: bus unreachable ({exc})"
    if any(is_this(name, instance, host) for name in found):
        return 0, f"{kind}: {service} {who} answered"
    others = ", ".join(sorted(found)) or "none"
    return 1, (f"{'not ready' if kind == 'ready' else 'not live'}: {service} {who} did not "
               f"answer within {timeout_s} s (answered: {others})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["live", "ready"])
    parser.add_argument("service", help="service API name: phalanx-admission, phalanx-health, "
                                        "phalanx-elasticity or phalanx-agent")
    parser.add_argument("--instance", default=os.environ.get("PHALANX_PROBE_INSTANCE") or None,
                        help="instance name to look for (default: $PHALANX_PROBE_INSTANCE, "
                             "else this host's)")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="S")
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error("--timeout must be > 0")
    code, reason = probe(args.kind, args.service, args.instance, args.timeout)
    print(reason)
    return code


if __name__ == "__main__":
    sys.exit(main())
