"""The error hierarchy every part of phalanx raises.

One root, :class:`PhalanxError`. A subclass exists only where a caller can act
on it differently, and it also inherits the builtin it means (a timeout is a
``TimeoutError``, a malformed payload a ``ValueError``), so generic handlers
keep working. Messages state the subject, field and numbers involved.
"""

from __future__ import annotations


class PhalanxError(Exception):
    """Root of every error phalanx raises on purpose."""


class WireError(PhalanxError, ValueError):
    """A payload could not be decoded into the message type its subject carries.

    Attributes:
        subject: the NATS subject the payload arrived on ("" when unknown).
        message_type: the message type name it was decoded as.
        problem: what is wrong, in one line.
    """

    def __init__(self, problem: str, *, subject: str = "", message_type: str = "") -> None:
        self.subject = subject
        self.message_type = message_type
        self.problem = problem
        where = f" on {subject!r}" if subject else ""
        what = f" as {message_type}" if message_type else ""
        super().__init__(f"cannot decode payload{where}{what}: {problem}")


class MustStop(PhalanxError, RuntimeError):
    """A background task's failure that must end its process, because going on would be
    wrong (another live process holds this one's identity). Any other failure of a
    service's background task is logged and the task goes on or starts again."""


class SubjectError(PhalanxError, ValueError):
    """A subject token is not allowed (empty, a dot, a wildcard, whitespace, ``$``)."""


class ConfigError(PhalanxError, ValueError):
    """A configuration value is missing or out of range; the message names it."""


class StoredStateError(PhalanxError, ValueError):
    """A leader's stored state (a job's snapshot in its bucket) that this version
    cannot read; the message says what is wrong with it."""
