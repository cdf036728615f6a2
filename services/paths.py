"""Where phalanx keeps local state, and which local cluster the commands talk to.

The state dir is ``$PHALANX_STATE_DIR``, else ``$XDG_STATE_HOME/phalanx``, else
``~/.local/state/phalanx``; the default data dir is ``$PHALANX_DATA_DIR``, else the
state dir. ``phalanx up --data-dir X`` leaves a pointer to ``X`` in the state dir
(:func:`remember_cluster`) and ``phalanx down`` removes it (:func:`forget_cluster`), so
the commands after ``up`` find its cluster without ``--data-dir X`` again
(:func:`remembered_cluster`). The pointer is one path; the last ``up`` wins. Tests set
``PHALANX_STATE_DIR`` so they never touch the user's own.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from phalanx.schemas import settings

#: The pointer's file name in the state dir: the data dir of the cluster ``up`` started.
POINTER = "current-cluster"


def state_dir() -> Path:
    if explicit := os.environ.get(settings.STATE_DIR):
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local/state") / "phalanx"


def default_data_dir() -> Path:
    return Path(os.environ.get(settings.DATA_DIR) or state_dir())


def remember_cluster(data_dir: Path) -> None:
    """Record ``data_dir`` as the local cluster's (written whole or not at all)."""
    root = state_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{POINTER}.{os.getpid()}.tmp"
    tmp.write_text(str(data_dir.resolve()) + "\n")
    tmp.replace(root / POINTER)


def remembered_cluster() -> Path | None:
    """The data dir the last ``phalanx up`` recorded, or None (none, or unreadable)."""
    try:
        text = (state_dir() / POINTER).read_text().strip()
    except OSError:
        return None
    return Path(text) if text else None


def forget_cluster(data_dir: Path) -> None:
    """Remove the pointer if it is to ``data_dir`` (another ``up`` may have taken it)."""
    if remembered_cluster() == data_dir.resolve():
        with contextlib.suppress(FileNotFoundError):
            (state_dir() / POINTER).unlink()
