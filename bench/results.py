"""``bench/RESULTS.md``: where every benchmark appends its section, how it dates them, and how
it ends (its report recorded and printed)."""

from __future__ import annotations

import datetime as dt
import json
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


def finish(report: dict[str, Any], record: Callable[[dict[str, Any]], None], *,
           no_record: bool) -> int:
    """The end of a benchmark: ``record(report)`` (its section here) unless ``no_record``,
    the report printed as one JSON object on the last line, and the exit status: 0 when
    ``report["pass"]``."""
    if not no_record:
        record(report)
    print(json.dumps(report))
    return 0 if report["pass"] else 1
