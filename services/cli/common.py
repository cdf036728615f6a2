"""What every ``phalanx`` command group shares: the exit codes, the options most commands
take, where the data dir and the bus are found, and a client of admission on that bus.

The bus is ``--nats``, then ``PHALANX_NATS_URL``, then the cluster ``phalanx up`` recorded
in the data dir (with its operator identity when that cluster is secured), then
``nats://127.0.0.1:4222``. The data dir is ``--data-dir``, else ``$PHALANX_DATA_DIR``,
else the one the last ``phalanx up`` left a pointer to, else the state dir.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, TypeVar

from phalanx.schemas import settings
from phalanx.schemas.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.bus.config import BusConfig
    from phalanx.services.client import AdmissionClient

EXIT_FAILED = 1
EXIT_USAGE = 2

#: What ``add_subparsers`` returns: each command group adds its commands to it.
#: (argparse names its class only privately.)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

T = TypeVar("T")


class Parents(NamedTuple):
    """The option sets several commands take, as argparse parent parsers."""

    #: ``--nats``, ``--config``, ``--data-dir``, ``--log-level``: every command on the bus.
    common: argparse.ArgumentParser
    #: ``--lost-after``: the commands that judge a node's heartbeat.
    lost_after: argparse.ArgumentParser


def parents() -> Parents:
    from phalanx.schemas.registry import DEFAULT_LOST_AFTER_S
    from phalanx.services.paths import default_data_dir

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats", metavar="URL", help="NATS server URL(s), comma-separated")
    common.add_argument("--config", metavar="FILE", help="TOML config file with a [bus] table")
    common.add_argument("--data-dir", help="local cluster state, logs and JetStream data "
                        "(default: the cluster `phalanx up` last started, if neither --nats "
                        f"nor {settings.NATS_URL} is given; else {default_data_dir()})")
    common.add_argument("--log-level", default="INFO")
    lost_after = argparse.ArgumentParser(add_help=False)
    lost_after.add_argument("--lost-after", type=float, default=DEFAULT_LOST_AFTER_S,
                            metavar="S", help="a node is lost when its heartbeat is older "
                            "(default: %(default)s s)")
    return Parents(common, lost_after)


def bus_config(args: argparse.Namespace) -> BusConfig:
    """The bus the command talks to, and as whom (see the module's docstring)."""
    from phalanx.bus.config import CREDENTIAL_VARS, BusConfig
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role
    from phalanx.services.cluster import ClusterState

    url = args.nats
    env = dict(os.environ)
    if url is None and not os.environ.get(settings.NATS_URL):
        state = ClusterState.read(Path(args.data_dir))
        url = state.nats_url if state else None
        if state is not None and not env.get(settings.NATS_REPLICAS):
            env[settings.NATS_REPLICAS] = str(state.nats_replicas)
        if state is not None and state.auth_dir is not None:
            # A secured local cluster: the operator's identity, unless the environment
            # names another (a viewer's, say).
            auth = AuthDir(state.auth_dir)
            env.setdefault(settings.NATS_CA, str(auth.ca_path))
            if not CREDENTIAL_VARS & env.keys():
                env.update(auth.env(Role.CLI))
    return BusConfig.load(args.config, env=env, servers=url)  # comma-separated URLs


async def with_client(args: argparse.Namespace,
                      action: Callable[[AdmissionClient], Awaitable[T]]) -> T:
    """``action``'s result on a client of admission, on a connection closed after it."""
    from phalanx.bus.client import Bus
    from phalanx.services.client import AdmissionClient

    async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
        return await action(AdmissionClient(bus))


def whole_number(text: str) -> int:
    """An argument that counts or indexes (a GPU, an Xid, lines): a whole number >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def msgspec_to_builtins(message: object) -> Any:
    """``message`` (a struct, or a list or dict of them) as JSON-ready builtins."""
    import msgspec

    return msgspec.to_builtins(message)


def resolve_data_dir(args: argparse.Namespace) -> Path:
    """``--data-dir``, else ``$PHALANX_DATA_DIR``, else (for a command that is not ``up``
    and is not pointed at a bus) the data dir of the cluster ``phalanx up`` last started,
    else the state dir."""
    from phalanx.services.paths import default_data_dir, remembered_cluster

    if args.data_dir is not None:
        return Path(args.data_dir)
    if os.environ.get(settings.DATA_DIR) or args.command == "up" or args.nats \
            or os.environ.get(settings.NATS_URL):
        return default_data_dir()
    return remembered_cluster() or default_data_dir()


def no_cluster_hint(args: argparse.Namespace, exc: PhalanxError) -> str:
    """What to pass when the bus was not reached because no cluster was found: the
    default URL was tried only because nothing named one."""
    from phalanx.bus.errors import BusUnavailable
    from phalanx.services.cluster import ClusterState

    if not isinstance(exc, BusUnavailable) or getattr(args, "data_dir", None) is None \
            or args.nats or os.environ.get(settings.NATS_URL) \
            or ClusterState.read(Path(args.data_dir)) is not None:
        return ""
    return (f"\nno local cluster runs from {args.data_dir}: for one started with "
            "`phalanx up --data-dir DIR`, pass the same --data-dir DIR; for another "
            f"cluster, pass --nats URL (or set {settings.NATS_URL})")
