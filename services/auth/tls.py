"""A private certificate authority and the nats-server certificate it signs.

``phalanx auth init`` makes both so the client port speaks TLS: clients verify
the server against the CA (``PHALANX_NATS_CA``), and nobody on the network
reads seeds' signatures, job records or generations in passing. The server
certificate names the hosts clients dial (loopback and this host's name by
default; add the real names with ``--host``), since clients check the name.
Keys are ECDSA P-256, written owner-read-only. The CA key stays in the auth
directory to sign a new server certificate; whoever holds it can impersonate
the server, so it belongs with the operator, never on nodes.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825  # the longest validity clients still accept for a server certificate
#: The files :func:`make_ca_and_server_cert` writes in its directory.
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.pem", "ca-key.pem", "server.pem", "server-key.pem"
#: The files :func:`make_replication_cert` writes beside them.
REPLICATION_CERT, REPLICATION_KEY = "replication.pem", "replication-key.pem"
#: The replication certificate's common name (``services/agent/replica_tls.py`` checks it).
REPLICATION_NAME = "phalanx replication"
#: The files :func:`make_route_cert` writes beside them, and its common name.
ROUTE_CERT, ROUTE_KEY, ROUTE_NAME = "route.pem", "route-key.pem", "phalanx nats route"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "phalanx"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _subject_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_ca_and_server_cert(directory: Path, hosts: Iterable[str]) -> None:
    """Write :data:`CA_CERT`, :data:`CA_KEY`, :data:`SERVER_CERT` and :data:`SERVER_KEY`
    in ``directory``; the server certificate is valid for ``hosts`` (names or IPs)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("phalanx bus CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(validity[0]).not_valid_after(validity[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (x509.CertificateBuilder().subject_name(_name("phalanx nats-server"))
              .issuer_name(ca_name).public_key(server_key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(validity[0]).not_valid_after(validity[1])
              .add_extension(x509.SubjectAlternativeName(_subject_names(hosts)), critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                             critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
    _write_key(directory / CA_KEY, ca_key)
    _write_key(directory / SERVER_KEY, server_key)
    (directory / CA_CERT).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / SERVER_CERT).write_bytes(server.public_bytes(serialization.Encoding.PEM))


def make_replication_cert(directory: Path) -> None:
    """Write :data:`REPLICATION_CERT` and :data:`REPLICATION_KEY` in ``directory``, signed
    by the CA there: the certificate every agent presents on its replication stream
    (mutual TLS, client and server). Kept if it exists already."""
    _make_peer_cert(directory, REPLICATION_CERT, REPLICATION_KEY, REPLICATION_NAME, ())


def make_route_cert(directory: Path, hosts: Iterable[str] = ()) -> None:
    """Write :data:`ROUTE_CERT` and :data:`ROUTE_KEY` in ``directory``, signed by the CA
    there: the certificate each server of a NATS cluster presents to the others on its
    route port (mutual TLS, client and server; the route's dialer checks the name, so it
    is valid for the server certificate's hosts and ``hosts``, the names servers dial
    each other's routes by). Kept if it exists already and names every one of
    ``hosts``; made again otherwise (both ends use the same certificate)."""
    hosts = list(hosts)
    cert = directory / ROUTE_CERT
    if cert.exists() and not set(hosts) <= cert_hosts(cert):
        cert.unlink()
    _make_peer_cert(directory, ROUTE_CERT, ROUTE_KEY, ROUTE_NAME,
                    [*sorted(server_hosts(directory)), *hosts])


def _make_peer_cert(directory: Path, cert_file: str, key_file: str, common_name: str,
                    hosts: Iterable[str]) -> None:
    """A certificate for both ends of a mutual TLS connection, signed by the CA in
    ``directory``, valid for ``hosts`` where there are any."""
    if (directory / cert_file).exists() and (directory / key_file).exists():
        return
    ca = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    ca_key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(_name(common_name))
               .issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(min(ca.not_valid_after_utc, now + datetime.timedelta(
                   days=VALID_DAYS)))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                              critical=True))
    if names := _subject_names(hosts):
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(directory / key_file, key)
    (directory / cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def server_hosts(directory: Path) -> set[str]:
    """The names and IPs the server certificate in ``directory`` is valid for."""
    return cert_hosts(directory / SERVER_CERT)


def cert_hosts(path: Path) -> set[str]:
    """The names and IPs the certificate at ``path`` is valid for."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {*names.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in names.get_values_for_type(x509.IPAddress))}
