"""An auth directory as Kubernetes takes it: the Secrets and the NATS chart's values."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import nkeys
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from phalanx.services.auth import kubernetes, tls
from phalanx.services.auth.issuer import AuthDir, AuthError, authorization
from phalanx.services.auth.roles import ANY, STATIC_ROLES, Role, identity
from phalanx.services.cli import main as cli_main


def test_a_new_directory_has_every_role_the_callout_and_the_services_names(
        tmp_path: Path) -> None:
    auth = kubernetes.prepare(tmp_path / "auth", "ml")
    names = {who.name for who in auth.identities()}
    assert names == {*(identity(r) for r in STATIC_ROLES), "agents", "callout"}
    assert "ranks" not in names, "each job's ranks are their job, through the callout"
    assert auth.rank_token_key_path.stat().st_mode & 0o777 == 0o600
    assert auth.callout_issuer_path.stat().st_mode & 0o777 == 0o600
    assert kubernetes.callout_issuer(auth).startswith("A")
    hosts = tls.server_hosts(auth.tls_dir)
    assert set(kubernetes.service_hosts("ml")) <= hosts
    assert "nats.ml.svc.cluster.local" in hosts


def test_an_existing_directory_gains_the_agents_and_the_callout_and_keeps_the_rest(
        tmp_path: Path) -> None:
    before = AuthDir.init(tmp_path / "auth", nodes=["gpu-01"],
                          hosts=kubernetes.service_hosts("phalanx"))
    kept = {who.name: who.public_key for who in before.identities()}
    auth = kubernetes.prepare(tmp_path / "auth", "phalanx")
    now = {who.name: who.public_key for who in auth.identities()}
    assert {k: now[k] for k in kept} == kept
    assert set(now) - set(kept) == {"agents", "callout"}


def test_the_ranks_shared_identity_of_an_earlier_directory_is_revoked(tmp_path: Path) -> None:
    before = AuthDir.init(tmp_path / "auth", hosts=kubernetes.service_hosts("phalanx"))
    before.add(Role.RANK, ANY)
    token_key = None
    for _ in range(2):  # and a second run keeps the keys it made
        auth = kubernetes.prepare(tmp_path / "auth", "phalanx")
        assert "ranks" not in {w.name for w in auth.identities()}
        assert not auth.seed_path(Role.RANK, ANY).exists()
        assert token_key in (None, auth.rank_token_key_path.read_bytes())
        token_key = auth.rank_token_key_path.read_bytes()


def test_an_existing_directory_whose_certificate_misses_the_service_is_refused(
        tmp_path: Path) -> None:
    AuthDir.init(tmp_path / "auth", hosts=kubernetes.service_hosts("ml"))
    with pytest.raises(AuthError, match=r"does not name nats\.phalanx, nats\.phalanx\.svc"):
        kubernetes.prepare(tmp_path / "auth", "phalanx")
    assert "agents" not in {w.name for w in AuthDir(tmp_path / "auth").identities()}


def test_the_secrets_hold_each_seed_of_the_key_the_values_admit(tmp_path: Path) -> None:
    auth = kubernetes.prepare(tmp_path / "auth", "phalanx")
    identities, agents, tls, _ = kubernetes.secrets(auth, "phalanx", "phalanx-nodes")
    assert identities["metadata"] == {"name": kubernetes.IDENTITIES_SECRET,
                                      "namespace": "phalanx",
                                      "labels": {"app.kubernetes.io/part-of": "phalanx"}}
    assert (agents["metadata"]["name"], agents["metadata"]["namespace"]) == (
        kubernetes.AGENT_SECRET, "phalanx-nodes")
    control = {k: base64.b64decode(v) for k, v in identities["data"].items()}
    node = {k: base64.b64decode(v) for k, v in agents["data"].items()}
    # Each namespace holds its pods' keys alone: the agents' seed and the replication key
    # and certificate in theirs, every other seed and the callout's key in the other.
    assert set(node) == {"agents.nk", "ca.pem", kubernetes.TOKEN_KEY_ITEM, "replication.key",
                         "replication.pem", "replication-key.pem"}
    assert not {"agents.nk", "replication.key", "replication-key.pem"} & set(control)
    assert kubernetes.SYSTEM_ITEM in control and kubernetes.SYSTEM_ITEM not in node
    data = {**control, **node}
    for who in auth.identities():
        seed = bytearray(data[f"{who.name}.nk"])
        assert nkeys.from_seed(seed).public_key.decode() == who.public_key, who.name
    assert control["ca.pem"] == node["ca.pem"] == auth.ca_path.read_bytes()
    assert data["replication.key"] == auth.replication_key_path.read_bytes()
    for name in ("replication.pem", "replication-key.pem"):  # the stream's TLS
        assert data[name] == (auth.tls_dir / name).read_bytes()
    assert (tls["type"], tls["metadata"]["name"]) == ("kubernetes.io/tls",
                                                      kubernetes.TLS_SECRET)
    assert {"tls.crt", "tls.key", "ca.crt"} == set(tls["data"])
    values = kubernetes.nats_values(auth)
    assert values["config"]["nats"]["tls"] == {"enabled": True,
                                               "secretName": kubernetes.TLS_SECRET}
    # The callout's account seed for the callout, the token key for it and the agents.
    assert data[kubernetes.ISSUER_ITEM] == auth.callout_issuer_path.read_bytes()
    assert data[kubernetes.TOKEN_KEY_ITEM] == auth.rank_token_key_path.read_bytes()
    block = values["config"]["merge"]["authorization"]
    assert block["users"] == authorization(auth.identities())["users"]
    # The system account has one user, the callout's revoker, whose seed is the item's.
    system_user = nkeys.from_seed(bytearray(data[kubernetes.SYSTEM_ITEM])).public_key.decode()
    assert system_user.startswith("U")
    merged = values["config"]["merge"]
    assert merged["system_account"] == kubernetes.SYSTEM_ACCOUNT
    assert merged["accounts"] == {kubernetes.SYSTEM_ACCOUNT: {"users": [{"nkey": system_user}]}}
    # Every identity and that user bypass the callout; everyone else is asked about.
    assert block["auth_callout"] == {
        "issuer": nkeys.from_seed(bytearray(data[kubernetes.ISSUER_ITEM])).public_key.decode(),
        "auth_users": sorted([*(w.public_key for w in auth.identities()), system_user])}
    shown = yaml.safe_dump(values)
    assert not [w for w in auth.identities()
                if auth.seed_path(w.role, w.scope).read_text().strip() in shown], "a seed"
    assert data[kubernetes.ISSUER_ITEM].decode().strip() not in shown
    assert data[kubernetes.TOKEN_KEY_ITEM].decode().strip() not in shown
    assert data[kubernetes.SYSTEM_ITEM].decode().strip() not in shown


def test_the_command_writes_the_secrets_for_its_owner_alone(tmp_path: Path, capsys) -> None:
    root = tmp_path / "auth"
    assert cli_main(["auth", "kubernetes", str(root), "--namespace", "ml",
                     "--nodes-namespace", "ml-nodes"]) == 0
    secrets = list(yaml.safe_load_all((root / "secrets.yaml").read_text()))
    assert {s["metadata"]["name"]: s["metadata"]["namespace"] for s in secrets} == {
        kubernetes.IDENTITIES_SECRET: "ml", kubernetes.TLS_SECRET: "ml",
        kubernetes.ROUTES_SECRET: "ml", kubernetes.AGENT_SECRET: "ml-nodes"}
    assert stat.S_IMODE((root / "secrets.yaml").stat().st_mode) == 0o600
    values = yaml.safe_load((root / "nats-auth-values.yaml").read_text())
    users = values["config"]["merge"]["authorization"]["users"]
    assert len(users) == len(AuthDir(root).identities())
    shown = capsys.readouterr().out
    assert "helm install nats nats/nats -n ml" in shown
    assert not [line for line in shown.split() if line.startswith("SU")], "no seed printed"
    # Run again: the same identities, nothing minted twice.
    keys = {w.name: w.public_key for w in AuthDir(root).identities()}
    assert cli_main(["auth", "kubernetes", str(root), "--namespace", "ml"]) == 0
    assert {w.name: w.public_key for w in AuthDir(root).identities()} == keys
    assert identity(Role.CALLOUT) in keys and identity(Role.RANK, ANY) not in keys


def test_the_routes_secret_holds_a_certificate_for_the_headless_pods_and_a_password(
        tmp_path: Path) -> None:
    """The chart's routes: the route certificate of the directory's CA, valid for every
    name of the headless Service's pods, client and server; the routes' password, the
    same on every run."""
    auth = kubernetes.prepare(tmp_path / "auth", "ml")
    *_, routes = kubernetes.secrets(auth, "ml", "ml-nodes")
    assert (routes["metadata"]["name"], routes["metadata"]["namespace"]) == (
        kubernetes.ROUTES_SECRET, "ml")
    data = {k: base64.b64decode(v) for k, v in routes["data"].items()}
    assert set(data) == {"tls.crt", "tls.key", "ca.crt", kubernetes.ROUTE_PASSWORD_ITEM}
    cert = x509.load_pem_x509_certificate(data["tls.crt"])
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(data["ca.crt"]))
    assert data["ca.crt"] == auth.ca_path.read_bytes()
    names = set(cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    assert {"*.nats-headless", "*.nats-headless.ml", "*.nats-headless.ml.svc",
            "*.nats-headless.ml.svc.cluster.local"} <= names
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert data[kubernetes.ROUTE_PASSWORD_ITEM].decode() == auth.route_security().password
    # A route certificate made before (by `phalanx up --secure --nats-cluster`) lacks the
    # pods' names: it is made again with them.
    (auth.tls_dir / tls.ROUTE_CERT).unlink()
    tls.make_route_cert(auth.tls_dir)
    assert "*.nats-headless" not in tls.cert_hosts(auth.tls_dir / tls.ROUTE_CERT)
    again = kubernetes.prepare(tmp_path / "auth", "ml")
    assert set(kubernetes.route_hosts("ml")) <= tls.cert_hosts(again.tls_dir / tls.ROUTE_CERT)
