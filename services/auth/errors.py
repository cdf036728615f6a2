"""The auth library's error: one root for what its callers can act on."""

from __future__ import annotations

from phalanx.schemas.errors import PhalanxError


class AuthError(PhalanxError, RuntimeError):
    """The auth directory is missing, already made, or lacks an identity; or a credential
    (a JWT, a rank token) does not hold."""
