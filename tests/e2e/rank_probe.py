"""A rank that reports what it holds and what the bus lets it do (test_secure_cluster.py).

Run by an agent as a job's rank, it connects as its environment says, publishes on
each subject given on its command line, and prints one JSON line: its ``PHALANX_*``
environment and, for each subject, whether the server refused it the publish. Paths
only, never a seed: the test checks that no seed reaches any log.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig

#: How long a refusal may take to come back (it is asynchronous, an ``-ERR``).
REFUSAL_WAIT_S = 3.0


async def main(subjects: list[str]) -> None:
    refused: dict[str, bool] = {}
    async with await Bus.connect(BusConfig.load(), name="rank-probe") as bus:
        for subject in subjects:
            with bus.refusal(subject) as refusal:
                await bus.nc.publish(subject, b"probe")
                try:
                    async with asyncio.timeout(REFUSAL_WAIT_S):
                        await refusal
                except TimeoutError:
                    refused[subject] = False
                else:
                    refused[subject] = True
    env = {k: v for k, v in os.environ.items() if k.startswith("PHALANX_")}
    print(json.dumps({"env": env, "refused": refused}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
