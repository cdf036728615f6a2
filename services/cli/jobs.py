"""``phalanx submit``, ``jobs``, ``job``, ``scale``, ``explain`` and ``cancel``: jobs
through admission's API, and what ``jobs`` and ``job`` print of them (pure functions of
what the bus holds: a job's record, generations, progress and history).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from phalanx.services.cli.auth import admit_job
from phalanx.services.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    Parents,
    Subparsers,
    msgspec_to_builtins,
    with_client,
)

if TYPE_CHECKING:
    from rich.table import Table

    from phalanx.schemas.messages import (
        Generation,
        GenerationRecord,
        JobHistory,
        JobProgress,
        JobRecord,
        JobSpec,
    )
    from phalanx.services.client import AdmissionClient

#: A ``--json`` object: what the command prints, and what its text is made from.
Row = dict[str, Any]


def record_row(record: JobRecord) -> Row:
    """A job's record as ``phalanx submit``, ``jobs`` and ``job`` give it with ``--json``."""
    return {"job_id": record.job_id, "state": record.state.value, "team": record.spec.team,
            "priority_class": record.spec.priority_class,
            "replicas": 0 if record.state.terminal else len(record.nodes),
            "slots_per_replica": record.spec.slots_per_replica,
            "ranks_per_replica": record.spec.ranks_per_replica, "nodes": list(record.nodes),
            "reason_code": record.reason_code.value, "reason": record.reason,
            "submitted_at": record.submitted_at, "updated_at": record.updated_at}


def cmd_submit(args: argparse.Namespace) -> int:
    import msgspec

    from phalanx.services.client import load_job_spec, new_job_id

    spec = load_job_spec(args.file)
    if args.resume:  # start from the newest durable step of an earlier job
        spec = msgspec.structs.replace(spec, checkpoint=msgspec.structs.replace(
            spec.checkpoint, resume_from=args.resume))
    job_id = args.job_id or new_job_id(spec.name)
    asyncio.run(admit_job(args, job_id))
    record = asyncio.run(with_client(args, lambda c: c.submit(spec, job_id)))
    if args.json:
        print(json.dumps(record_row(record), indent=2))
    else:
        print(f"submitted {record.job_id} ({record.state.value})")
    return 0


def progress_fields(progress: JobProgress | None, record: JobRecord) -> Row:
    """What health stored of a job's progress (``phalanx_progress``), as ``phalanx job``
    shows it; the ETA only while it runs and the rate and total are known."""
    if progress is None:
        return {}
    rate, total = progress.steps_per_s, progress.total_steps
    eta = (total - progress.step) / rate if (rate and total and record.state.value == "admitted"
                                             and total >= progress.step) else None
    return {"step": progress.step, "reached": progress.reached_step(),
            "total_steps": total,
            "steps_per_s": None if rate is None else round(rate, 3),
            "eta_s": None if eta is None else round(eta, 1),
            "restarts": progress.restarts, "app_failures": progress.app_failures,
            "progress_at": progress.updated_at}


def _size(record: JobRecord, generation: Generation | None) -> int:
    """The job's size now: its generation's world size under the runtime, else its
    placement's replica count."""
    if generation is not None and not record.state.terminal:
        return generation.world_size
    return len(record.nodes)


def cmd_jobs(args: argparse.Namespace) -> int:
    from rich.console import Console

    from phalanx.services.tables import print_whole

    async def read(client: AdmissionClient) -> tuple[list[JobRecord], dict[str, Generation],
                                                     dict[str, JobProgress]]:
        return await asyncio.gather(client.jobs(), client.generations(), client.all_progress())

    records, generations, progress = asyncio.run(with_client(args, read))
    rows: list[Row] = []
    for r in records:
        p = progress.get(r.job_id)
        rows.append({**record_row(r), "size": _size(r, generations.get(r.job_id)),
                     "step": None if p is None else p.step,
                     "total_steps": None if p is None else p.total_steps,
                     "reached": None if p is None else p.reached_step()})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = jobs_table(records, rows)
    if any(r.state.value == "pending" for r in records):
        Console().print("`phalanx explain JOB` says why a job waits and where it stands.")
    print_whole(table)
    return 0


def _group_text(spec: JobSpec) -> str:
    """What one replica is, after its count in the size column: nothing for one rank of
    one slot, else its ranks and each rank's slots."""
    ranks = f" x {spec.ranks_per_replica} ranks" if spec.ranks_per_replica > 1 else ""
    slots = f" x {spec.slots_per_replica} slots" if spec.slots_per_replica > 1 else ""
    return ranks + slots


def jobs_table(records: list[JobRecord], rows: list[Row]) -> Table:
    """``phalanx jobs``'s table of ``records``, with their ``rows`` as ``--json`` gives
    them (``size``: now, then the spec's min..max). Nothing is cut in a narrow terminal:
    every cell keeps its width but the nodes', which wraps between names."""
    from rich import box
    from rich.table import Table

    from phalanx.services.tables import size_cell, step_cell, whole_columns

    cells = [(r.job_id, _state_cell(r), r.spec.team, r.spec.priority_class,
              size_cell(row["size"], r.spec.replicas) + _group_text(r.spec),
              step_cell(row["step"], row["total_steps"], row.get("reached")),
              " ".join(sorted(set(r.nodes))) or "-")
             for r, row in zip(records, rows, strict=True)]
    # Without vertical rules: 7 columns of lines cost a tenth of 80 columns.
    table = Table(title="phalanx jobs", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0))
    whole_columns(table, ("job", "state", "team", "priority", "size", "step", "nodes"), cells,
                  wrapping=("nodes",))
    return table


def _state_cell(record: JobRecord) -> str:
    """The state, with the reason's code where it says more (pending, failed, cancelled)."""
    state, code = record.state.value, record.reason_code.value
    return state if code in ("admitted", state) else f"{state} ({code})"


def cmd_job(args: argparse.Namespace) -> int:
    async def read(client: AdmissionClient) -> tuple[JobRecord | None, Generation | None,
                                                     JobProgress | None, JobHistory | None]:
        return await asyncio.gather(client.job(args.job), client.generation(args.job),
                                    client.progress(args.job), client.history(args.job))

    record, generation, progress, history = asyncio.run(with_client(args, read))
    if record is None:
        print(f"phalanx job: no job {args.job!r}", file=sys.stderr)
        return EXIT_FAILED
    row = record_row(record)
    replicas = record.spec.replicas
    row.update(min=replicas.min, max=replicas.max,
               restart_policy=msgspec_to_builtins(record.spec.restart_policy),
               # 2 and up: requeued and admitted again (its history lists the earlier ones).
               admission=record.admission or None)
    generations = [] if history is None else history_rows(history.generations)
    if generation is not None and not record.state.terminal:
        # The elasticity service's current membership: who trains now, from which step
        # (the members' own report of it once one has come).
        current = next((g for g in generations if g["generation"] == generation.generation),
                       None)
        row.update(world_size=generation.world_size, generation=generation.generation,
                   resume_step=generation.resume_step if current is None
                   else current["resume_step"],
                   generation_reason=generation.reason.value, generation_cause=generation.cause,
                   members=[m.replica_id for m in generation.members])
    row.update(progress_fields(progress, record))
    if history is not None:
        row.update(replacements=history.replacements, history=generations,
                   earlier_history=history_rows(history.earlier))
    row.update(_scaling_fields(record))
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print("\n".join(job_lines(row, time.time())))
    return 0


def job_lines(row: Row, now: float) -> list[str]:
    """``phalanx job``'s text for its ``--json`` object ``row``: the record's fields (the
    job id first), then the scaling rules, then the history: the earlier admissions',
    each ended by a requeue, then the current one's."""
    row = dict(row)
    earlier = row.pop("earlier_history", [])
    generations = row.pop("history", [])
    scaling = row.pop("scaling", None)
    lines = [f"{key:>18}: {shown(key, value, now)}" for key, value in row.items()
             if value is not None]
    lines += _scaling_lines(scaling, now)
    if generations or earlier:
        lines.append(f"{'history':>18}:")
        start = (earlier or generations)[0]["decided_at"]
        shown_lines: list[str] = []
        for admission in admissions(earlier):
            shown_lines += history_lines(admission, start, requeued=True)
            shown_lines.append("requeued, then admitted again:")
        shown_lines += history_lines(generations, start)
        lines += [f"{'':>20}{line}" for line in shown_lines]
    return lines


#: The ``--json`` fields that are Unix times: ``phalanx job`` shows them as local times.
TIME_FIELDS = ("submitted_at", "updated_at", "progress_at")


def shown(key: str, value: object, now: float) -> str:
    """A ``--json`` field's value as ``phalanx job`` prints it: a time as the local time
    and how long ago, a list comma-separated, an object as its ``key value`` pairs, the
    lines after a text's first indented under it."""
    if key in TIME_FIELDS and isinstance(value, int | float):
        return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(value))} " \
            f"({duration(now - value)} ago)"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in value.items())
    return str(value).replace("\n", "\n" + " " * 20)  # a failed rank's output, indented


def duration(seconds: float) -> str:
    """``seconds`` as people read a span: "4.2 s", "3 min 20 s", "2 h 5 min"."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


#: Where a history entry's ``resume_step`` comes from: the members' own report of the
#: step they resumed after, or (none reported yet) elasticity's estimate when it decided.
RESUME_REPORTED, RESUME_ESTIMATED = "members", "elasticity"


#: How ``phalanx job`` names where a generation's state came from (``StateSource``).
STATE_SOURCES = {"memory": "the nodes' memory", "buddy": "the nodes' and buddies' memory",
                 "durable": "durable storage",
                 "older": "an older step (the step reached was lost)",
                 "start": "the start (the job's state was lost)"}


def history_rows(generations: list[GenerationRecord]) -> list[Row]:
    """A job's generations as ``phalanx job`` shows them: ``resume_step`` is the step the
    members resumed after as they reported it, else elasticity's estimate, and
    ``resume_source`` says which (``decided_resume_step`` keeps the estimate)."""
    rows: list[Row] = []
    for g in generations:
        row: Row = msgspec_to_builtins(g)
        applied = row.pop("applied_resume_step", None)
        row.update(decided_resume_step=g.resume_step,
                   resume_step=g.resume_step if applied is None else applied,
                   resume_source=RESUME_ESTIMATED if applied is None else RESUME_REPORTED)
        rows.append(row)
    return rows


def admissions(rows: list[Row]) -> list[list[Row]]:
    """``rows`` of several admissions, split where one starts (its generation 0)."""
    split: list[list[Row]] = []
    for row in rows:
        if not split or (row["generation"] == 0 and row["reason"] == "start"):
            split.append([])
        split[-1].append(row)
    return split


def history_lines(rows: list[Row], start: float | None = None, *,
                  requeued: bool = False) -> list[str]:
    """One line per generation of :func:`history_rows` (of one admission; ``requeued``:
    one that a requeue ended), times relative to ``start`` (default: the first's)."""
    if start is None:
        start = rows[0]["decided_at"] if rows else 0.0
    lines = []
    for g, after in zip(rows, [*rows[1:], None], strict=True):
        pause = "" if g["pause_s"] is None else f", paused the survivors {g['pause_s']:.2f} s"
        if g["resume_source"] == RESUME_REPORTED and g["resume_step"] == 0 \
                and g.get("restored_from") in (None, "members"):
            resume = "from the first step"
        elif g["resume_source"] == RESUME_REPORTED:
            resume = f"resumed after step {g['resume_step']} (its members' report)"
            if g.get("restored_from") not in (None, "members"):
                resume += f", state from {STATE_SOURCES[g['restored_from']]}"
                again = g["decided_resume_step"] - g["resume_step"]
                if again > 0:  # decided at the step the job had reached, as elasticity knew it
                    resume += (f", {again} step(s) trained again (the job had reached step "
                               f"{g['decided_resume_step']})")
        elif after is not None:  # its estimate would read as where the job was
            resume = f"never applied (g{after['generation']} replaced it first)"
        elif requeued:
            resume = "never applied (the job was requeued first)"
        else:
            resume = (f"resume after step {g['resume_step']} (elasticity's estimate; no "
                      "member has reported applying it yet)")
        lines.append(f"g{g['generation']} +{g['decided_at'] - start:.1f} s {g['reason']}: "
                     f"{g['world_size']} rank(s), {resume}{pause} ({g['cause']})")
    return lines


def _scaling_fields(record: JobRecord) -> Row:
    """An elastic job's scaling rules in force, its pin and the planned size change in
    progress (all from the job record), as ``phalanx job`` shows them; nothing for a
    rigid job."""
    from phalanx.schemas.scaling import ScalingRules

    spec = record.spec
    if spec.replicas.min == spec.replicas.max:
        return {}
    change = record.scaling_change
    return {"scaling": {
        "sizes": list(ScalingRules.of(spec).sizes),
        "scale_up_cooldown_s": spec.scaling.scale_up_cooldown_s,
        "graceful_shutdown_timeout_s": spec.scaling.graceful_shutdown_timeout_s,
        "scaling_timeout_s": spec.scaling.scaling_timeout_s,
        "pinned_replicas": record.pinned_replicas,
        "change": None if change is None or record.state.terminal
        else msgspec_to_builtins(change)}}


def _scaling_lines(scaling: Row | None, now: float) -> list[str]:
    if scaling is None:
        return []
    lines = [f"{'scaling':>18}: sizes {', '.join(map(str, scaling['sizes']))}; growth "
             f"cooldown {scaling['scale_up_cooldown_s']:g} s; a leaver has "
             f"{scaling['graceful_shutdown_timeout_s']:g} s; a change "
             f"{scaling['scaling_timeout_s']:g} s"]
    pinned = scaling["pinned_replicas"]
    lines.append(f"{'pinned':>18}: " + (
        "no (admission sizes it; phalanx scale JOB --replicas N pins)" if pinned is None
        else f"{pinned} replica(s)"))
    change = scaling["change"]
    if change is not None:
        verb = "growing" if change["kind"] == "grow" else "shrinking"
        left = change["deadline"] - now
        lines.append(f"{'scaling now':>18}: {verb} {change['from_replicas']} -> "
                     f"{change['to_replicas']} ({change['reason']}); deadline in {left:.0f} s "
                     f"({time.strftime('%H:%M:%S', time.localtime(change['deadline']))})")
    return lines


def cmd_scale(args: argparse.Namespace) -> int:
    replicas = None if args.auto else args.replicas
    if replicas is not None and replicas < 1:
        print(f"phalanx scale: --replicas must be at least 1, got {replicas}", file=sys.stderr)
        return EXIT_USAGE
    record = asyncio.run(with_client(args, lambda c: c.scale(args.job, replicas)))
    if replicas is None:
        print(f"{record.job_id}: pin released; admission sizes it "
              f"({len(record.nodes)} replica(s) now)")
    else:
        print(f"{record.job_id}: pinned to {replicas} replica(s) ({len(record.nodes)} now; "
              "growth waits for free slots, a shrink lets the leavers finish their step)")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    explanation = asyncio.run(with_client(args, lambda c: c.explain(args.job)))
    if args.json:
        print(json.dumps(msgspec_to_builtins(explanation), indent=2))
        return 0
    # A pending job's reason ends with (or, queued, starts with) its queue position.
    print(f"{explanation.job_id}: {explanation.state.value}")
    print(f"  {explanation.reason_code.value}: {explanation.reason}")
    if explanation.nodes:
        print(f"  nodes: {', '.join(explanation.nodes)}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    record = asyncio.run(with_client(args, lambda c: c.cancel(args.job)))
    print(f"{record.job_id}: {record.state.value}")
    return 0


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    submit = sub.add_parser("submit", parents=[parents.common], help="submit a job spec (YAML)")
    submit.add_argument("file")
    submit.add_argument("--job-id", help="job id (default: <name>-<random>)")
    submit.add_argument("--resume", metavar="JOB",
                        help="start from JOB's newest durable checkpoint (sets the spec's "
                             "checkpoint.resume_from)")
    submit.add_argument("--json", action="store_true")
    submit.set_defaults(func=cmd_submit)

    jobs = sub.add_parser("jobs", parents=[parents.common], help="list jobs")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=cmd_jobs)

    for name, func, text in (("job", cmd_job, "show one job"),
                             ("explain", cmd_explain, "why a job waits, and where it stands"),
                             ("cancel", cmd_cancel, "cancel a job")):
        command = sub.add_parser(name, parents=[parents.common], help=text)
        command.add_argument("job")
        if name != "cancel":
            command.add_argument("--json", action="store_true")
        command.set_defaults(func=func)

    scale = sub.add_parser("scale", parents=[parents.common],
                           help="pin an elastic job's size, or release the pin")
    scale.add_argument("job")
    size = scale.add_mutually_exclusive_group(required=True)
    size.add_argument("--replicas", type=int, metavar="N",
                      help="pin it to N replicas (one of its allowed sizes)")
    size.add_argument("--auto", action="store_true",
                      help="release the pin: admission sizes it again")
    scale.set_defaults(func=cmd_scale)
