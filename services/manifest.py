"""The rank manifest: where a node agent records the rank processes it runs.

An agent keeps ``<work_dir>/ranks.json`` (:data:`MANIFEST`) up to date with every
rank it started, each with its process id and start time in clock ticks
(:func:`start_ticks`), so that a process found later under that pid is known to be the
same one, not a reuse. A restarted agent adopts its ranks from it
(:mod:`phalanx.services.agent.ranks`, which writes it); ``phalanx down`` sweeps the
ranks of a stopped local cluster with it (:mod:`phalanx.services.cluster`). Both read
the file through this module, so neither reaches into the other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The manifest's file name in an agent's work directory.
MANIFEST = "ranks.json"


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid's reuse apart);
    None when no such process runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def running_in_manifest(path: Path) -> list[dict[str, Any]]:
    """The running ranks a manifest records (empty if it cannot be read), for sweepers."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return list(data.get("ranks", [])) if isinstance(data, dict) else list(data)
