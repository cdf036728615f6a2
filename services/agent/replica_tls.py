"""TLS for snapshot replication: the stream between agents encrypted and every byte
authenticated.

Without it, a snapshot (a job's weights and optimizer state) crosses the node network
in the clear, and only the offer and the 4 KiB header carry a MAC (:mod:`.replica_auth`):
the payload's xxh3-64 checksum catches damage, not an attacker. With the cluster's
replication certificate (``phalanx auth init`` writes it beside the bus's CA), the
listener and the sender speak mutual TLS 1.3: each presents that certificate and
accepts only a peer whose certificate chains to the cluster's CA *and* names the
replication role (``tls.REPLICATION_NAME``), so the bus server's certificate, signed by the
same CA, opens no replication stream either way. Host names are not checked: the
certificate is the role's, shared by every agent (as the replication key is), and the
buddy's address comes from the node registry. The key handshake of :mod:`.replica_auth`
still runs inside the TLS stream.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from phalanx.schemas.errors import ConfigError
from phalanx.services.auth import tls


def context(directory: str | Path, *, server: bool) -> ssl.SSLContext:
    """The TLS context of a replication listener (``server``) or sender, from the
    certificate, key and CA in ``directory`` (``AgentConfig.replica_tls_dir``).

    Raises:
        ConfigError: a file is missing, cannot be read or is not what it should be.
    """
    folder = Path(directory)
    cert, key, ca = (folder / name for name in (tls.REPLICATION_CERT, tls.REPLICATION_KEY,
                                                 tls.CA_CERT))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # a role's certificate, not a host's (module docstring)
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"replication TLS in {folder}: {exc} (made by `phalanx auth "
                          "init`)") from None
    return ctx


def peer_problem(peercert: dict[str, Any] | None) -> str:
    """Why the verified peer certificate is not a replication peer's ("" when it is)."""
    if not peercert:
        return "the peer presented no certificate"
    names = [value for rdn in peercert.get("subject", ()) for key, value in rdn
             if key == "commonName"]
    if names != [tls.REPLICATION_NAME]:
        return (f"the peer's certificate is {', '.join(names) or 'unnamed'}, not the "
                f"cluster's replication certificate ({tls.REPLICATION_NAME})")
    return ""
