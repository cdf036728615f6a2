"""Benchmark of bad input: every subject and KV record phalanx listens on, 10,000 inputs each.

What it does
------------
Starts a real ``nats-server`` (free port, temporary JetStream store), runs
admission, health, elasticity and one agent (4 slots) in this process on their
own connections, submits one running job, then fires ``--per-subject`` seeded
inputs at each target of :func:`fuzzing.targets` (generated, mutated and junk
payloads; see ``bench/fuzzing.py``), one target after another. After the
barrage it proves the services still work: each still runs and leads, answers
``$SRV.PING``, a heartbeat of its node lands in the registry, and a new job is
admitted.

Passes when no service stopped or failed its leadership with an exception,
nothing was logged at ERROR, every bad input was counted (exactly once on
subjects, at least once by each follower of a KV bucket), every bad request was
answered 400, no valid request was answered 500 or not at all, and the
services still work.

Output: one line per target, then one JSON object with every figure as the last
line. Unless ``--no-record``, a section is appended to ``bench/RESULTS.md``.
The exit status is 1 when it did not pass.

Run: ``.venv/bin/python bench/fuzz.py [--per-subject N] [--seed S] [--no-record]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.bench.fuzzing import Barrage, targets
from phalanx.bench.results import RESULTS_PATH, append, utc_date
from phalanx.services.natsd import NatsServer


async def run(per_subject: int, seed: int) -> dict[str, Any]:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="phalanx-fuzz-") as tmp:
        root = Path(tmp)
        with NatsServer(root / "js", port=0, log_path=root / "nats.log") as server:
            async with Barrage(server.url, root, seed=seed, per_target=per_subject) as barrage:
                for target in (t.name for t in targets(barrage.world)):
                    result = (await barrage.fire(only=[target]))[target]
                    print(f"{target}: {result.inputs} inputs, {result.bad} bad, counted "
                          f"{result.counted}, replies {result.replies}, "
                          f"{len(result.findings)} findings", flush=True)
                try:
                    alive: Any = await barrage.still_works("fz-probe")
                except (AssertionError, TimeoutError, OSError) as exc:
                    alive = f"{type(exc).__name__}: {exc}"
                assert barrage.services is not None  # started with the barrage
                stopped = [s.name for s in barrage.services.all() if s.stopping]
                report = barrage.report()
    report.update(per_subject=per_subject, still_works=alive, crashes=len(stopped),
                  stopped=stopped, duration_s=round(time.monotonic() - started, 1))
    report["passed"] = (not stopped and not report["errors_logged"]
                        and report["findings"] == 0 and isinstance(alive, dict))
    return report


def markdown_section(report: dict[str, Any], command: str) -> str:
    rows = "\n".join(
        f"| {name} | {r['inputs']:,} | {r['bad']:,} | "
        f"{', '.join(f'{c:,}' for c in r['counted'].values()) or '-'} | "
        f"{', '.join(f'{k} {v:,}' for k, v in sorted(r['replies'].items())) or '-'} | "
        f"{len(r['findings'])} |"
        for name, r in report["targets"].items())
    return f"""
## Bad input on every subject ({utc_date()})

`{command}`: admission, health, elasticity and one agent on a real nats-server,
{report['per_subject']:,} seeded inputs per target (seed {report['seed']}; generated,
mutated and junk payloads, `bench/fuzzing.py`). "counted" is each counter that must
count the target's bad inputs (exactly on subjects, at least on KV buckets' followers;
none for records only a leader reads at the start of its term).

| target | inputs | bad | counted | replies | findings |
|---|---:|---:|---:|---|---:|
{rows}

Crashes {report['crashes']}, errors logged {len(report['errors_logged'])}, findings
{report['findings']}; afterwards: {report['still_works']}. Duration
{report['duration_s']:,} s. {'Pass' if report['passed'] else 'FAIL'}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-subject", type=int, default=10_000, metavar="N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true",
                        help=f"do not append the results to {RESULTS_PATH.name}")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.per_subject, args.seed))
    if not args.no_record:
        command = " ".join(["python bench/fuzz.py", *(argv if argv is not None else sys.argv[1:])])
        append(markdown_section(report, command))
        print(f"appended to {RESULTS_PATH}", flush=True)
    summary = {"per_subject": report["per_subject"], "crashes": report["crashes"],
               "inputs": {n: r["inputs"] for n, r in report["targets"].items()},
               "bad": {n: r["bad"] for n, r in report["targets"].items()},
               "counted": {n: r["counted"] for n, r in report["targets"].items()},
               "findings": report["findings"], "errors_logged": report["errors_logged"],
               "still_works": report["still_works"], "duration_s": report["duration_s"],
               "passed": report["passed"]}
    print(json.dumps(summary), flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
