"""The auth directory: every identity's key, and the nats-server config that admits them.

``phalanx auth init DIR`` makes one NKEY identity per static role (admission,
health, elasticity, checkpoint, cli, viewer), one per node given, a private CA
with the server's certificate, and ``nats.conf``; ``add-node`` / ``add-job``
add an agent's or a job's ranks' identity later, and :meth:`AuthDir.remove`
revokes one (the local cluster revokes a job's when the job ends). Layout::

    DIR/nats.conf          server config: TLS, and each identity's public key with its
                           permissions (roles.py); holds no secret
    DIR/identities.json    name, role, scope and public key of every identity
    DIR/keys/<name>.nk     seeds of the services, cli, viewer and agents (0600)
    DIR/keys/replication.key   the key agents prove to each other on the replication
                           port (0600, :mod:`~phalanx.services.auth.replication_key`)
    DIR/keys/rank-token.key, DIR/keys/callout-issuer.nk   Kubernetes only (``phalanx
                           auth kubernetes``): the key agents mint rank tokens with, and
                           the auth callout's account seed (0600)
    DIR/ranks/<job>.nk     one seed per job, shared by its ranks (0600): the directory
                           agents read when they launch a job's ranks
    DIR/tls/               ca.pem (clients: PHALANX_NATS_CA), ca-key.pem, server*.pem

NKEY users in a static server config, not decentralised JWT accounts: the
server keeps only public keys, clients prove they hold the seed by signing the
server's nonce, and nothing but nats-server, nats-py and the ``nkeys`` package
is needed — no ``nsc``, no account server, no JWT encoding of our own. The
price is that a new identity (a node, a job) takes effect when the server
reloads its config (SIGHUP: no connection is dropped); the local cluster does
that itself at submit. A revoked one is gone at the next reload too: the server
then closes the connections that identity holds.

A process is pointed at its identity through the environment
(:meth:`AuthDir.env`, :mod:`~phalanx.services.auth.credentials`). Seeds are never printed
or logged. Writers of the directory hold ``DIR/.lock``, so two submits at once
cannot lose each other's identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import nkeys

from phalanx.schemas import settings
from phalanx.services.auth import roles, tls
from phalanx.services.auth.credentials import identity_env, rank_seed_file
from phalanx.services.auth.errors import AuthError
from phalanx.services.auth.replication_key import write_key
from phalanx.services.auth.roles import Role
from phalanx.services.natsd import RouteSecurity

CONFIG = "nats.conf"
IDENTITIES = "identities.json"


@dataclasses.dataclass(frozen=True)
class Identity:
    """One identity: who it is and its public key (the seed stays in its file)."""

    name: str
    role: Role
    scope: str | None
    public_key: str


def new_seed() -> tuple[bytes, str]:
    """A fresh user seed and its public key."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def authorization(identities: Iterable[Identity]) -> dict[str, object]:
    """The server's ``authorization`` block: each identity's public key with its role's
    permissions."""
    users = []
    for who in sorted(identities, key=lambda i: i.name):
        granted = roles.permissions(who.role, who.scope)
        users.append({"nkey": who.public_key, "permissions": {
            "publish": {"allow": sorted(granted.publish)},
            "subscribe": {"allow": sorted(granted.subscribe)},
            **({"allow_responses": True} if granted.responds else {})}})
    return {"users": users}


def server_config(identities: Iterable[Identity], tls_dir: Path) -> dict[str, object]:
    """The nats-server config (as JSON, which its config format accepts): TLS on the
    client port, and :func:`authorization`."""
    return {"tls": {"cert_file": str(tls_dir / tls.SERVER_CERT),
                    "key_file": str(tls_dir / tls.SERVER_KEY), "timeout": 2},
            "authorization": authorization(identities)}


class AuthDir:
    """An auth directory made by :meth:`init`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG

    @property
    def tls_dir(self) -> Path:
        """The CA and the server's certificate and key (:mod:`.tls`)."""
        return self.root / "tls"

    @property
    def ca_path(self) -> Path:
        return self.tls_dir / tls.CA_CERT

    @property
    def replication_key_path(self) -> Path:
        return self.root / "keys" / "replication.key"

    @property
    def rank_token_key_path(self) -> Path:
        """The key agents mint rank tokens with and the auth callout verifies them with
        (Kubernetes: ``phalanx auth kubernetes`` makes it, :mod:`.rank_token`)."""
        return self.root / "keys" / "rank-token.key"

    @property
    def system_user_path(self) -> Path:
        """The seed of the servers' system account user, which the auth callout's revoker
        closes ended jobs' connections as (Kubernetes)."""
        return self.root / "keys" / "system.nk"

    @property
    def callout_issuer_path(self) -> Path:
        """The seed of the account key the auth callout signs with (Kubernetes)."""
        return self.root / "keys" / "callout-issuer.nk"

    def route_security(self) -> RouteSecurity:
        """What the servers of a secured NATS cluster prove to each other on their routes
        (:class:`~phalanx.services.natsd.RouteSecurity`): the route certificate signed by
        this directory's CA, and the routes' password (``keys/route.password``), both made
        the first time."""
        tls.make_route_cert(self.tls_dir)
        password = self.root / "keys" / "route.password"
        write_key(password)
        return RouteSecurity(cert_file=str(self.tls_dir / tls.ROUTE_CERT),
                             key_file=str(self.tls_dir / tls.ROUTE_KEY),
                             ca_file=str(self.ca_path), user="route",
                             password=password.read_text().strip())

    @property
    def ranks_dir(self) -> Path:
        return self.root / "ranks"

    def seed_path(self, role: Role, scope: str | None = None) -> Path:
        if role is Role.RANK and scope != roles.ANY:
            assert scope is not None
            return rank_seed_file(self.ranks_dir, scope)
        return self.root / "keys" / f"{roles.identity(role, scope)}.nk"

    @property
    def exists(self) -> bool:
        return (self.root / IDENTITIES).is_file()

    @classmethod
    def init(cls, root: str | os.PathLike[str], *, nodes: Iterable[str] = (),
             hosts: Iterable[str] = ()) -> AuthDir:
        """Make the directory: CA and server certificate for loopback, this host and
        ``hosts``; an identity per static role and per node in ``nodes``.

        Raises:
            AuthError: ``root`` already holds an auth directory.
        """
        auth = cls(root)
        if auth.exists:
            raise AuthError(f"{auth.root} already holds an auth directory; add identities "
                            f"with `phalanx auth add-node` / `add-job`")
        auth.root.mkdir(parents=True, exist_ok=True)
        os.chmod(auth.root, 0o700)
        tls.make_ca_and_server_cert(auth.tls_dir, ["127.0.0.1", "::1", "localhost",
                                                        socket.gethostname(), *hosts])
        tls.make_replication_cert(auth.tls_dir)
        with auth._locked():
            (auth.root / IDENTITIES).write_text("[]")
            for role in roles.STATIC_ROLES:
                auth._add(role, None)
            for node in nodes:
                auth._add(Role.AGENT, node)
        write_key(auth.replication_key_path)
        return auth

    def add(self, role: Role, scope: str | None = None) -> tuple[Identity, bool]:
        """The identity of ``role`` (for ``scope``), made now if it did not exist, and
        whether it was made (then the server must reload its config to admit it).

        Raises:
            AuthError: the directory was not made with :meth:`init`.
        """
        self._require()
        with self._locked():
            return self._add(role, scope)

    def identity(self, role: Role, scope: str | None = None) -> Identity:
        """An existing identity.

        Raises:
            AuthError: there is none.
        """
        self._require()
        name = roles.identity(role, scope)
        for who in self.identities():
            if who.name == name:
                return who
        raise AuthError(f"no identity {name} in {self.root}")

    def remove(self, role: Role, scope: str | None = None) -> bool:
        """Revoke an identity: its entry, its user in the server config and its seed go.
        Whether there was one (then the server must reload its config, which also closes
        the identity's connections).

        Raises:
            AuthError: the directory was not made with :meth:`init`.
        """
        self._require()
        name = roles.identity(role, scope)
        with self._locked():
            everyone = self.identities()
            rest = [who for who in everyone if who.name != name]
            if len(rest) == len(everyone):
                return False
            self._write(rest)
            self.seed_path(role, scope).unlink(missing_ok=True)
        return True

    def identities(self) -> list[Identity]:
        raw = json.loads((self.root / IDENTITIES).read_text())
        return [Identity(r["name"], Role(r["role"]), r["scope"], r["public_key"]) for r in raw]

    def env(self, role: Role, scope: str | None = None) -> dict[str, str]:
        """The environment that makes a process connect as ``role`` (``scope``), over TLS.

        Raises:
            AuthError: the identity does not exist.
        """
        who = self.identity(role, scope)
        env = identity_env(self.seed_path(role, scope), who.name, str(self.ca_path))
        if role is Role.AGENT:  # made here for a directory older than the key
            write_key(self.replication_key_path)
            tls.make_replication_cert(self.tls_dir)
            env[settings.AGENT("replica_key_file")] = str(self.replication_key_path)
            env[settings.AGENT("replica_tls_dir")] = str(self.tls_dir)
        return env

    def _require(self) -> None:
        if not self.exists:
            raise AuthError(f"{self.root} is not an auth directory (make one with "
                            f"`phalanx auth init {self.root}`)")

    def _add(self, role: Role, scope: str | None) -> tuple[Identity, bool]:
        name = roles.identity(role, scope)
        existing = {who.name: who for who in self.identities()}
        if name in existing:
            return existing[name], False
        seed, public_key = new_seed()
        seed_file = self.seed_path(role, scope)
        seed_file.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(seed_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(seed)
        who = Identity(name, role, scope, public_key)
        self._write([*existing.values(), who])
        return who, True

    def _write(self, everyone: list[Identity]) -> None:
        """Record ``everyone`` and the server config that admits exactly them."""
        _replace(self.root / IDENTITIES, json.dumps(
            [dataclasses.asdict(i) for i in everyone], indent=2))
        _replace(self.config_path,
                 json.dumps(server_config(everyone, self.tls_dir), indent=2))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with (self.root / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reloading server never reads half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)

