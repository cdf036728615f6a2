"""CPU sets: which CPUs an agent and each of its CPU slots' ranks run on (``agent.cpus``).

An agent given a CPU set (``"0-7"``, the kernel's list format) runs on it, and pins each
CPU slot's ranks to a share of it of their own: whole physical cores, split evenly among
the slots, as Kubernetes' static CPU manager gives a pod exclusive cores. Unpinned, the
scheduler moves ranks between CPUs and may put two busy ranks on the two hyperthreads of
one core; W's step time then varied by up to 22 % from one run to the next on a 16-CPU
machine (bench/RESULTS.md, 2026-11-28), and a synchronous job runs at its slowest rank's
pace. Several agents on one machine (``phalanx up --pin-cpus``) each take a disjoint share
of its cores the same way (:func:`shares`).

The rules are pure (:func:`parse_cpu_list`, :func:`shares`); :func:`core_of` reads the
machine's topology, and :func:`run_on` and :func:`pin` set a process's affinity, every
thread of it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from phalanx.schemas.errors import ConfigError

log = logging.getLogger("phalanx.agent")

#: Where Linux describes each CPU's place: ``cpu<N>/topology/{physical_package_id,core_id}``.
SYS_CPUS = Path("/sys/devices/system/cpu")
T = TypeVar("T")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` → ``(0, 1, 2, 3, 8)``: the kernel's CPU list format, sorted, each CPU
    once; ``""`` → ``()``.

    Raises:
        ValueError: an item that is neither a CPU number nor a rising range of them.
    """
    cpus: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        first, dash, last = item.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"cpus must be CPU numbers and ranges like 0-3,8 separated "
                             f"by commas, got {item!r} in {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"cpus: the range {item!r} runs backwards")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 3, 8)`` → ``"0-3,8"``: the inverse of :func:`parse_cpu_list`."""
    runs = []
    for _, run in itertools.groupby(enumerate(sorted(set(cpus))), lambda p: p[1] - p[0]):
        numbers = [cpu for _, cpu in run]
        runs.append(str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}")
    return ",".join(runs)


def core_of(cpu: int, root: Path = SYS_CPUS) -> tuple[int, int]:
    """The physical core ``cpu`` is a hyperthread of, as (package, core) — CPUs with the
    same answer share a core's execution units; the CPU alone where the machine does not
    say."""
    topology = root / f"cpu{cpu}" / "topology"
    try:
        return (int((topology / "physical_package_id").read_text()),
                int((topology / "core_id").read_text()))
    except (OSError, ValueError):
        return (-1, cpu)


def shares(cpus: Sequence[int], parts: int,
           core: Callable[[int], tuple[int, int]] = core_of) -> tuple[tuple[int, ...], ...]:
    """Split ``cpus`` into ``parts`` shares, in order: each a run of whole physical cores
    (``core`` names a CPU's; cores in the order of their first CPU), the shares' core
    counts within one of each other, where there are at least as many cores as parts;
    else each a run of single CPUs, sizes within one; with fewer CPUs than parts, one CPU
    each, shared round the parts. No share is empty and, with enough CPUs, no two
    overlap.

    Raises:
        ValueError: no CPUs, or ``parts`` < 1.
    """
    if not cpus or parts < 1:
        raise ValueError(f"cannot split {len(cpus)} CPU(s) into {parts} share(s)")
    by_core: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(set(cpus)):
        by_core.setdefault(core(cpu), []).append(cpu)
    cores = sorted(by_core.values(), key=min)
    if len(cores) >= parts:
        return tuple(tuple(sorted(cpu for group in chunk for cpu in group))
                     for chunk in _even_runs(cores, parts))
    flat = [cpu for group in cores for cpu in group]
    if len(flat) >= parts:
        return tuple(tuple(sorted(chunk)) for chunk in _even_runs(flat, parts))
    return tuple((flat[i % len(flat)],) for i in range(parts))


def _even_runs(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """``items`` cut into ``parts`` consecutive runs whose lengths differ by at most one."""
    size, extra = divmod(len(items), parts)
    runs, at = [], 0
    for i in range(parts):
        length = size + (1 if i < extra else 0)
        runs.append(items[at:at + length])
        at += length
    return runs


def run_on(cpus: Sequence[int]) -> None:
    """Run this process (the agent, and the zygote and ranks it starts) on ``cpus``.

    Raises:
        ConfigError: ``cpus`` names CPUs this process may not use.
    """
    allowed = os.sched_getaffinity(0)
    if outside := set(cpus) - allowed:
        raise ConfigError(f"agent.cpus names CPUs {format_cpu_list(outside)} that this "
                          f"agent may not use: it may use {format_cpu_list(allowed)}")
    pin(os.getpid(), cpus)


def pin(pid: int, cpus: Iterable[int]) -> None:
    """Run process ``pid`` on ``cpus`` alone: every thread it has now (a warm spare has
    started torch's) and, by inheritance, every thread it starts later. A process that
    has died meanwhile is left to its watcher; one the agent may not pin is logged."""
    allowed = set(cpus)
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, allowed)
        except ProcessLookupError:
            continue  # that thread, or the whole process, has ended
        except OSError as exc:
            log.warning("cannot pin pid %d to CPUs %s: %s", pid, format_cpu_list(allowed), exc)
            return
