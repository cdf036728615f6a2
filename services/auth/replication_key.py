"""The cluster's replication key: the secret agents prove to each other before any
snapshot moves between them (the handshake is :mod:`phalanx.services.agent.replica_auth`).

One key per cluster, 32 random bytes written as hex to a file readable by its owner
only: ``phalanx auth init`` puts it at ``keys/replication.key`` of the auth directory,
``phalanx up --secure`` hands its path to the local agents, and a deployment mounts it
from a Secret. An agent reads the file ``PHALANX_AGENT_REPLICA_KEY_FILE`` names: an
agent variable, which no rank's environment holds
(:func:`~phalanx.services.auth.credentials.rank_environment`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from phalanx.schemas.errors import ConfigError

#: The shortest key accepted: 256 bits, as HMAC-SHA256 needs to keep its strength.
KEY_BYTES = 32


def load_key(path: str | os.PathLike[str], what: str = "replication key") -> bytes:
    """The key in the file at ``path``: hex digits (whitespace ignored). The same form
    holds the rank token key (:mod:`~phalanx.services.auth.rank_token`): ``what`` names
    the key in errors.

    Raises:
        ConfigError: the file cannot be read, or is not hex of at least 32 bytes.
    """
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path}: cannot be read: {exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{what} {path}: not hex digits (make one with "
                          "`phalanx auth init` or `phalanx auth kubernetes`)") from None
    if len(key) < KEY_BYTES:
        raise ConfigError(f"{what} {path}: {len(key)} bytes, at least "
                          f"{KEY_BYTES} needed")
    return key


def write_key(path: Path) -> None:
    """A new random key at ``path``, readable by its owner only; an existing one is kept."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
