"""``phalanx up``, ``down`` and ``demo``: a local cluster on this machine.

``up`` runs an embedded NATS, the services and the agents (:mod:`phalanx.services.cluster`)
in this process until signalled, keeping the NATS server alive and showing the nodes while
a terminal watches. ``up --detach`` starts that same command as a child in its own
session and returns once the child says, through an inherited pipe, that the cluster is
ready or why it failed. ``down`` stops the cluster the data dir records; ``demo`` runs
``examples/demo.py`` from the source checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from phalanx.schemas.errors import PhalanxError
from phalanx.services.cli.common import EXIT_FAILED, EXIT_USAGE, Parents, Subparsers
from phalanx.services.cli.nodes import read_nodes
from phalanx.services.deadline import wait_set


def cmd_up(args: argparse.Namespace) -> int:
    from phalanx.services.cluster import ClusterState

    data_dir = Path(args.data_dir)
    running = ClusterState.read(data_dir)
    if running is not None:
        print(f"phalanx up: a local cluster already runs from {data_dir} (pid {running.pid}, "
              f"{running.nats_url}); `phalanx down` stops it", file=sys.stderr)
        return EXIT_FAILED
    if args.detach:
        return _up_detached(args, data_dir)
    if args.notify_fd:
        # Inherited to reach this process only: uvloop's spawn does not close inheritable
        # descriptors, and a service holding the pipe would keep the parent waiting on it.
        os.set_inheritable(args.notify_fd, False)
    from phalanx.services.logs import configure_logging

    configure_logging("phalanx-up", "local", args.log_level)
    try:
        import uvloop
        return uvloop.run(_up(args, data_dir))
    except ImportError:
        return asyncio.run(_up(args, data_dir))


async def _up(args: argparse.Namespace, data_dir: Path) -> int:
    from phalanx.services.cluster import LocalCluster
    from phalanx.services.paths import forget_cluster, remember_cluster

    cluster = LocalCluster(
        data_dir, agents=args.agents, slots_per_agent=args.slots_per_agent,
        nats_url=args.nats, nats_port=args.nats_port, nats_servers=args.nats_cluster,
        heartbeat_interval_s=args.heartbeat_interval, lost_after_s=args.lost_after,
        admission_instances=args.admission, health_instances=args.health,
        elasticity_instances=args.elasticity, config_path=args.config,
        auth_dir=data_dir / "auth" if args.secure else None,
        supervised_agents=args.supervised_agents, pin_cpus=args.pin_cpus)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start()
    except PhalanxError as exc:
        await cluster.stop()
        _notify(args, f"error {exc}")
        print(f"phalanx up: {exc}", file=sys.stderr)
        return EXIT_FAILED
    assert cluster.nats_url is not None  # start() set it
    _notify(args, f"ready {cluster.nats_url}")
    remember_cluster(data_dir)  # the commands after this one find the cluster without flags
    # The embedded server is started again if it dies; if it cannot be, the cluster stops.
    keeper = asyncio.create_task(cluster.keep_nats(stop))
    try:
        if sys.stdout.isatty() and not args.notify_fd:
            await _live_status(args, cluster.nats_url, stop)
        else:
            print(f"phalanx up: {cluster.nats_url}, {len(cluster.agents)} agents; "
                  "Ctrl-C stops", flush=True)
            await stop.wait()
    finally:
        stop.set()
        gave_up = await keeper
        await cluster.stop()
        forget_cluster(data_dir)
    if gave_up and not args.detach:
        print(f"phalanx up: nats-server could not be started again; stopped the cluster "
              f"(see {Path(args.data_dir) / 'logs' / 'nats.log'})", file=sys.stderr)
        return EXIT_FAILED
    return 0


async def _live_status(args: argparse.Namespace, nats_url: str, stop: asyncio.Event) -> None:
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from phalanx.services.tables import node_table

    if not args.secure:  # secured, the recorded cluster gives the operator's identity too
        args.nats = nats_url
    header = Text(f"phalanx up — NATS {nats_url}, data in {args.data_dir}; Ctrl-C stops")
    with Live(header, refresh_per_second=2) as live:
        while not stop.is_set():
            try:
                nodes, _ = await read_nodes(args)
                live.update(Group(header, node_table(nodes)))
            except PhalanxError as exc:
                live.update(Group(header, Text(f"registry unavailable: {exc}")))
            await wait_set(stop, 1.0)


def _notify(args: argparse.Namespace, line: str) -> None:
    """Tell the `up --detach` parent how start-up went, through the inherited pipe."""
    if args.notify_fd:
        with contextlib.suppress(OSError):
            os.write(args.notify_fd, (line + "\n").encode())
            os.close(args.notify_fd)
        args.notify_fd = None


def _up_detached(args: argparse.Namespace, data_dir: Path) -> int:
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    argv = _rebuild_argv(args)
    log_path = data_dir / "logs" / "up.log"
    with log_path.open("ab") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", "phalanx.services.cli", *argv, "--notify-fd", str(write_end)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, pass_fds=(write_end,),
            start_new_session=True,
        )
    os.close(write_end)
    with os.fdopen(read_end) as pipe:  # one message, closed after it (an error may span lines)
        line = pipe.read().strip()
    if line.startswith("ready "):
        print(f"phalanx up: local cluster running (pid {child.pid}), NATS {line[6:]}, "
              f"{args.agents} agents; logs in {data_dir / 'logs'}.\n"
              "  phalanx nodes      list nodes\n  phalanx down       stop it")
        return 0
    child.wait()
    reason = line.removeprefix("error ") or f"exited with code {child.returncode}"
    print(f"phalanx up: failed to start: {reason} (log: {log_path})", file=sys.stderr)
    return EXIT_FAILED


def _rebuild_argv(args: argparse.Namespace) -> list[str]:
    """The detached child's command: this one's arguments as given (every option, present
    or future, passes through), less ``--detach``, with the data dir as resolved here."""
    return [a for a in args.argv if a not in ("--detach", "-d")] + [
        "--data-dir", str(args.data_dir)]


def cmd_down(args: argparse.Namespace) -> int:
    from phalanx.services.cluster import stop_recorded
    from phalanx.services.paths import forget_cluster

    state = stop_recorded(Path(args.data_dir), args.timeout)
    forget_cluster(Path(args.data_dir))
    if state is None:
        print(f"phalanx down: no local cluster recorded in {args.data_dir}; nothing to stop")
    else:
        print(f"phalanx down: stopped the local cluster (pid {state.pid}, "
              f"{len(state.agents)} agents)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``examples/demo.py`` from the source checkout this phalanx is installed from."""
    demo = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
    if not demo.exists():
        print(f"phalanx demo: {demo} not found: the demo runs from a source checkout "
              "(git clone, then `make demo`)", file=sys.stderr)
        return EXIT_USAGE
    return subprocess.call([sys.executable, str(demo), *args.demo_args])


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    up = sub.add_parser("up", parents=[parents.common, parents.lost_after],
                        help="run a local cluster")
    up.add_argument("--agents", type=int, default=2, metavar="N")
    up.add_argument("--slots-per-agent", type=int, default=2, metavar="K")
    up.add_argument("--nats-port", type=int, default=4222,
                    help="port of the embedded NATS server (0 = any free port)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run the embedded NATS as a cluster of N servers (ports --nats-port "
                    "and up), buckets and streams replicated on 3 (default: one server)")
    up.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="S")
    up.add_argument("--admission", type=int, default=1, metavar="N",
                    help="admission service instances (one leads, the others stand by)")
    up.add_argument("--health", type=int, default=1, metavar="N",
                    help="health service instances (one leads, the others stand by)")
    up.add_argument("--elasticity", type=int, default=1, metavar="N",
                    help="elasticity service instances (one leads, the others stand by)")
    up.add_argument("--detach", "-d", action="store_true", help="run in the background")
    up.add_argument("--supervised-agents", action="store_true",
                    help="run each agent under `phalanx agent --supervised`, as the "
                         "Kubernetes DaemonSet does: an agent that dies is started again "
                         "in place and adopts its ranks (without it a dead agent stays "
                         "dead and its node is lost)")
    up.add_argument("--pin-cpus", action="store_true",
                    help="give each agent whole cores of this machine of its own, and each of "
                         "its CPU slots' ranks whole cores among them (agent.cpus): steadier "
                         "step times where ranks would otherwise share a core")
    up.add_argument("--secure", action="store_true",
                    help="TLS and per-role permissions on the bus, every process as its own "
                         "identity (auth directory <data-dir>/auth, made if missing)")
    up.add_argument("--notify-fd", type=int, help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", parents=[parents.common], help="stop a detached local cluster")
    down.add_argument("--timeout", type=float, default=20.0, metavar="S")
    down.set_defaults(func=cmd_down)

    demo = sub.add_parser("demo", help="W on 4 ranks on a local cluster: kill one, watch it "
                                       "recover, compare with a fault-free run",
                          add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER,
                      help="passed to examples/demo.py (--help for its options)")
    demo.set_defaults(func=cmd_demo)
