"""``phalanx auth``: make an auth directory (CA, server config, an identity per role) or
add a node's or a job's identity to one; and, on a secured local cluster, a submitted
job's identity made before its ranks need it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from phalanx.services.cli.common import Parents, Subparsers


def cmd_auth(args: argparse.Namespace) -> int:
    """Make an auth directory, or add a node's or a job's identity to one. Prints names,
    public keys and paths; never a seed."""
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role

    if args.action == "init":
        auth = AuthDir.init(args.dir, nodes=args.node, hosts=args.host)
        print(f"made {auth.root}: server config {auth.config_path}, CA {auth.ca_path}")
        for who in auth.identities():
            print(f"  {who.name:<24} {who.public_key}  {auth.seed_path(who.role, who.scope)}")
        print(f"  replication key{'':<9} {auth.replication_key_path}")
        print("start nats-server with `-c` that config; point each process at its identity "
              "with PHALANX_NATS_NKEY, PHALANX_NATS_INBOX_PREFIX and PHALANX_NATS_CA, and "
              "each agent at the replication key with PHALANX_AGENT_REPLICA_KEY_FILE "
              "(docs/security.md)")
        return 0
    role = Role.AGENT if args.action == "add-node" else Role.RANK
    auth = AuthDir(args.dir)
    who, made = auth.add(role, args.id)
    seed = auth.seed_path(role, args.id)
    if made:
        print(f"made {who.name} ({who.public_key}), seed {seed}; have nats-server reload its "
              f"config (SIGHUP) to admit it")
    else:
        print(f"{who.name} exists ({who.public_key}), seed {seed}")
    return 0


async def admit_job(args: argparse.Namespace, job_id: str, timeout_s: float = 10.0) -> None:
    """On a secured local cluster, make the job's identity before its ranks need it: the
    server reloads its config, and this returns once it admits the job's identity."""
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig, with_identity
    from phalanx.bus.errors import BusUnavailable
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role
    from phalanx.services.cluster import ClusterState
    from phalanx.services.natsd import reload_config

    state = ClusterState.read(Path(args.data_dir))
    if args.nats or state is None or state.auth_dir is None or state.nats_pid is None:
        return
    auth = AuthDir(state.auth_dir)
    _, made = auth.add(Role.RANK, job_id)
    if not made:
        return
    reload_config(state.nats_pid)
    config = BusConfig.load(env=with_identity(os.environ, auth.env(Role.RANK, job_id)),
                            servers=[state.nats_url], connect_timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    while True:  # each attempt is bounded by the connect timeout
        try:
            await (await Bus.connect(config, name="phalanx-cli")).close()
            return
        except BusUnavailable:
            if time.monotonic() > deadline:
                raise


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    auth = sub.add_parser("auth", help="bus identities and permissions (docs/security.md)")
    auth_sub = auth.add_subparsers(dest="action", required=True)
    init = auth_sub.add_parser("init", help="make an auth directory: CA, server config, an "
                                            "identity per role")
    init.add_argument("dir")
    init.add_argument("--node", action="append", default=[], metavar="NODE",
                      help="also make this node's agent identity (repeatable)")
    init.add_argument("--host", action="append", default=[], metavar="HOST",
                      help="a name or IP clients dial the server by, for its certificate "
                           "(repeatable; loopback and this host are always in)")
    for name, what in (("add-node", "a node's agent"), ("add-job", "a job's ranks")):
        add = auth_sub.add_parser(name, help=f"add {what} identity")
        add.add_argument("dir")
        add.add_argument("id", metavar=name.removeprefix("add-").upper())
    auth.set_defaults(func=cmd_auth)
