"""Revocation latency: a job's end to its open rank connection closed, and to its refusal.

Runs a real nats-server configured as the Kubernetes chart's values configure it
(``phalanx auth kubernetes``: NKEY users, the auth callout, the system account) and
the real callout service with its revoker, at its default interval. Each trial
writes a job's record as admitted, connects a rank with a token minted for the job
(as its agent would), writes the record as finished at t0 (from this process, whose
clock also times the arrivals), then measures:

* **end -> closed**: until the rank's client sees its connection closed;
* **end -> refused**: until the callout refuses the rank's reconnection with its
  token as ``ended_job`` (nats-py reconnects after ``reconnect_wait_s``, so this
  includes that wait).

Target (docs/security.md): end -> closed under the revoker's interval
(``PHALANX_CALLOUT_REVOKE_INTERVAL_S``, 10 s) for every trial; p50/p99/max in
milliseconds. Prints progress, then one JSON object as the last line, and appends a
section to ``bench/RESULTS.md`` unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.bench.detect import latency_table, stats
from phalanx.bench.results import append, command_line, finish, utc_date
from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import JobRecord, JobSpec, JobState, ReasonCode, ReplicaRange
from phalanx.services.auth import kubernetes, rank_token
from phalanx.services.auth.callout import Decision, Refusal
from phalanx.services.auth.credentials import token_rank_env
from phalanx.services.auth.issuer import server_config
from phalanx.services.auth.replication_key import load_key
from phalanx.services.auth.roles import Role
from phalanx.services.callout.config import CalloutConfig
from phalanx.services.callout.service import CalloutService
from phalanx.services.natsd import NatsServer

SPEC = JobSpec(name="revoke", team="bench", priority_class="normal",
               replicas=ReplicaRange(min=1, max=1), command=["true"])


def record_of(job: str, state: JobState) -> JobRecord:
    return JobRecord(job_id=job, spec=SPEC, state=state, submitted_at=1.0,
                     updated_at=time.time(), reason_code=ReasonCode.QUEUED,
                     nodes=["node-a"] if state is JobState.ADMITTED else [])


async def trials(root: Path, count: int) -> tuple[list[float], list[float], float]:
    auth = kubernetes.prepare(root / "auth", "phalanx")
    config = {**server_config(auth.identities(), auth.tls_dir),
              **kubernetes.nats_values(auth)["config"]["merge"]}  # type: ignore[index]
    (root / "nats.conf").write_text(json.dumps(config))
    with NatsServer(root / "js", log_path=root / "nats.log",
                    config_file=root / "nats.conf") as server:
        def as_role(role: Role) -> BusConfig:
            return BusConfig.load(env=auth.env(role), servers=[server.url])

        callout = CalloutService(CalloutConfig(
            issuer_seed_file=str(auth.callout_issuer_path),
            token_key_file=str(auth.rank_token_key_path),
            system_seed_file=str(auth.system_user_path)), as_role(Role.CALLOUT),
            instance="bench")
        refusals: dict[str, asyncio.Event] = {}  # by job: its reconnection refused
        answer = callout.answer

        async def timed(request: bytes) -> Decision:
            decision = await answer(request)
            if decision.refusal is Refusal.ENDED_JOB:  # "job <job> is finished"
                refusals.get(decision.message.split()[1], asyncio.Event()).set()
            return decision

        callout.answer = timed  # type: ignore[method-assign]
        await callout.start()
        key = load_key(auth.rank_token_key_path)
        closed_ms, refused_ms = [], []
        try:
            async with await Bus.connect(as_role(Role.ADMISSION)) as admission:
                jobs = await TypedKV.open(admission.js, subjects.JOBS_BUCKET, JobRecord)
                for trial in range(count):
                    job = f"revoke-{trial}"
                    await jobs.put(job, record_of(job, JobState.ADMITTED))
                    token = rank_token.mint(key, job, now=time.time(), ttl_s=600.0,
                                            nonce=os.urandom(rank_token.NONCE_BYTES))
                    rank = await Bus.connect(BusConfig.load(
                        env=token_rank_env(token, job, str(auth.ca_path)),
                        servers=[server.url]), name=f"rank-{trial}")
                    closed, refused = rank.disconnect_event(), asyncio.Event()
                    refusals[job] = refused
                    try:
                        t0 = time.monotonic()
                        await jobs.put(job, record_of(job, JobState.FINISHED))
                        await closed.wait()
                        closed_ms.append((time.monotonic() - t0) * 1000)
                        await refused.wait()
                        refused_ms.append((time.monotonic() - t0) * 1000)
                    finally:
                        await rank.close()
                    print(f"trial {trial}: closed {closed_ms[-1]:.1f} ms, refused "
                          f"{refused_ms[-1]:.1f} ms", flush=True)
        finally:
            await callout.stop()
        return closed_ms, refused_ms, callout.config.revoke_interval_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        closed, refused, interval_s = asyncio.run(trials(Path(tmp), args.trials))
    figures = {"end_to_closed": stats(closed), "end_to_refused": stats(refused)}
    bound_ms = interval_s * 1000
    return {"benchmark": "revoke", "date": utc_date(),
            "command": command_line("revoke.py", sys.argv[1:]),
            "revoke_interval_s": interval_s, "figures": figures,
            "targets": {"end_to_closed_max_ms": {
                "target": f"< {bound_ms:g}", "measured": figures["end_to_closed"]["max_ms"],
                "pass": figures["end_to_closed"]["max_ms"] < bound_ms}},
            "pass": figures["end_to_closed"]["max_ms"] < bound_ms}


def record(report: dict[str, Any]) -> None:
    table = latency_table(report["figures"], (
        ("job's end -> its rank connection closed", "end_to_closed",
         f"max < {report['revoke_interval_s'] * 1000:g}"),
        ("job's end -> its rank's reconnection refused", "end_to_refused", "reported")))
    append(f"\n## revoke.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
           "One nats-server configured as the chart's values (callout, system account), "
           f"the callout with its revoker (interval {report['revoke_interval_s']:g} s); "
           "one rank connection per trial, its job's record written finished at t0.\n\n"
           f"{table}\n\nResult: {'pass' if report['pass'] else 'FAIL'}.\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    report = run(args)
    return finish(report, record, no_record=args.no_record)


if __name__ == "__main__":
    sys.exit(main())
