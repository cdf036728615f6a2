"""The ``phalanx`` command line.

``phalanx up`` runs a local cluster (embedded NATS + agents), ``phalanx down``
stops a detached one, ``phalanx nodes`` lists the registry, ``phalanx agent``
runs one node agent (what ``up`` starts per node, and what a real machine
runs). Commands that talk to the bus find it through ``--nats``, then
``PHALANX_NATS_URL``, then the cluster ``up`` recorded in the data dir, then
``nats://127.0.0.1:4222``. The data dir is ``--data-dir``, else
``$PHALANX_DATA_DIR``, else the one the last ``phalanx up`` left a pointer to
(:mod:`phalanx.services.paths`), else the state dir. Exit codes: 0 ok, 1 failed, 2
bad usage or input.

One module per command group, each with its commands' parsers (``add_parsers``):
:mod:`~phalanx.services.cli.up` (up, down, demo), :mod:`~phalanx.services.cli.nodes`
(nodes, top, node, chaos), :mod:`~phalanx.services.cli.jobs` (submit, jobs, job,
explain, cancel, scale), :mod:`~phalanx.services.cli.logs`,
:mod:`~phalanx.services.cli.ckpt`, :mod:`~phalanx.services.cli.auth` and
:mod:`~phalanx.services.cli.services` (agent and the services, run in this process);
:mod:`~phalanx.services.cli.common` holds what they share. This module assembles the
parser and runs a command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from phalanx.schemas import __version__
from phalanx.schemas.errors import PhalanxError
from phalanx.services.cli import auth, ckpt, jobs, logs, nodes, services, up
from phalanx.services.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    no_cluster_hint,
    parents,
    resolve_data_dir,
)

#: The command groups, in the order ``phalanx --help`` lists their commands.
GROUPS = (up, nodes, jobs, logs, ckpt, auth, services)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx", description="Gang scheduling, elastic training and checkpointless "
        "recovery for PyTorch: run a local cluster or a service, submit and watch jobs. "
        "README.md and docs/cli.md say more.")
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    shared = parents()
    for group in GROUPS:
        group.add_parsers(sub, shared)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # everything after it, --help included, is the demo's
        return up.cmd_demo(argparse.Namespace(demo_args=argv[1:]))
    args = build_parser().parse_args(argv)
    args.argv = argv  # what `agent --supervised` runs again under its supervisor
    if hasattr(args, "data_dir"):
        args.data_dir = str(resolve_data_dir(args))
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
    except PhalanxError as exc:
        print(f"phalanx {args.command}: {exc}{no_cluster_hint(args, exc)}", file=sys.stderr)
        refused = getattr(exc, "code", "").startswith("4")
        return EXIT_USAGE if isinstance(exc, ValueError) or refused else EXIT_FAILED
    except KeyboardInterrupt:
        return 130
