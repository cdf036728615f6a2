"""The ``phalanx`` command line.

``phalanx up`` runs a local cluster (embedded NATS + agents), ``phalanx down``
stops a detached one, ``phalanx nodes`` lists the registry, ``phalanx agent``
runs one node agent (what ``up`` starts per node, and what a real machine
runs). Commands that talk to the bus find it through ``--nats``, then
``PHALANX_NATS_URL``, then the cluster ``up`` recorded in the data dir, then
``nats://127.0.0.1:4222``. The data dir is ``--data-dir``, else
``$PHALANX_DATA_DIR``, else the one the last ``phalanx up`` left a pointer to
(:mod:`phalanx.services.paths`), else the state dir. Exit codes: 0 ok, 1 failed, 2
bad usage or input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from phalanx.schemas import __version__
from phalanx.schemas.errors import PhalanxError
from phalanx.services.deadline import wait_set

EXIT_FAILED = 1
EXIT_USAGE = 2


def _bus_config(args: argparse.Namespace):
    from phalanx.bus.config import CREDENTIAL_VARS, BusConfig
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role
    from phalanx.services.cluster import ClusterState

    url = args.nats
    env = dict(os.environ)
    if url is None and not os.environ.get("PHALANX_NATS_URL"):
        state = ClusterState.read(Path(args.data_dir))
        url = state.nats_url if state else None
        if state is not None and not env.get("PHALANX_NATS_REPLICAS"):
            env["PHALANX_NATS_REPLICAS"] = str(state.nats_replicas)
        if state is not None and state.auth_dir is not None:
            # A secured local cluster: the operator's identity, unless the environment
            # names another (a viewer's, say).
            auth = AuthDir(state.auth_dir)
            env.setdefault("PHALANX_NATS_CA", str(auth.ca_path))
            if not CREDENTIAL_VARS & env.keys():
                env.update(auth.env(Role.CLI))
    return BusConfig.load(args.config, env=env, servers=url)  # comma-separated URLs


# --- auth ----------------------------------------------------------------------------------


def cmd_auth(args: argparse.Namespace) -> int:
    """Make an auth directory, or add a node's or a job's identity to one. Prints names,
    public keys and paths; never a seed."""
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role

    if args.action == "init":
        auth = AuthDir.init(args.dir, nodes=args.node, hosts=args.host)
        print(f"made {auth.root}: server config {auth.config_path}, CA {auth.ca_path}")
        for who in auth.identities():
            print(f"  {who.name:<24} {who.public_key}  {auth.seed_path(who.role, who.scope)}")
        print("start nats-server with `-c` that config; point each process at its identity "
              "with PHALANX_NATS_NKEY, PHALANX_NATS_INBOX_PREFIX and PHALANX_NATS_CA "
              "(docs/security.md)")
        return 0
    role = Role.AGENT if args.action == "add-node" else Role.RANK
    auth = AuthDir(args.dir)
    who, made = auth.add(role, args.id)
    seed = auth.seed_path(role, args.id)
    if made:
        print(f"made {who.name} ({who.public_key}), seed {seed}; have nats-server reload its "
              f"config (SIGHUP) to admit it")
    else:
        print(f"{who.name} exists ({who.public_key}), seed {seed}")
    return 0


async def _admit_job(args: argparse.Namespace, job_id: str, timeout_s: float = 10.0) -> None:
    """On a secured local cluster, make the job's identity before its ranks need it: the
    server reloads its config, and this returns once it admits the job's identity."""
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig, with_identity
    from phalanx.bus.errors import BusUnavailable
    from phalanx.services.auth.issuer import AuthDir
    from phalanx.services.auth.roles import Role
    from phalanx.services.cluster import ClusterState
    from phalanx.services.natsd import reload_config

    state = ClusterState.read(Path(args.data_dir))
    if args.nats or state is None or state.auth_dir is None or state.nats_pid is None:
        return
    auth = AuthDir(state.auth_dir)
    _, made = auth.add(Role.RANK, job_id)
    if not made:
        return
    reload_config(state.nats_pid)
    config = BusConfig.load(env=with_identity(os.environ, auth.env(Role.RANK, job_id)),
                            servers=[state.nats_url], connect_timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    while True:  # each attempt is bounded by the connect timeout
        try:
            await (await Bus.connect(config, name="phalanx-cli")).close()
            return
        except BusUnavailable:
            if time.monotonic() > deadline:
                raise


# --- agent ---------------------------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    from phalanx.services.agent.config import AgentConfig
    from phalanx.services.agent.service import AgentService
    from phalanx.services.base import run_service
    from phalanx.services.logs import configure_logging

    config = AgentConfig.from_env(
        node_id=args.node_id, slots=args.slots, failure_domain=args.failure_domain,
        labels=args.labels, heartbeat_interval_s=args.heartbeat_interval,
        lost_after_s=args.lost_after, work_dir=args.work_dir)
    if config.work_dir is None:
        config = dataclasses.replace(
            config, work_dir=str(Path(args.data_dir) / "agents" / config.node_id))
    configure_logging("phalanx-agent", config.node_id, args.log_level)
    return run_service(AgentService(config, _bus_config(args)))


def cmd_admission(args: argparse.Namespace) -> int:
    from phalanx.services.admission.config import AdmissionConfig
    from phalanx.services.admission.service import AdmissionService
    from phalanx.services.base import run_service
    from phalanx.services.logs import configure_logging

    config = AdmissionConfig.load(args.config)
    service = AdmissionService(config, _bus_config(args), instance=args.instance)
    configure_logging("phalanx-admission", service.instance, args.log_level)
    return run_service(service)


# --- jobs ----------------------------------------------------------------------------------


async def _with_client(args: argparse.Namespace, action):
    from phalanx.bus.client import Bus
    from phalanx.services.client import AdmissionClient

    async with await Bus.connect(_bus_config(args), name="phalanx-cli") as bus:
        return await action(AdmissionClient(bus))


def _record_row(record) -> dict:
    return {"job_id": record.job_id, "state": record.state.value, "team": record.spec.team,
            "priority_class": record.spec.priority_class,
            "replicas": 0 if record.state.terminal else len(record.nodes),
            "slots_per_replica": record.spec.slots_per_replica, "nodes": list(record.nodes),
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
    asyncio.run(_admit_job(args, job_id))
    record = asyncio.run(_with_client(args, lambda c: c.submit(spec, job_id)))
    if args.json:
        print(json.dumps(_record_row(record), indent=2))
    else:
        print(f"submitted {record.job_id} ({record.state.value})")
    return 0


def _progress_fields(progress, record) -> dict:
    """What health stored of a job's progress (``phalanx_progress``), as ``phalanx job``
    shows it; the ETA only while it runs and the rate and total are known."""
    if progress is None:
        return {}
    rate, total = progress.steps_per_s, progress.total_steps
    eta = (total - progress.step) / rate if (rate and total and record.state.value == "admitted"
                                             and total >= progress.step) else None
    return {"step": progress.step, "total_steps": total,
            "steps_per_s": None if rate is None else round(rate, 3),
            "eta_s": None if eta is None else round(eta, 1),
            "restarts": progress.restarts, "app_failures": progress.app_failures,
            "progress_at": progress.updated_at}


def _size(record, generation) -> int:
    """The job's size now: its generation's world size under the runtime, else its
    placement's replica count."""
    if generation is not None and not record.state.terminal:
        return generation.world_size
    return len(record.nodes)


def cmd_jobs(args: argparse.Namespace) -> int:
    from rich.console import Console

    async def read(client):
        return await asyncio.gather(client.jobs(), client.generations(), client.all_progress())

    records, generations, progress = asyncio.run(_with_client(args, read))
    rows = []
    for r in records:
        p = progress.get(r.job_id)
        rows.append({**_record_row(r), "size": _size(r, generations.get(r.job_id)),
                     "step": None if p is None else p.step,
                     "total_steps": None if p is None else p.total_steps})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = jobs_table(records, rows)
    if any(r.state.value == "pending" for r in records):
        Console().print("`phalanx explain JOB` says why a job waits and where it stands.")
    Console().print(table)
    return 0


def jobs_table(records: list, rows: list[dict]):
    """``phalanx jobs``'s table of ``records``, with their ``rows`` as ``--json`` gives
    them."""
    from rich.table import Table

    table = Table(title="phalanx jobs")
    id_column(table, "job", [r.job_id for r in records])
    for column in ("state", "team", "priority", "size (min..max) x slots", "step", "nodes",
                   "why"):
        table.add_column(column)
    for r, row in zip(records, rows, strict=True):
        replicas = r.spec.replicas
        step = "-" if row["step"] is None else str(row["step"]) + (
            f"/{row['total_steps']}" if row["total_steps"] else "")
        table.add_row(r.job_id, r.state.value, r.spec.team, r.spec.priority_class,
                      f"{row['size']} ({replicas.min}..{replicas.max}) x "
                      f"{r.spec.slots_per_replica}", step,
                      ",".join(sorted(set(r.nodes))) or "-",
                      "" if r.state.value == "admitted" else r.reason_code.value)
    return table


def id_column(table, title: str, ids: list[str]) -> None:
    """Add ``table``'s id column: as wide as its longest id and never wrapped or cut, so
    two ids never look the same however narrow the terminal (other columns give way)."""
    table.add_column(title, no_wrap=True, min_width=max([len(title), *map(len, ids)]))


def cmd_job(args: argparse.Namespace) -> int:
    async def read(client):
        return await asyncio.gather(client.job(args.job), client.generation(args.job),
                                    client.progress(args.job), client.history(args.job))

    record, generation, progress, history = asyncio.run(_with_client(args, read))
    if record is None:
        print(f"phalanx job: no job {args.job!r}", file=sys.stderr)
        return EXIT_FAILED
    row = _record_row(record)
    replicas = record.spec.replicas
    row.update(min=replicas.min, max=replicas.max,
               restart_policy=msgspec_to_builtins(record.spec.restart_policy))
    generations = [] if history is None else history_rows(history)
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
    row.update(_progress_fields(progress, record))
    if history is not None:
        row.update(replacements=history.replacements, history=generations)
    row.update(_scaling_fields(record))
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print("\n".join(job_lines(row, time.time())))
    return 0


def job_lines(row: dict, now: float) -> list[str]:
    """``phalanx job``'s text for its ``--json`` object ``row``: the record's fields (the
    job id first), then the scaling rules, then the history."""
    row = dict(row)
    generations = row.pop("history", [])
    scaling = row.pop("scaling", None)
    lines = [f"{key:>18}: {value}" for key, value in row.items()]
    lines += _scaling_lines(scaling, now)
    if generations:
        lines.append(f"{'history':>18}:")
        lines += [f"{'':>20}{line}" for line in history_lines(generations)]
    return lines


#: Where a history entry's ``resume_step`` comes from: the members' own report of the
#: step they resumed after, or (none reported yet) elasticity's estimate when it decided.
RESUME_REPORTED, RESUME_ESTIMATED = "members", "elasticity"


#: How ``phalanx job`` names where a generation's state came from (``StateSource``).
STATE_SOURCES = {"memory": "the nodes' memory", "buddy": "the nodes' and buddies' memory",
                 "durable": "durable storage",
                 "older": "an older step (the step reached was lost)",
                 "start": "the start (the job's state was lost)"}


def history_rows(history) -> list[dict]:
    """A job's generations as ``phalanx job`` shows them: ``resume_step`` is the step the
    members resumed after as they reported it, else elasticity's estimate, and
    ``resume_source`` says which (``decided_resume_step`` keeps the estimate)."""
    rows = []
    for g in history.generations:
        row = msgspec_to_builtins(g)
        applied = row.pop("applied_resume_step", None)
        row.update(decided_resume_step=g.resume_step,
                   resume_step=g.resume_step if applied is None else applied,
                   resume_source=RESUME_ESTIMATED if applied is None else RESUME_REPORTED)
        rows.append(row)
    return rows


def history_lines(rows: list[dict]) -> list[str]:
    """One line per generation of :func:`history_rows`, times relative to the first."""
    start = rows[0]["decided_at"] if rows else 0.0
    lines = []
    for g in rows:
        pause = "" if g["pause_s"] is None else f", paused the survivors {g['pause_s']:.2f} s"
        if g["resume_source"] == RESUME_REPORTED:
            resume = f"resumed after step {g['resume_step']} (its members' report)"
            if g.get("restored_from") not in (None, "members"):
                resume += f", state from {STATE_SOURCES[g['restored_from']]}"
        else:
            resume = (f"resume after step {g['resume_step']} (elasticity's estimate; no "
                      "member reported applying it)")
        lines.append(f"g{g['generation']} +{g['decided_at'] - start:.1f} s {g['reason']}: "
                     f"{g['world_size']} rank(s), {resume}{pause} ({g['cause']})")
    return lines


def _scaling_fields(record) -> dict:
    """An elastic job's scaling rules in force, its pin and the planned size change in
    progress (all from the job record), as ``phalanx job`` shows them; nothing for a
    rigid job."""
    from phalanx.services.admission.scaling import ScalingRules

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


def _scaling_lines(scaling: dict | None, now: float) -> list[str]:
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
    record = asyncio.run(_with_client(args, lambda c: c.scale(args.job, replicas)))
    if replicas is None:
        print(f"{record.job_id}: pin released; admission sizes it "
              f"({len(record.nodes)} replica(s) now)")
    else:
        print(f"{record.job_id}: pinned to {replicas} replica(s) ({len(record.nodes)} now; "
              "growth waits for free slots, a shrink lets the leavers finish their step)")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    explanation = asyncio.run(_with_client(args, lambda c: c.explain(args.job)))
    if args.json:
        print(json.dumps(msgspec_to_builtins(explanation), indent=2))
        return 0
    where = (f", position {explanation.position} of {explanation.queue_length}"
             if explanation.position else "")
    print(f"{explanation.job_id}: {explanation.state.value}{where}")
    print(f"  {explanation.reason_code.value}: {explanation.reason}")
    if explanation.nodes:
        print(f"  nodes: {', '.join(explanation.nodes)}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    record = asyncio.run(_with_client(args, lambda c: c.cancel(args.job)))
    print(f"{record.job_id}: {record.state.value}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from phalanx.services.base import run_service
    from phalanx.services.health.core import HealthPolicy
    from phalanx.services.health.service import HealthService
    from phalanx.services.logs import configure_logging

    overrides = {}
    for field in dataclasses.fields(HealthPolicy):  # PHALANX_HEALTH_<FIELD> overrides
        raw = os.environ.get(f"PHALANX_HEALTH_{field.name.upper()}")
        if raw is not None:
            try:
                overrides[field.name] = int(raw) if field.type in (int, "int") else float(raw)
            except ValueError:
                print(f"phalanx health: PHALANX_HEALTH_{field.name.upper()} must be a number, "
                      f"got {raw!r}", file=sys.stderr)
                return EXIT_USAGE
    try:
        policy = HealthPolicy(**{"node_timeout_s": args.lost_after, **overrides})
    except ValueError as exc:
        print(f"phalanx health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    service = HealthService(policy, _bus_config(args), instance=args.instance,
                            lease_s=float(os.environ.get("PHALANX_HEALTH_LEASE_S", "3")))
    configure_logging("phalanx-health", service.instance, args.log_level)
    return run_service(service)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``examples/demo.py`` from the source checkout this phalanx is installed from."""
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
    if not demo.exists():
        print(f"phalanx demo: {demo} not found: the demo runs from a source checkout "
              "(git clone, then `make demo`)", file=sys.stderr)
        return EXIT_USAGE
    return subprocess.call([sys.executable, str(demo), *args.demo_args])


def cmd_elasticity(args: argparse.Namespace) -> int:
    from phalanx.services.base import run_service
    from phalanx.services.elasticity.core import ElasticityCore
    from phalanx.services.elasticity.service import ElasticityService
    from phalanx.services.logs import configure_logging

    try:
        settings = dict(
            wait_timeout_s=float(os.environ.get("PHALANX_ELASTICITY_WAIT_TIMEOUT_S", "60")),
            max_replacements=int(os.environ.get("PHALANX_ELASTICITY_MAX_REPLACEMENTS", "16")))
        ElasticityCore(**settings)  # refused here, not at the first takeover
        service = ElasticityService(
            lambda: ElasticityCore(**settings), _bus_config(args), instance=args.instance,
            lease_s=float(os.environ.get("PHALANX_ELASTICITY_LEASE_S", "3")))
    except ValueError as exc:
        print(f"phalanx elasticity: PHALANX_ELASTICITY_*: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("phalanx-elasticity", service.instance, args.log_level)
    return run_service(service)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from phalanx.services.base import run_service
    from phalanx.services.checkpoint.service import CheckpointService
    from phalanx.services.logs import configure_logging

    try:
        service = CheckpointService(
            _bus_config(args), instance=args.instance,
            lease_s=float(os.environ.get("PHALANX_CHECKPOINT_LEASE_S", "3")))
    except ValueError as exc:
        print(f"phalanx checkpoint: PHALANX_CHECKPOINT_*: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("phalanx-checkpoint", service.instance, args.log_level)
    return run_service(service)


def cmd_ckpt(args: argparse.Namespace) -> int:
    """``phalanx ckpt ls JOB``: the job's snapshots from the checkpoint catalog (an ended
    job's durable steps included)."""
    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import CheckpointCatalog
    from phalanx.services.checkpoint.core import complete

    async def read() -> CheckpointCatalog | None:
        async with await Bus.connect(_bus_config(args), name="phalanx-cli") as bus:
            kv = await TypedKV.open(bus.js, subjects.CHECKPOINTS_BUCKET, CheckpointCatalog)
            entry = await kv.get(args.job)
            return None if entry is None else entry.value

    catalog = asyncio.run(read())
    if catalog is None:
        print(f"phalanx ckpt: no snapshot of {args.job!r} is known", file=sys.stderr)
        return EXIT_FAILED
    rows = [{"step": s.step, "shards": s.shards, "total_bytes": s.total_bytes,
             "complete": complete(s), "copies": msgspec_to_builtins(s.copies)}
            for s in reversed(catalog.steps)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"step {row['step']}: {row['shards']} shards, {row['total_bytes']} B"
              f"{'' if row['complete'] else ' (incomplete)'}")
        for copy in row["copies"]:
            flag = "  CORRUPT" if copy["corrupt"] else ""
            where = f"at {copy['location']}" if copy["location"] else f"on {copy['node_id']}"
            print(f"  shard {copy['shard']}: {copy['tier']} {where}, "
                  f"{copy['nbytes']} B, xxh3 {copy['checksum']}{flag}")
    return 0


def cmd_ckpt_export(args: argparse.Namespace) -> int:
    """``phalanx ckpt export JOB STEP DIR``: a durable step, checked, as a plain DCP dir."""
    import fsspec

    from phalanx.runtime import durable

    source = args.source
    if source is None:
        record = asyncio.run(_with_client(args, lambda c: c.job(args.job)))
        source = (record.spec.checkpoint.durable_url if record is not None else "") \
            or str(Path(args.data_dir) / "checkpoints")
    fs, root = fsspec.core.url_to_fs(source)
    found = [c for c in durable.committed_steps(fs, f"{root.rstrip('/')}/{args.job}")
             if c.step == args.step]
    if not found:
        print(f"phalanx ckpt: no committed durable step {args.step} of {args.job!r} under "
              f"{source}", file=sys.stderr)
        return EXIT_FAILED
    try:
        files = durable.export(fs, found[0], Path(args.dir))
    except durable.DurableCorrupt as exc:
        print(f"phalanx ckpt: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"exported step {args.step} of {args.job} to {args.dir} ({len(files)} files, "
          "checked): load it with torch.distributed.checkpoint.load")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print (or follow) a job's replica logs from this machine's agents' work dirs."""
    data_dir = Path(args.data_dir)
    replica = args.replica
    if args.rank is not None:
        members, where = asyncio.run(_with_client(args, lambda c: _members(c, args.job)))
        replica = _replica_at_rank(data_dir, args.job, args.rank, members, where)
        if replica is None:
            return EXIT_FAILED
    if args.follow:
        return asyncio.run(_follow(args, data_dir, replica))
    paths = _replica_logs(data_dir, args.job, replica)
    if not paths:
        what = f"replica {replica}" if replica else "any replica"
        print(f"phalanx logs: no log of {what} of {args.job!r} under {data_dir} (logs stay "
              "on the node that ran the replica)", file=sys.stderr)
        return EXIT_FAILED
    for path in paths:
        if len(paths) > 1:
            sys.stdout.write(f"==> {path.stem} on {path.parents[2].name} <==\n")
        sys.stdout.flush()
        sys.stdout.buffer.write(path.read_bytes())
    sys.stdout.flush()
    return 0


def _replica_logs(data_dir: Path, job_id: str, replica: str | None) -> list[Path]:
    """The log files of ``replica`` (every replica: None) of the job under ``data_dir``."""
    return sorted(data_dir.glob(f"agents/*/jobs/{job_id}/{replica or '*'}.log"),
                  key=_replica_order)


def _replica_order(path: Path) -> tuple[int, int]:
    """``r<slot>-<incarnation>.log`` in slot, then incarnation order."""
    slot, _, incarnation = path.stem.removeprefix("r").partition("-")
    return (int(slot), int(incarnation)) if slot.isdigit() and incarnation.isdigit() \
        else (1 << 62, 0)


async def _members(client, job_id: str) -> tuple[list[str] | None, str]:
    """The replicas of the job's current generation by rank (its last one, once it ended),
    and which generation that is; None for a job not under the runtime."""
    generation = await client.generation(job_id)
    if generation is not None:
        return [m.replica_id for m in generation.members], f"generation {generation.generation}"
    history = await client.history(job_id)
    if history is not None and history.generations:
        last = history.generations[-1]
        return list(last.members), f"its last generation, {last.generation}"
    return None, ""


def _replica_at_rank(data_dir: Path, job_id: str, rank: int, members: list[str] | None,
                     where: str) -> str | None:
    """The replica that is ``rank`` in ``members``; in a job not under the runtime, the
    latest replica in slot ``rank``. None (said why) when there is none."""
    if members is not None:
        if rank < len(members):
            return members[rank]
        print(f"phalanx logs: {job_id!r} has no rank {rank}: its world size is "
              f"{len(members)} ({where})", file=sys.stderr)
        return None
    in_slot = sorted(data_dir.glob(f"agents/*/jobs/{job_id}/r{rank}-*.log"), key=_replica_order)
    if not in_slot:
        print(f"phalanx logs: no log of rank {rank} of {job_id!r} under {data_dir}",
              file=sys.stderr)
        return None
    return in_slot[-1].stem


class _Tail:
    """``tail -F`` of one replica's log, each line prefixed with the replica when several
    are followed; :meth:`finish` prints what the file holds beyond what tail passed on."""

    def __init__(self, path: Path, label: str) -> None:
        self.path, self.label, self.offset = path, label.encode(), 0

    async def start(self) -> _Tail:
        self.process = await asyncio.create_subprocess_exec(
            "tail", "-n", "+1", "-F", str(self.path), stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL)
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.offset += len(line)
            self._write(line)

    def _write(self, data: bytes) -> None:
        sys.stdout.buffer.write(self.label + data)
        sys.stdout.buffer.flush()

    async def finish(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        await self.reader
        await self.process.wait()
        with contextlib.suppress(OSError), self.path.open("rb") as f:
            f.seek(self.offset)
            rest = f.read()
            for line in rest.splitlines(keepends=True):
                self._write(line)


async def _follow(args: argparse.Namespace, data_dir: Path, replica: str | None) -> int:
    """Follow ``replica``'s log (None: every replica's, also those the job starts from now
    on) until the job's record says it ended."""
    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import JobRecord, RankStarted
    from phalanx.services.agent.ranks import replica_log

    job_id, everyone = args.job, replica is None
    tails: dict[Path, _Tail] = {}

    async def follow(path: Path) -> None:
        if path not in tails:
            tails[path] = await _Tail(path, f"{path.stem} | " if everyone else "").start()

    async def started(message: RankStarted, _) -> None:
        if message.replica_id is not None:
            await follow(replica_log(data_dir / "agents" / message.node_id, job_id,
                                     message.replica_id))

    async with await Bus.connect(_bus_config(args), name="phalanx-cli") as bus:
        jobs = await TypedKV.open(bus.js, subjects.JOBS_BUCKET, JobRecord)
        if await jobs.get(job_id) is None:
            print(f"phalanx logs: no job {job_id!r}", file=sys.stderr)
            return EXIT_FAILED
        if everyone:  # before the files are listed: no replica started meanwhile is missed
            await bus.subscribe(subjects.rank_started(job_id), RankStarted, started)
        for path in await asyncio.to_thread(_replica_logs, data_dir, job_id, replica):
            await follow(path)
        ended: JobRecord | None = None
        async for change in jobs.watch():  # the record's changes, not a poll
            if change is not None and change.key == job_id and (
                    change.value is None or change.value.state.terminal):
                ended = change.value
                break
        for tail in tails.values():
            await tail.finish()
    what = "deleted" if ended is None else f"{ended.state.value}: {ended.reason}"
    print(f"=== phalanx: {job_id} {what}", file=sys.stderr)
    return 0


async def _agent_request(args: argparse.Namespace, node_id: str, request):
    from phalanx.bus.client import Bus
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import ChaosReply

    async with await Bus.connect(_bus_config(args), name="phalanx-cli") as bus:
        return await bus.request(subjects.agent_chaos(node_id), request, ChaosReply,
                                 timeout_s=5.0)


def cmd_chaos(args: argparse.Namespace) -> int:
    from phalanx.schemas.messages import ChaosAction, ChaosRequest

    if args.action == "kill-rank":
        record = asyncio.run(_with_client(args, lambda c: c.job(args.job)))
        # The rank is a slot number: slots keep their numbers when a placement shrinks or
        # grows, so the node is the slot's, not the list position's.
        node = None if record is None else record.placement().get(args.rank)
        if node is None:
            print(f"phalanx chaos: {args.job!r} has no running rank {args.rank}",
                  file=sys.stderr)
            return EXIT_FAILED
        request = ChaosRequest(action=ChaosAction.KILL_RANK, job_id=args.job, rank=args.rank,
                               signal=args.signal)
    else:
        node = args.node
        action = ChaosAction.KILL_AGENT if args.action == "kill-agent" else \
            ChaosAction.PAUSE_AGENT
        request = ChaosRequest(action=action, duration_s=args.seconds)
    reply = asyncio.run(_agent_request(args, node, request))
    print(f"{reply.node_id}: {reply.detail}")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """Cordon or uncordon a node: no new placements while cordoned; health is told."""
    import msgspec

    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import NodeCondition, NodeConditionChanged, NodeRecord

    cordon = args.action == "cordon"

    async def change() -> None:
        async with await Bus.connect(_bus_config(args), name="phalanx-cli") as bus:
            nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)

            def flip(record: NodeRecord | None) -> NodeRecord:
                if record is None:
                    raise LookupError(f"no node {args.node!r} in the registry")
                return msgspec.structs.replace(record, cordoned=cordon)

            await nodes.modify(args.node, flip)
            await bus.publish(subjects.node_condition(args.node), NodeConditionChanged(
                node_id=args.node, reason=f"{args.action} by operator", at=time.time(),
                condition=NodeCondition.CORDONED if cordon else NodeCondition.UNCORDONED))

    try:
        asyncio.run(change())
    except LookupError as exc:
        print(f"phalanx node: {exc.args[0]}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{args.node}: {'cordoned' if cordon else 'uncordoned'}")
    return 0


def msgspec_to_builtins(message) -> dict:
    import msgspec

    return msgspec.to_builtins(message)


# --- nodes ---------------------------------------------------------------------------------


async def _read_nodes(args: argparse.Namespace):
    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import NodeRecord
    from phalanx.services.registry.core import views

    async with await Bus.connect(_bus_config(args), name="phalanx-cli") as bus:
        nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        entries, errors = await nodes.entries()
    return views((e.value for e in entries), time.time(), args.lost_after), errors


def _node_rows(nodes) -> list[dict]:
    return [{
        "node_id": n.node_id, "state": n.state.value, "slots": n.slots,
        "slots_used": n.slots_used, "failure_domain": n.failure_domain, "labels": n.labels,
        "cordoned": n.cordoned, "heartbeat_age_s": round(n.heartbeat_age_s, 3),
        "host": n.host, "agent_pid": n.agent_pid,
    } for n in nodes]


def _node_table(nodes):
    from rich.table import Table

    table = Table(title="phalanx nodes")
    for column in ("node", "state", "slots (used/total)", "domain", "heartbeat", "host", "pid"):
        table.add_column(column)
    for n in nodes:
        state = n.state.value + (" (cordoned)" if n.cordoned else "")
        color = "green" if n.state.value == "alive" and not n.cordoned else "red"
        table.add_row(n.node_id, f"[{color}]{state}[/]", f"{n.slots_used}/{n.slots}",
                      n.failure_domain, f"{n.heartbeat_age_s:.1f} s ago", n.host,
                      str(n.agent_pid))
    return table


def cmd_nodes(args: argparse.Namespace) -> int:
    from rich.console import Console

    nodes, errors = asyncio.run(_read_nodes(args))
    for error in errors:
        print(f"warning: skipped a registry entry: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps(_node_rows(nodes), indent=2))
    else:
        Console().print(_node_table(nodes))
    return 0


# --- top -----------------------------------------------------------------------------------


def cmd_top(args: argparse.Namespace) -> int:
    """Nodes, jobs and the latest events, redrawn as the bus reports changes."""
    from rich.console import Console
    from rich.live import Live

    from phalanx.bus.client import Bus
    from phalanx.services import top

    console = Console()

    async def run() -> None:
        async with await Bus.connect(_bus_config(args), name="phalanx-top") as bus:
            if args.once:
                console.print(top.render(await top.snapshot(bus), time.time(),
                                         args.lost_after))
                return
            with Live(console=console, auto_refresh=False, screen=True) as view:
                await top.live(bus, lambda board: view.update(
                    top.render(board, time.time(), args.lost_after), refresh=True))

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


# --- up / down -----------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from phalanx.services.cluster import ClusterState

    data_dir = Path(args.data_dir)
    running = ClusterState.read(data_dir)
    if running is not None:
        print(f"phalanx up: a local cluster already runs from {data_dir} (pid {running.pid}, "
              f"{running.nats_url}); `phalanx down` stops it", file=sys.stderr)
        return EXIT_FAILED
    if args.detach:
        return _up_detached(args, data_dir)
    if args.notify_fd:
        # Inherited to reach this process only: uvloop's spawn does not close inheritable
        # descriptors, and a service holding the pipe would keep the parent waiting on it.
        os.set_inheritable(args.notify_fd, False)
    from phalanx.services.logs import configure_logging

    configure_logging("phalanx-up", "local", args.log_level)
    try:
        import uvloop
        return uvloop.run(_up(args, data_dir))
    except ImportError:
        return asyncio.run(_up(args, data_dir))


async def _up(args: argparse.Namespace, data_dir: Path) -> int:
    from phalanx.services.cluster import LocalCluster
    from phalanx.services.paths import forget_cluster, remember_cluster

    cluster = LocalCluster(
        data_dir, agents=args.agents, slots_per_agent=args.slots_per_agent,
        nats_url=args.nats, nats_port=args.nats_port, nats_servers=args.nats_cluster,
        heartbeat_interval_s=args.heartbeat_interval, lost_after_s=args.lost_after,
        admission_instances=args.admission, health_instances=args.health,
        elasticity_instances=args.elasticity, config_path=args.config,
        auth_dir=data_dir / "auth" if args.secure else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start()
    except PhalanxError as exc:
        await cluster.stop()
        _notify(args, f"error {exc}")
        print(f"phalanx up: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _notify(args, f"ready {cluster.nats_url}")
    remember_cluster(data_dir)  # the commands after this one find the cluster without flags
    # The embedded server is started again if it dies; if it cannot be, the cluster stops.
    keeper = asyncio.create_task(cluster.keep_nats(stop))
    try:
        if sys.stdout.isatty() and not args.notify_fd:
            await _live_status(args, cluster.nats_url, stop)
        else:
            print(f"phalanx up: {cluster.nats_url}, {len(cluster.agents)} agents; "
                  "Ctrl-C stops", flush=True)
            await stop.wait()
    finally:
        stop.set()
        gave_up = await keeper
        await cluster.stop()
        forget_cluster(data_dir)
    if gave_up and not args.detach:
        print(f"phalanx up: nats-server could not be started again; stopped the cluster "
              f"(see {Path(args.data_dir) / 'logs' / 'nats.log'})", file=sys.stderr)
        return EXIT_FAILED
    return 0


async def _live_status(args: argparse.Namespace, nats_url: str, stop: asyncio.Event) -> None:
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    if not args.secure:  # secured, the recorded cluster gives the operator's identity too
        args.nats = nats_url
    header = Text(f"phalanx up — NATS {nats_url}, data in {args.data_dir}; Ctrl-C stops")
    with Live(header, refresh_per_second=2) as live:
        while not stop.is_set():
            try:
                nodes, _ = await _read_nodes(args)
                live.update(Group(header, _node_table(nodes)))
            except PhalanxError as exc:
                live.update(Group(header, Text(f"registry unavailable: {exc}")))
            await wait_set(stop, 1.0)


def _notify(args: argparse.Namespace, line: str) -> None:
    """Tell the `up --detach` parent how start-up went, through the inherited pipe."""
    if args.notify_fd:
        with contextlib.suppress(OSError):
            os.write(args.notify_fd, (line + "\n").encode())
            os.close(args.notify_fd)
        args.notify_fd = None


def _up_detached(args: argparse.Namespace, data_dir: Path) -> int:
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    argv = _rebuild_argv(args)
    log_path = data_dir / "logs" / "up.log"
    with log_path.open("ab") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", "phalanx.services.cli", *argv, "--notify-fd", str(write_end)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, pass_fds=(write_end,),
            start_new_session=True,
        )
    os.close(write_end)
    with os.fdopen(read_end) as pipe:  # one message, closed after it (an error may span lines)
        line = pipe.read().strip()
    if line.startswith("ready "):
        print(f"phalanx up: local cluster running (pid {child.pid}), NATS {line[6:]}, "
              f"{args.agents} agents; logs in {data_dir / 'logs'}.\n"
              "  phalanx nodes      list nodes\n  phalanx down       stop it")
        return 0
    child.wait()
    reason = line.removeprefix("error ") or f"exited with code {child.returncode}"
    print(f"phalanx up: failed to start: {reason} (log: {log_path})", file=sys.stderr)
    return EXIT_FAILED


def _rebuild_argv(args: argparse.Namespace) -> list[str]:
    argv = ["up", "--agents", str(args.agents), "--slots-per-agent", str(args.slots_per_agent),
            "--nats-port", str(args.nats_port), "--nats-cluster", str(args.nats_cluster),
            "--data-dir", str(args.data_dir),
            "--heartbeat-interval", str(args.heartbeat_interval),
            "--lost-after", str(args.lost_after), "--admission", str(args.admission),
            "--health", str(args.health), "--elasticity", str(args.elasticity),
            "--log-level", args.log_level]
    if args.nats:
        argv += ["--nats", args.nats]
    if args.config:
        argv += ["--config", args.config]
    if args.secure:
        argv.append("--secure")
    return argv


def cmd_down(args: argparse.Namespace) -> int:
    from phalanx.services.cluster import stop_recorded
    from phalanx.services.paths import forget_cluster

    state = stop_recorded(Path(args.data_dir), args.timeout)
    forget_cluster(Path(args.data_dir))
    if state is None:
        print(f"phalanx down: no local cluster recorded in {args.data_dir}; nothing to stop")
    else:
        print(f"phalanx down: stopped the local cluster (pid {state.pid}, "
              f"{len(state.agents)} agents)")
    return 0


# --- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from phalanx.services.paths import default_data_dir
    from phalanx.services.registry.core import DEFAULT_LOST_AFTER_S

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats", metavar="URL", help="NATS server URL(s), comma-separated")
    common.add_argument("--config", metavar="FILE", help="TOML config file with a [bus] table")
    common.add_argument("--data-dir", help="local cluster state, logs and JetStream data "
                        "(default: the cluster `phalanx up` last started, if neither --nats "
                        f"nor PHALANX_NATS_URL is given; else {default_data_dir()})")
    common.add_argument("--log-level", default="INFO")
    lost_after = argparse.ArgumentParser(add_help=False)
    lost_after.add_argument("--lost-after", type=float, default=DEFAULT_LOST_AFTER_S,
                            metavar="S", help="a node is lost when its heartbeat is older "
                            "(default: %(default)s s)")

    parser = argparse.ArgumentParser(prog="phalanx", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", parents=[common, lost_after], help="run a local cluster")
    up.add_argument("--agents", type=int, default=2, metavar="N")
    up.add_argument("--slots-per-agent", type=int, default=2, metavar="K")
    up.add_argument("--nats-port", type=int, default=4222,
                    help="port of the embedded NATS server (0 = any free port)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run the embedded NATS as a cluster of N servers (ports --nats-port "
                    "and up), buckets and streams replicated on 3 (default: one server)")
    up.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="S")
    up.add_argument("--admission", type=int, default=1, metavar="N",
                    help="admission service instances (one leads, the others stand by)")
    up.add_argument("--health", type=int, default=1, metavar="N",
                    help="health service instances (one leads, the others stand by)")
    up.add_argument("--elasticity", type=int, default=1, metavar="N",
                    help="elasticity service instances (one leads, the others stand by)")
    up.add_argument("--detach", "-d", action="store_true", help="run in the background")
    up.add_argument("--secure", action="store_true",
                    help="TLS and per-role permissions on the bus, every process as its own "
                         "identity (auth directory <data-dir>/auth, made if missing)")
    up.add_argument("--notify-fd", type=int, help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", parents=[common], help="stop a detached local cluster")
    down.add_argument("--timeout", type=float, default=20.0, metavar="S")
    down.set_defaults(func=cmd_down)

    nodes = sub.add_parser("nodes", parents=[common, lost_after], help="list registered nodes")
    nodes.add_argument("--json", action="store_true")
    nodes.set_defaults(func=cmd_nodes)

    admission = sub.add_parser("admission", parents=[common],
                               help="run an admission service instance")
    admission.add_argument("--instance", help="instance name (default: host-pid-random)")
    admission.set_defaults(func=cmd_admission)

    submit = sub.add_parser("submit", parents=[common], help="submit a job spec (YAML)")
    submit.add_argument("file")
    submit.add_argument("--job-id", help="job id (default: <name>-<random>)")
    submit.add_argument("--resume", metavar="JOB",
                        help="start from JOB's newest durable checkpoint (sets the spec's "
                             "checkpoint.resume_from)")
    submit.add_argument("--json", action="store_true")
    submit.set_defaults(func=cmd_submit)

    top = sub.add_parser("top", parents=[common, lost_after],
                         help="live view of nodes, jobs and the latest events")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=cmd_top)

    jobs = sub.add_parser("jobs", parents=[common], help="list jobs")
    jobs.add_argument("--json", action="store_true")
    jobs.set_defaults(func=cmd_jobs)

    for name, func, text in (("job", cmd_job, "show one job"),
                             ("explain", cmd_explain, "why a job waits, and where it stands"),
                             ("cancel", cmd_cancel, "cancel a job")):
        command = sub.add_parser(name, parents=[common], help=text)
        command.add_argument("job")
        if name != "cancel":
            command.add_argument("--json", action="store_true")
        command.set_defaults(func=func)

    scale = sub.add_parser("scale", parents=[common],
                           help="pin an elastic job's size, or release the pin")
    scale.add_argument("job")
    size = scale.add_mutually_exclusive_group(required=True)
    size.add_argument("--replicas", type=int, metavar="N",
                      help="pin it to N replicas (one of its allowed sizes)")
    size.add_argument("--auto", action="store_true",
                      help="release the pin: admission sizes it again")
    scale.set_defaults(func=cmd_scale)

    health = sub.add_parser("health", parents=[common, lost_after],
                            help="run the health service")
    health.add_argument("--instance", help="instance name (default: host-pid-random)")
    health.set_defaults(func=cmd_health)

    demo = sub.add_parser("demo", help="W on 4 ranks on a local cluster: kill one, watch it "
                                       "recover, compare with a fault-free run",
                          add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER,
                      help="passed to examples/demo.py (--help for its options)")
    demo.set_defaults(func=cmd_demo)

    checkpoint = sub.add_parser("checkpoint", parents=[common],
                                help="run the checkpoint service (the snapshot catalog)")
    checkpoint.add_argument("--instance", help="instance name (default: host-pid-random)")
    checkpoint.set_defaults(func=cmd_checkpoint)

    ckpt = sub.add_parser("ckpt", help="a job's checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    ckpt_ls = ckpt_sub.add_parser("ls", parents=[common],
                                  help="steps, tiers, locations, sizes and checksums")
    ckpt_ls.add_argument("job")
    ckpt_ls.add_argument("--json", action="store_true")
    ckpt.set_defaults(func=cmd_ckpt)
    ckpt_export = ckpt_sub.add_parser("export", parents=[common],
                                      help="write a durable step as a plain DCP checkpoint")
    ckpt_export.add_argument("job")
    ckpt_export.add_argument("step", type=int)
    ckpt_export.add_argument("dir")
    ckpt_export.add_argument("--from", dest="source", metavar="URL",
                             help="the durable root the job wrote to (default: the job "
                                  "spec's checkpoint.durable_url, else <data-dir>/checkpoints)")
    ckpt_export.set_defaults(func=cmd_ckpt_export)

    elasticity = sub.add_parser("elasticity", parents=[common],
                                help="run the elasticity service (generations of running jobs)")
    elasticity.add_argument("--instance", help="instance name (default: host-pid-random)")
    elasticity.set_defaults(func=cmd_elasticity)

    logs = sub.add_parser("logs", parents=[common],
                          help="a job's replica logs (on this machine's agents)")
    logs.add_argument("job")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R",
                       help="the replica that is rank R now (in the current generation)")
    which.add_argument("--replica", metavar="ID", help="one replica, e.g. r1-0")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="follow until the job ends (all replicas: new ones too)")
    logs.set_defaults(func=cmd_logs)

    chaos = sub.add_parser("chaos", help="inject faults through the agents")
    chaos_sub = chaos.add_subparsers(dest="action", required=True)
    kill_rank = chaos_sub.add_parser("kill-rank", parents=[common])
    kill_rank.add_argument("job")
    kill_rank.add_argument("rank", type=int)
    kill_rank.add_argument("--signal", default="KILL", choices=["KILL", "STOP", "TERM", "CONT"])
    for name in ("kill-agent", "pause-agent"):
        node_chaos = chaos_sub.add_parser(name, parents=[common])
        node_chaos.add_argument("node")
        node_chaos.add_argument("--seconds", type=float, default=5.0,
                                help="pause-agent: how long the agent stays stopped")
    chaos.set_defaults(func=cmd_chaos)

    node = sub.add_parser("node", parents=[common], help="cordon or uncordon a node")
    node.add_argument("action", choices=["cordon", "uncordon"])
    node.add_argument("node")
    node.set_defaults(func=cmd_node)

    auth = sub.add_parser("auth", help="bus identities and permissions (docs/security.md)")
    auth_sub = auth.add_subparsers(dest="action", required=True)
    init = auth_sub.add_parser("init", help="make an auth directory: CA, server config, an "
                                            "identity per role")
    init.add_argument("dir")
    init.add_argument("--node", action="append", default=[], metavar="NODE",
                      help="also make this node's agent identity (repeatable)")
    init.add_argument("--host", action="append", default=[], metavar="HOST",
                      help="a name or IP clients dial the server by, for its certificate "
                           "(repeatable; loopback and this host are always in)")
    for name, what in (("add-node", "a node's agent"), ("add-job", "a job's ranks")):
        add = auth_sub.add_parser(name, help=f"add {what} identity")
        add.add_argument("dir")
        add.add_argument("id", metavar=name.removeprefix("add-").upper())
    auth.set_defaults(func=cmd_auth)

    agent = sub.add_parser("agent", parents=[common, lost_after], help="run a node agent")
    agent.add_argument("--node-id")
    agent.add_argument("--slots", type=int)
    agent.add_argument("--failure-domain")
    agent.add_argument("--labels", help="key=value,key=value")
    agent.add_argument("--heartbeat-interval", type=float, metavar="S")
    agent.add_argument("--work-dir", help="rank logs and manifest (default: "
                                          "<data-dir>/agents/<node-id>)")
    agent.set_defaults(func=cmd_agent)
    return parser


def _data_dir(args: argparse.Namespace) -> Path:
    """``--data-dir``, else ``$PHALANX_DATA_DIR``, else (for a command that is not ``up``
    and is not pointed at a bus) the data dir of the cluster ``phalanx up`` last started,
    else the state dir."""
    from phalanx.services.paths import default_data_dir, remembered_cluster

    if args.data_dir is not None:
        return Path(args.data_dir)
    if os.environ.get("PHALANX_DATA_DIR") or args.command == "up" or args.nats \
            or os.environ.get("PHALANX_NATS_URL"):
        return default_data_dir()
    return remembered_cluster() or default_data_dir()


def _no_cluster_hint(args: argparse.Namespace, exc: PhalanxError) -> str:
    """What to pass when the bus was not reached because no cluster was found: the
    default URL was tried only because nothing named one."""
    from phalanx.bus.errors import BusUnavailable
    from phalanx.services.cluster import ClusterState

    if not isinstance(exc, BusUnavailable) or getattr(args, "data_dir", None) is None \
            or args.nats or os.environ.get("PHALANX_NATS_URL") \
            or ClusterState.read(Path(args.data_dir)) is not None:
        return ""
    return (f"\nno local cluster runs from {args.data_dir}: for one started with "
            "`phalanx up --data-dir DIR`, pass the same --data-dir DIR; for another "
            "cluster, pass --nats URL (or set PHALANX_NATS_URL)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # everything after it, --help included, is the demo's
        return cmd_demo(argparse.Namespace(demo_args=argv[1:]))
    args = build_parser().parse_args(argv)
    if hasattr(args, "data_dir"):
        args.data_dir = str(_data_dir(args))
    try:
        return args.func(args)
    except PhalanxError as exc:
        print(f"phalanx {args.command}: {exc}{_no_cluster_hint(args, exc)}", file=sys.stderr)
        refused = getattr(exc, "code", "").startswith("4")
        return EXIT_USAGE if isinstance(exc, ValueError) or refused else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
