"""phalanx services: admission, elasticity, health, checkpoint, agent, and the CLI."""

import phalanx.bus  # noqa: F401  (first: nats-py without aiohttp, :mod:`phalanx.bus.transport`)
