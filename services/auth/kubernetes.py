"""An auth directory in the form a Kubernetes deployment takes it: Secrets and chart values.

``phalanx auth kubernetes DIR`` makes (or reuses) the auth directory ``DIR``
with the agents' and ranks' shared identities (:data:`~.roles.ANY`: on
Kubernetes, nodes are DaemonSet pods and jobs arrive at any time, and the
server's config is the chart's, which phalanx does not rewrite) and a server
certificate for the names pods dial the NATS service by, then writes beside it:

* ``secrets.yaml``: the Secret :data:`IDENTITIES_SECRET` (every identity's seed as
  ``<identity>.nk``, the CA as ``ca.pem``, the replication key as
  ``replication.key``; each workload mounts only its own items) and the TLS Secret
  :data:`TLS_SECRET` the NATS chart serves its client port with;
* ``nats-auth-values.yaml``: values for the official NATS chart, given after
  ``deploy/k8s/nats-values.yaml``: TLS on the client port from that Secret, and one
  NKEY user per identity with exactly its role's permissions (:mod:`.roles`).

The values hold public keys only; the seeds and the server's private key are in
``secrets.yaml``, which is as secret as the directory itself. Pure functions
over an :class:`~.issuer.AuthDir`: the CLI writes what they return.
"""

from __future__ import annotations

import base64
from pathlib import Path

from phalanx.services.auth import tls
from phalanx.services.auth.issuer import AuthDir, AuthError, authorization
from phalanx.services.auth.roles import ANY, Role

#: The Secret holding every identity's seed, the CA and the replication key.
IDENTITIES_SECRET = "phalanx-identities"
#: The Secret the NATS chart serves TLS with (``config.nats.tls.secretName``).
TLS_SECRET = "phalanx-nats-tls"
#: The NATS chart's release name: its client Service, which the pods dial.
RELEASE = "nats"


def service_hosts(namespace: str, release: str = RELEASE) -> list[str]:
    """The names a pod may dial the NATS Service by: the server certificate names each."""
    return [release, f"{release}.{namespace}", f"{release}.{namespace}.svc",
            f"{release}.{namespace}.svc.cluster.local"]


def prepare(root: Path, namespace: str) -> AuthDir:
    """The auth directory at ``root`` with the agents' and the ranks' shared identities,
    made for ``namespace`` if it does not exist yet.

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
    for role in (Role.AGENT, Role.RANK):
        auth.add(role, ANY)
    return auth


def _data(files: dict[str, bytes]) -> dict[str, str]:
    return {name: base64.b64encode(content).decode() for name, content in sorted(files.items())}


def secrets(auth: AuthDir, namespace: str) -> list[dict]:
    """The Secrets of ``auth``'s deployment in ``namespace``."""
    seeds = {f"{who.name}.nk": auth.seed_path(who.role, who.scope).read_bytes()
             for who in auth.identities()}
    tls.make_replication_cert(auth.tls_dir)  # for a directory made before it existed
    identities = {**seeds, "ca.pem": auth.ca_path.read_bytes(),
                  "replication.key": auth.replication_key_path.read_bytes(),
                  tls.REPLICATION_CERT: (auth.tls_dir / tls.REPLICATION_CERT).read_bytes(),
                  tls.REPLICATION_KEY: (auth.tls_dir / tls.REPLICATION_KEY).read_bytes()}
    server = {"tls.crt": (auth.tls_dir / tls.SERVER_CERT).read_bytes(),
              "tls.key": (auth.tls_dir / tls.SERVER_KEY).read_bytes(),
              "ca.crt": auth.ca_path.read_bytes()}
    labels = {"app.kubernetes.io/part-of": "phalanx"}
    return [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": IDENTITIES_SECRET, "namespace": namespace, "labels": labels},
         "data": _data(identities)},
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
         "metadata": {"name": TLS_SECRET, "namespace": namespace, "labels": labels},
         "data": _data(server)},
    ]


def nats_values(auth: AuthDir) -> dict:
    """The NATS chart's values that admit exactly ``auth``'s identities, over TLS."""
    return {"config": {"nats": {"tls": {"enabled": True, "secretName": TLS_SECRET}},
                       "merge": {"authorization": authorization(auth.identities())}}}
