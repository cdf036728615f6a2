"""``phalanx auth``: make an auth directory (CA, server config, an identity per role),
add a node's or a job's identity to one or revoke it; write one as a Kubernetes
deployment's Secrets and NATS chart values; and, on a secured local cluster, a submitted
job's identity made before its ranks need it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from phalanx.schemas import settings
from phalanx.services.cli.common import Parents, Subparsers


def cmd_auth(args: argparse.Namespace) -> int:
    """Make an auth directory, or add a node's or a job's identity to one or revoke it.
    Prints names, public keys and paths; never a seed."""
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role, identity

    if args.action == "init":
        auth = AuthDir.init(args.dir, nodes=args.node, hosts=args.host)
        print(f"made {auth.root}: server config {auth.config_path}, CA {auth.ca_path}")
        for who in auth.identities():
            print(f"  {who.name:<24} {who.public_key}  {auth.seed_path(who.role, who.scope)}")
        print(f"  replication key{'':<9} {auth.replication_key_path}")
        print(f"  replication TLS{'':<9} {auth.tls_dir}")
        print("start nats-server with `-c` that config; point each process at its identity "
              f"with {settings.NATS_NKEY}, {settings.NATS_INBOX_PREFIX} and "
              f"{settings.NATS_CA}, and each agent at the replication key with "
              f"{settings.AGENT('replica_key_file')} and at the replication certificate with "
              f"{settings.AGENT('replica_tls_dir')} (docs/security.md)")
        return 0
    if args.action == "kubernetes":
        return _kubernetes(args)
    role = Role.AGENT if args.action.endswith("-node") else Role.RANK
    auth = AuthDir(args.dir)
    if args.action.startswith("revoke-"):
        name = identity(role, args.id)
        if not auth.remove(role, args.id):
            print(f"phalanx auth: {auth.root} holds no identity {name}", file=sys.stderr)
            return 1
        print(f"revoked {name}: its user and its seed are gone from {auth.root}; have "
              "nats-server reload its config (SIGHUP): its connections are closed then, "
              "and none is admitted again")
        return 0
    who, made = auth.add(role, args.id)
    seed = auth.seed_path(role, args.id)
    if made:
        print(f"made {who.name} ({who.public_key}), seed {seed}; have nats-server reload its "
              f"config (SIGHUP) to admit it")
    else:
        print(f"{who.name} exists ({who.public_key}), seed {seed}")
    return 0


def _kubernetes(args: argparse.Namespace) -> int:
    """Write the auth directory ``args.dir`` (made if missing) as Kubernetes Secrets and
    NATS chart values beside it."""
    import yaml

    from phalanx.services.auth import kubernetes

    root = Path(args.dir)
    auth = kubernetes.prepare(root, args.namespace)
    secrets, values = root / "secrets.yaml", root / "nats-auth-values.yaml"
    fd = os.open(secrets, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump_all(kubernetes.secrets(auth, args.namespace, args.nodes_namespace), f,
                           sort_keys=False)
    values.write_text("# Made by `phalanx auth kubernetes`: give it to helm after "
                      "deploy/k8s/nats-values.yaml.\n"
                      + yaml.safe_dump(kubernetes.nats_values(auth), sort_keys=False))
    print(f"{auth.root}: identities {', '.join(w.name for w in auth.identities())}")
    print(f"  {secrets} (Secrets {kubernetes.IDENTITIES_SECRET}, {kubernetes.TLS_SECRET}, "
          f"{kubernetes.ROUTES_SECRET} in {args.namespace}, {kubernetes.AGENT_SECRET} in "
          f"{args.nodes_namespace}; holds the seeds: keep it as secret as {auth.root})")
    print(f"  {values} (the NATS chart's TLS and users)")
    print(f"kubectl apply -f {secrets}; helm install {kubernetes.RELEASE} nats/nats "
          f"-n {args.namespace} -f deploy/k8s/nats-values.yaml -f {values}")
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
    if args.nats or state is None or state.auth_dir is None:
        return
    servers = [*([state.nats_pid] if state.nats_pid else []), *state.nats_pids]
    if not servers:
        return
    auth = AuthDir(state.auth_dir)
    _, made = auth.add(Role.RANK, job_id)
    if not made:
        return
    for pid in servers:  # every server of an embedded cluster admits the job
        reload_config(pid)
    config = BusConfig.load(env=with_identity(os.environ, auth.env(Role.RANK, job_id)),
                            servers=state.nats_url, connect_timeout_s=1.0)
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
    k8s = auth_sub.add_parser(
        "kubernetes", help="write an auth directory (made if missing) as a Kubernetes "
                           "deployment's Secrets and NATS chart values (docs/deploy.md)")
    k8s.add_argument("dir")
    k8s.add_argument("--namespace", default="phalanx",
                     help="the namespace of the control plane and of the NATS release "
                          "(default phalanx)")
    k8s.add_argument("--nodes-namespace", default="phalanx-nodes",
                     help="the namespace of the agents (default phalanx-nodes)")
    for name, what in (("add-node", "add a node's agent identity"),
                       ("add-job", "add a job's ranks' identity"),
                       ("revoke-node", "revoke a node's agent identity (a node retired or "
                                       "compromised)"),
                       ("revoke-job", "revoke a job's ranks' identity")):
        add = auth_sub.add_parser(name, help=what)
        add.add_argument("dir")
        add.add_argument("id", metavar=name.split("-")[1].upper())
    auth.set_defaults(func=cmd_auth)
