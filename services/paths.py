"""Where phalanx keeps local state: ``$PHALANX_DATA_DIR``, else ``~/.local/state/phalanx``."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    return Path(os.environ.get("PHALANX_DATA_DIR") or Path.home() / ".local/state/phalanx")
