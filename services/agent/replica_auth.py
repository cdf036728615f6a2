"""Agents prove to each other that they hold the cluster's replication key.

A buddy's replication listener (:mod:`.replication`) takes snapshot bytes that a
rank's restore may load, and a sender hands its buddy the model and optimizer
state of its jobs: on a secured cluster both ends must be agents of the cluster.
They share one secret, the *replication key*
(:mod:`phalanx.services.auth.replication_key`). The key never crosses the wire;
each connection begins with a challenge both ways:

1. the listener sends a fresh 32-byte nonce (its *hello*);
2. the sender answers with its own nonce and HMAC-SHA256(key, "sender" |
   listener's nonce | sender's nonce);
3. the listener checks it and answers HMAC-SHA256(key, "listener" | sender's
   nonce | listener's nonce), which the sender checks before it sends anything.

Each replica's offer and 4 KiB header then carry HMAC-SHA256(key, "offer" | both
nonces | the offer's number on the connection | offer | header): an offer
spliced into the stream, replayed from another connection or reordered is
refused. The payload is covered by the header's xxh3-64 checksum, which catches
damage but is no MAC: against an active attacker on the node network the bytes
themselves are not authenticated (docs/security.md).

An agent without a key proves nothing (its MACs are zeros) and checks nothing:
the unsecured local cluster's behaviour. A keyed listener refuses an unkeyed
sender, and a keyed sender sends nothing to a listener that cannot prove the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32
MAC_BYTES = 32
NO_MAC = bytes(MAC_BYTES)


class Handshake:
    """One connection's end of the challenge: this end's nonce, the peer's once known,
    and the MACs both ways with ``key`` (None: an unsecured agent, proving nothing and
    checking nothing)."""

    def __init__(self, key: bytes | None, *, listener: bool) -> None:
        self.key = key
        self.role, self.peer_role = (b"listener", b"sender") if listener \
            else (b"sender", b"listener")
        self.mine = secrets.token_bytes(NONCE_BYTES)
        self.theirs = bytes(NONCE_BYTES)  # the peer's nonce, once received
        self.offers = 0  # offers sealed or opened on this connection

    def proof(self) -> bytes:
        """This end's answer to the peer's nonce."""
        return self._mac(self.role, self.theirs, self.mine)

    def proven(self, mac: bytes) -> bool:
        """Whether the peer's answer to this end's nonce proves the key."""
        return self.key is None or hmac.compare_digest(
            mac, self._mac(self.peer_role, self.mine, self.theirs))

    def seal(self, offer: bytes, header: bytes) -> bytes:
        """The MAC of the connection's next offer and its header (this end sends it)."""
        return self._offer_mac(offer, header)

    def opened(self, offer: bytes, header: bytes, mac: bytes) -> bool:
        """Whether ``mac`` is the sender's seal of the connection's next offer."""
        expected = self._offer_mac(offer, header)  # counted either way
        return self.key is None or hmac.compare_digest(mac, expected)

    def _offer_mac(self, offer: bytes, header: bytes) -> bytes:
        listener, sender = (self.mine, self.theirs) if self.role == b"listener" \
            else (self.theirs, self.mine)
        number = self.offers.to_bytes(8, "little")
        self.offers += 1
        return self._mac(b"offer", listener, sender, number, offer, header)

    def _mac(self, *parts: bytes) -> bytes:
        if self.key is None:
            return NO_MAC
        return hmac.new(self.key, b"".join(parts), hashlib.sha256).digest()
