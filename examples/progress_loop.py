"""A stand-in training loop: sleeps a step time, reports progress, runs N steps.

Used by tests, ``bench/detect.py`` and the README to exercise launching and
health without torch: ``python examples/progress_loop.py --steps 1000 --step-time 0.05``.
Exits 0 after its last step, so a job of these finishes by itself.
"""

import argparse
import time
from pathlib import Path

from phalanx.runtime.progress import ProgressReporter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--wait-for", type=Path, metavar="PATH",
                        help="start stepping once PATH exists (a test holds the job running)")
    args = parser.parse_args()
    while args.wait_for is not None and not args.wait_for.exists():
        time.sleep(0.05)
    reporter = ProgressReporter.from_env()
    try:
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            time.sleep(args.step_time)  # the "work" of one step
            if reporter is not None:
                reporter.report(step, time.perf_counter() - started)
    finally:
        if reporter is not None:
            reporter.close()


if __name__ == "__main__":
    main()
