"""phalanx's contract: message types, subjects, the codec and errors, and what two sides
must read alike (the snapshot file format, replica ids, scaling rules, node liveness).

Imports nothing else of phalanx, so every side (services, runtime, tools) can
depend on it, and two sides share a rule by both importing it from here.
"""

from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, decode, encode
from phalanx.schemas.errors import ConfigError, PhalanxError, SubjectError, WireError
from phalanx.schemas.messages import ALL_MESSAGES, Message

__version__ = "0.1.0"

__all__ = [
    "ALL_MESSAGES",
    "MAX_PAYLOAD_BYTES",
    "ConfigError",
    "Message",
    "PhalanxError",
    "SubjectError",
    "WireError",
    "__version__",
    "decode",
    "encode",
]
