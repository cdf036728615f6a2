"""``bench/RESULTS.md``: where every benchmark appends its section, and how it dates them."""

from __future__ import annotations

import datetime as dt
import shlex
from collections.abc import Sequence
from pathlib import Path

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
RESULTS_HEADER = """\
# Benchmark results

Figures appended by the benchmark scripts in `bench/` (each run adds one
section unless given `--no-record`); newest at the bottom. Compare runs on the
same machine only.

Machine: 2 cores, no GPU.
"""


def utc_date() -> str:
    """Now in the format of ``date -u``."""
    now = dt.datetime.now(dt.UTC)
    return f"{now:%a %b} {now.day:2d} {now:%H:%M:%S} UTC {now.year}"


def append(section: str, path: Path = RESULTS_PATH) -> None:
    """Append ``section`` to ``path``, creating the file with its header if needed."""
    text = "" if path.exists() else RESULTS_HEADER
    with path.open("a", encoding="utf-8") as f:
        f.write(text + section)


def command_line(script: str, argv: Sequence[str]) -> str:
    """How to run ``bench/<script>`` with ``argv`` again, as a section records it."""
    return shlex.join([".venv/bin/python", f"bench/{script}", *argv])
