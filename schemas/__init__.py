"""phalanx's wire contract: message types, subjects, the codec and errors.

Imports nothing else of phalanx, so every side (services, runtime, tools) can
depend on it.
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
