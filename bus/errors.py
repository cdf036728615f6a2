"""Errors of talking over the bus; each also inherits the builtin it means."""

from __future__ import annotations

from phalanx.schemas.errors import PhalanxError


class BusUnavailable(PhalanxError, ConnectionError):
    """No NATS server could be reached within the connect timeout."""


class RequestTimeout(PhalanxError, TimeoutError):
    """A request got no reply within its timeout."""


class NoResponders(PhalanxError, ConnectionError):
    """Nobody subscribes to the subject a request was sent to."""


class RemoteError(PhalanxError, RuntimeError):
    """The responder answered with a NATS service API error.

    Attributes:
        code: the ``Nats-Service-Error-Code`` ("400" bad request, "500" handler failure).
        description: the responder's ``Nats-Service-Error`` text.
        subject: the subject the request went to.
    """

    def __init__(self, code: str, description: str, subject: str) -> None:
        self.code = code
        self.description = description
        self.subject = subject
        super().__init__(f"{subject} answered error {code}: {description}")


class RequestRefused(PhalanxError, RuntimeError):
    """Raised by a request handler to answer with a specific service error code.

    Codes follow HTTP: 400 bad request, 404 unknown, 409 conflict, 503 try again.
    """

    def __init__(self, code: str, description: str) -> None:
        self.code = code
        self.description = description
        super().__init__(f"{code}: {description}")


class Conflict(PhalanxError, RuntimeError):
    """A KV compare-and-swap lost: the key changed (or exists) since it was read."""


class PermissionDenied(PhalanxError, PermissionError):
    """The server refused this identity a publish (or subscription) on ``subject``.

    Attributes:
        subject: what was refused.
    """

    def __init__(self, subject: str, what: str = "publish to") -> None:
        self.subject = subject
        super().__init__(f"the bus refused this identity permission to {what} {subject} "
                         "(see docs/security.md for each role's permissions)")
