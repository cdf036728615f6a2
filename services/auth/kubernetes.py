"""An auth directory in the form a Kubernetes deployment takes it: Secrets and chart values.

``phalanx auth kubernetes DIR`` makes (or reuses) the auth directory ``DIR`` with
the agents' shared identity (``agents``, :data:`~.roles.ANY`: nodes are DaemonSet
pods, and the server's config is the chart's, which phalanx does not rewrite), the
auth callout's identity (``callout``), the callout's account key, the cluster's
rank token key and the seed of the servers' system account user, and a server
certificate for the names pods dial the NATS service by, then writes beside it:

* ``secrets.yaml``, each Secret in the namespace of the pods that mount it: in the
  control plane's (``--namespace``), :data:`IDENTITIES_SECRET` (every identity's seed
  but the agents' as ``<identity>.nk``, the CA as ``ca.pem``, the callout's account
  seed as :data:`ISSUER_ITEM`, the rank token key as :data:`TOKEN_KEY_ITEM`, the seed
  of the servers' system account user as :data:`SYSTEM_ITEM`; each
  workload mounts only its own items), the TLS Secret :data:`TLS_SECRET` the NATS
  chart serves its client port with, and :data:`ROUTES_SECRET`, the route
  certificate (valid for the headless Service's pods, :func:`route_hosts`), the CA
  and the routes' password, which deploy/k8s/nats-values.yaml mounts for the
  chart's routes; in the agents' (``--nodes-namespace``), :data:`AGENT_SECRET` (their
  seed, the CA, the rank token key, the replication key and certificate);
* ``nats-auth-values.yaml``: values for the official NATS chart, given after
  ``deploy/k8s/nats-values.yaml``: TLS on the client port from that Secret, one NKEY
  user per identity with exactly its role's permissions (:mod:`.roles`), and the auth
  callout (``authorization.auth_callout``): its issuer is the callout's account key,
  and every identity above is one of its ``auth_users``, which the server admits by
  its seed without asking. Every other connection is asked about: a job's ranks,
  connecting with the rank token their agent minted for the job, are admitted as that
  job's ranks while it is live (:mod:`.callout`, :mod:`.rank_token`). The system
  account (:data:`SYSTEM_ACCOUNT`) has one user, which bypasses the callout too: the
  callout's revoker, which closes an ended job's open connections (:mod:`.revocation`).

Jobs have no seed and no user here: the shared ``ranks`` identity of earlier
versions is revoked when found. The values hold public keys only; the seeds, keys and
the server's private key are in ``secrets.yaml``, which is as secret as the
directory itself. Pure functions over an :class:`~.issuer.AuthDir`, but
:func:`prepare`, which makes what is missing: the CLI writes what they return.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import nkeys

from phalanx.services.auth import nats_jwt, tls
from phalanx.services.auth.errors import AuthError
from phalanx.services.auth.issuer import AuthDir, authorization
from phalanx.services.auth.replication_key import write_key
from phalanx.services.auth.roles import ANY, Role, identity

#: The Secret of the control plane's namespace: the seeds of every identity but the
#: agents', the CA, the callout's account seed and the rank token key.
IDENTITIES_SECRET = "phalanx-identities"
#: The Secret of the agents' namespace: their seed, the CA, the rank token key and the
#: replication key and certificate.
AGENT_SECRET = "phalanx-agent-identity"
#: The Secret the NATS chart serves TLS with (``config.nats.tls.secretName``).
TLS_SECRET = "phalanx-nats-tls"
#: The Secret of the chart's routes (``config.cluster.tls.secretName``): the route
#: certificate and key, the CA both ends verify each other with, and the routes'
#: password (:data:`ROUTE_PASSWORD_ITEM`, which the servers read from a variable).
ROUTES_SECRET = "phalanx-nats-routes"
ROUTE_PASSWORD_ITEM = "password"
#: The NATS chart's release name: its client Service, which the pods dial, and the
#: headless Service its servers route to each other by.
RELEASE = "nats"
#: The namespaces of the control plane (and NATS) and of the agents (deploy/k8s/base).
NAMESPACE, NODES_NAMESPACE = "phalanx", "phalanx-nodes"
#: The Secret items of the callout's account seed (the callout alone mounts it) and of
#: the rank token key (the agents, which mint, and the callout, which verifies).
ISSUER_ITEM = "callout-issuer.nk"
TOKEN_KEY_ITEM = "rank-token.key"
#: The servers' system account, and the Secret item of its one user's seed (the
#: callout alone mounts it: its revoker closes ended jobs' connections as that user).
SYSTEM_ACCOUNT = "SYS"
SYSTEM_ITEM = "system.nk"


def service_hosts(namespace: str, release: str = RELEASE) -> list[str]:
    """The names a pod may dial the NATS Service by: the server certificate names each."""
    return [release, f"{release}.{namespace}", f"{release}.{namespace}.svc",
            f"{release}.{namespace}.svc.cluster.local"]


def route_hosts(namespace: str, release: str = RELEASE) -> list[str]:
    """The names the chart's servers dial each other's routes by (``<pod>.<release>-
    headless``, short or qualified): the route certificate names each, a pod by wildcard."""
    headless = f"{release}-headless"
    return [f"*.{host}" for host in (headless, f"{headless}.{namespace}",
                                     f"{headless}.{namespace}.svc",
                                     f"{headless}.{namespace}.svc.cluster.local")]


def prepare(root: Path, namespace: str) -> AuthDir:
    """The auth directory at ``root`` with the agents' shared identity, the callout's
    identity, account key and rank token key, the routes' certificate and password,
    made for ``namespace`` if it does not exist yet; the ranks' shared identity of
    earlier versions revoked.

    Raises:
        AuthError: an existing directory's server certificate does not name the NATS
            Service in ``namespace`` (pods would refuse the server).
    """
    auth = AuthDir(root)
    if not auth.exists:
        auth = AuthDir.init(root, hosts=service_hosts(namespace))
    missing = [host for host in service_hosts(namespace)
               if host not in tls.server_hosts(auth.tls_dir)]
    if missing:
        raise AuthError(f"the server certificate of {root} does not name {', '.join(missing)}"
                        f": pods in namespace {namespace} could not verify the server (make "
                        f"the directory with `phalanx auth kubernetes` for that namespace)")
    auth.add(Role.AGENT, ANY)
    auth.add(Role.CALLOUT)
    auth.remove(Role.RANK, ANY)  # each job's ranks are their job now, through the callout
    write_key(auth.rank_token_key_path)
    _write_seed(auth.callout_issuer_path, nkeys.PREFIX_BYTE_ACCOUNT)
    _write_seed(auth.system_user_path, nkeys.PREFIX_BYTE_USER)
    # The routes' certificate for the headless Service's pods, and their password.
    tls.make_route_cert(auth.tls_dir, route_hosts(namespace))
    auth.route_security()
    return auth


def _write_seed(path: Path, kind: int) -> None:
    """A new seed of ``kind`` (an nkeys prefix byte) at ``path``, readable by its owner
    only; an existing one kept."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(nkeys.encode_seed(os.urandom(32), kind))


def callout_issuer(auth: AuthDir) -> str:
    """The public account key the auth callout signs with (the server's ``issuer``)."""
    return nats_jwt.public_key_of(auth.callout_issuer_path.read_bytes(), nats_jwt.ACCOUNT)


def system_user(auth: AuthDir) -> str:
    """The public key of the system account's user (the callout's revoker)."""
    return nats_jwt.public_key_of(auth.system_user_path.read_bytes(), nats_jwt.USER)


def _data(files: dict[str, bytes]) -> dict[str, str]:
    return {name: base64.b64encode(content).decode() for name, content in sorted(files.items())}


def secrets(auth: AuthDir, namespace: str = NAMESPACE,
            nodes_namespace: str = NODES_NAMESPACE) -> list[dict[str, object]]:
    """The Secrets of ``auth``'s deployment, each in the namespace of the pods that mount
    it: the control plane's identities, the NATS chart's TLS and its routes' in
    ``namespace``; the agents' in ``nodes_namespace``. Neither namespace holds the
    other's keys."""
    agents = identity(Role.AGENT, ANY)
    seeds = {f"{who.name}.nk": auth.seed_path(who.role, who.scope).read_bytes()
             for who in auth.identities()}
    tls.make_replication_cert(auth.tls_dir)  # for a directory made before it existed
    ca = auth.ca_path.read_bytes()
    token_key = auth.rank_token_key_path.read_bytes()
    control = {**{name: seed for name, seed in seeds.items() if name != f"{agents}.nk"},
               "ca.pem": ca, ISSUER_ITEM: auth.callout_issuer_path.read_bytes(),
               TOKEN_KEY_ITEM: token_key, SYSTEM_ITEM: auth.system_user_path.read_bytes()}
    node = {f"{agents}.nk": seeds[f"{agents}.nk"], "ca.pem": ca, TOKEN_KEY_ITEM: token_key,
            "replication.key": auth.replication_key_path.read_bytes(),
            tls.REPLICATION_CERT: (auth.tls_dir / tls.REPLICATION_CERT).read_bytes(),
            tls.REPLICATION_KEY: (auth.tls_dir / tls.REPLICATION_KEY).read_bytes()}
    server = {"tls.crt": (auth.tls_dir / tls.SERVER_CERT).read_bytes(),
              "tls.key": (auth.tls_dir / tls.SERVER_KEY).read_bytes(),
              "ca.crt": ca}
    route = auth.route_security()
    routes = {"tls.crt": Path(route.cert_file).read_bytes(),
              "tls.key": Path(route.key_file).read_bytes(), "ca.crt": ca,
              ROUTE_PASSWORD_ITEM: route.password.encode()}
    labels = {"app.kubernetes.io/part-of": "phalanx"}

    def secret(name: str, where: str, data: dict[str, bytes],
               kind: str = "Opaque") -> dict[str, object]:
        return {"apiVersion": "v1", "kind": "Secret", "type": kind,
                "metadata": {"name": name, "namespace": where, "labels": labels},
                "data": _data(data)}

    return [secret(IDENTITIES_SECRET, namespace, control),
            secret(AGENT_SECRET, nodes_namespace, node),
            secret(TLS_SECRET, namespace, server, "kubernetes.io/tls"),
            secret(ROUTES_SECRET, namespace, routes)]


def nats_values(auth: AuthDir) -> dict[str, object]:
    """The NATS chart's values that admit exactly ``auth``'s identities, and every other
    connection only through the auth callout, over TLS; and the system account, whose
    one user (the callout's revoker) may close any connection."""
    return {"config": {"nats": {"tls": {"enabled": True, "secretName": TLS_SECRET}},
                       "merge": {"authorization": server_authorization(auth),
                                 "system_account": SYSTEM_ACCOUNT,
                                 "accounts": {SYSTEM_ACCOUNT: {"users": [
                                     {"nkey": system_user(auth)}]}}}}}


def server_authorization(auth: AuthDir) -> dict[str, object]:
    """The server's ``authorization`` block: each identity's NKEY user with its role's
    permissions, and the auth callout, which every identity here bypasses."""
    who = auth.identities()
    return {**authorization(who), "auth_callout": {
        "issuer": callout_issuer(auth),
        "auth_users": sorted([*(w.public_key for w in who), system_user(auth)])}}
