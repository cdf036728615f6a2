"""Running an agent whose jobs run as users of their own (``agent.job_uids``) in a test.

The agent must be root, and the interpreter must be reachable by the jobs' users. On
these VMs it is not: Python lives under ``/root`` (mode 0700). :func:`reachable` runs a
command in a mount namespace of its own where the folder that blocks the way is a
world-readable tmpfs holding only the bind-mounted path to the interpreter (the rest of
that folder is hidden, not opened up); nothing outside the namespace changes.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

#: The uids the tests' agents give jobs.
JOB_UIDS = "43000-43099"


def _blocked() -> tuple[Path, Path] | None:
    """The first folder on the way to the interpreter that others cannot enter, and its
    child on that way; None if there is none."""
    for target in (Path(sys.base_prefix).resolve(), Path(sys.executable).resolve()):
        for folder in reversed(target.parents):
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return folder, folder / target.relative_to(folder).parts[0]
    return None


_SCRIPT = ('set -e; hold=$(mktemp -d); mount --bind "$1" "$hold"; '
           'mount -t tmpfs -o mode=755 tmpfs "$2"; mkdir -p "$1"; mount --move "$hold" "$1"; '
           'rmdir "$hold"; shift 2; exec "$@"')


def reachable(command: list[str]) -> list[str]:
    """``command`` run where a job's user can run this interpreter (see the module
    docstring); skips the test where that cannot be arranged (not root, no ``unshare``)."""
    if os.geteuid() != 0:
        pytest.skip("running jobs as users of their own needs root")
    blocked = _blocked()
    if blocked is None:
        return command
    if shutil.which("unshare") is None:
        pytest.skip(f"{blocked[0]} keeps the interpreter from other users, and there is "
                    "no unshare to open a way to it")
    folder, needed = blocked
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _SCRIPT,
            "reachable", str(needed), str(folder), *command]
