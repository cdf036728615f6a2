"""The tables the command line draws: ``phalanx nodes`` (also ``up``'s status and ``top``'s
nodes panel), and the columns no narrow terminal cuts that ``phalanx jobs`` and ``top``
share (a job id cut short can read as another job's, a step cut as another number).

Kept apart from :mod:`phalanx.services.cli` and :mod:`phalanx.services.top` so that both
draw the same tables without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phalanx.schemas.messages import ReplicaRange
from phalanx.schemas.registry import NodeView


def step_cell(step: int | None, total: int | None, reached: int | None = None) -> str:
    """A job's step as ``phalanx jobs`` and ``top`` show it: ``step/total``, ``step`` while
    the total is unknown, ``-`` before any progress; then, while an admission has not
    caught up with the most steps an earlier one committed, ``(reached N)``: a job
    coming back from an outage is at 0 in its new admission, not at step 0."""
    if step is None:
        return "-"
    return str(step) + (f"/{total}" if total else "") + (
        f" (reached {reached})" if reached is not None and reached > step else "")


def size_cell(size: int, replicas: ReplicaRange) -> str:
    """A job's size now, then its spec's ``(min..max)``."""
    return f"{size} ({replicas.min}..{replicas.max})"


def print_whole(table: Table, console: Console | None = None) -> None:
    """Print ``table`` at least as wide as its columns' minimum widths: where the terminal
    is narrower, its lines wrap (as ``kubectl get``'s do) rather than lose their ends."""
    console = console or Console()
    needed = console.measure(table, options=console.options.update_width(10_000)).minimum
    if needed > console.width:
        console.width = needed  # the console is the command's own, used for this table
    console.print(table)


def whole_columns(table: Table, titles: Iterable[str], rows: Sequence[Sequence[str]],
                  wrapping: Iterable[str] = ()) -> None:
    """Add ``titles`` as columns no narrow terminal cuts, and ``rows`` of their cells: each
    as wide as its widest cell; those named in ``wrapping`` (lists of names) wrap between
    names, as wide as the longest name."""
    wrapping = set(wrapping)
    for i, title in enumerate(titles):
        cells = [row[i] for row in rows]
        words = [w for c in cells for w in c.split()] if title in wrapping else cells
        table.add_column(title, no_wrap=title not in wrapping,
                         min_width=max([len(title), *map(len, words)]))
    for row in rows:
        table.add_row(*row)


def node_table(nodes: Iterable[NodeView]) -> Table:
    """The registry's nodes as ``phalanx nodes`` shows them: state (red when lost or
    cordoned), slots used of total, failure domain, heartbeat age, host and agent pid;
    where any node has them, its GPUs and its cordoned slots with the reason of each."""
    nodes = list(nodes)
    gpus = any(n.gpus for n in nodes)
    cordons = any(n.cordoned_slots for n in nodes)
    table = Table(title="phalanx nodes")
    for column in ("node", "state", "slots (used/total)", "domain", "heartbeat", "host", "pid",
                   *(["gpus"] if gpus else []), *(["cordoned slots"] if cordons else [])):
        table.add_column(column)
    for n in nodes:
        state = n.state.value + (" (cordoned)" if n.cordoned else "")
        color = "green" if n.state.value == "alive" and not n.cordoned else "red"
        extra = []
        if gpus:
            names = sorted({g.name for g in n.gpus})
            extra.append(f"{len(n.gpus)} x {', '.join(names)}" if n.gpus else "-")
        if cordons:
            extra.append("\n".join(f"[red]{slot}[/]: {escape(why)}"
                                   for slot, why in sorted(n.cordoned_slots.items())) or "-")
        table.add_row(n.node_id, f"[{color}]{state}[/]", f"{n.slots_used}/{n.slots}",
                      n.failure_domain, f"{n.heartbeat_age_s:.1f} s ago", n.host,
                      str(n.agent_pid), *extra)
    return table
