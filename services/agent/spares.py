"""Warm spares: processes of a job's command, started ahead, that a replacement is taken from.

A replacement started cold pays for Python, torch's import and the script's
model build before it can join: seconds, more on a loaded machine. A *spare*
has paid them already. The agent keeps, for each admitted job whose spec asks
for ``spares``, that many processes of the job's command on this node while
the node has free slots for them (:func:`~.core.spare_counts`): started with
the job's environment (:meth:`.RankSet.job_environment`) plus
:data:`~phalanx.schemas.environment.SPARE` and no replica identity, they run
the script up to ``ElasticSession.from_env`` (model built, data opened) and
wait there, blocked reading their standard input (:mod:`phalanx.runtime.spare`).

A spare is not a rank: no RankStarted or RankExited is published for it, it
counts toward no job's size and holds no slot (the heartbeat's ``slots_used``
leaves it out, so admission never waits for it). When a rank of the job
needs starting on this node (:meth:`.RankSet.replace`, an elastic job's new
slot), the oldest spare is taken: the agent writes it the replica's
variables as one JSON line and closes the pipe, and from then on it is that
replica, in the ranks table and reported as if launched now; the job's next spare
starts :data:`REPLENISH_AFTER_S` later. Its output file (``jobs/<job>/spares/<id>.log``)
becomes the replica's (``jobs/<job>/<replica>.log``, a rename: the process
goes on writing to it).

A spare that dies by itself is started again, backing off when it keeps
dying (:func:`~.core.spare_restart_delay`). Spares are stopped (SIGKILL to the
process group: nothing in them is worth a grace period) when their job ends
or leaves this node, when the node's free slots no longer hold them (a rank
was placed there), and when the agent stops. If the agent dies, a spare sees
its standard input end and exits by itself. A job keeps what its spec's ``spares``
asks; left unset, one, from when the job has a generation (its ranks run a phalanx
session: :func:`~.core.spares_wanted`; the agent follows the generations bucket and
calls :meth:`SpareSet.session_seen`).

On a node that lists GPUs, a spare runs on the GPUs of free slots, chosen when it
starts (``CUDA_VISIBLE_DEVICES``, ``PHALANX_DEVICE=cuda``; pinned to their CPUs as a
rank is): CUDA fixes a process's devices when it initialises, and a script builds
its model on the GPU before ``from_env``. Spares of different jobs are spread over
the free slots' GPUs. When it is taken, the replica it becomes runs in free slots on
those GPUs (:func:`~.core.slots_on_gpus`), not in the lowest free slots as a cold
start does; a spare whose GPUs no free slot offers any more (a rank was placed there,
a cordon) is stopped, and another starts where there is room.

A job whose replica is a group of S ranks (``ranks_per_replica``) keeps spare
*groups*: S processes, each started with torchrun's variables for its rank of
the group (:func:`~.core.group_variables`, on a ``MASTER_PORT`` of the spare
group's own), so the script's ``init_process_group``, device mesh and sharded
model are the group's before they wait. Taken, rank s of the spare group is
told it is rank s of the replacement (the same group variables, the replica's
identity), and the group joins as one. One process of a spare group that dies
breaks its rendezvous: the others are stopped with it, and the group starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from phalanx.schemas import environment
from phalanx.schemas.messages import JobRecord, JobState
from phalanx.schemas.replicas import member_log
from phalanx.services.agent import core
from phalanx.services.agent.core import JobUser
from phalanx.services.agent.logs import utc_now
from phalanx.services.agent.zygote import ChildProcess, Launcher
from phalanx.services.ports import group_master_port

log = logging.getLogger("phalanx.agent.spares")
#: After a spare is taken, how long before the job's next one starts: the replacement it
#: became joins first, without a new spare's imports and model build beside it.
REPLENISH_AFTER_S = 10.0


@dataclasses.dataclass(eq=False)  # its processes: equal only to itself, a key by identity
class Spare:
    """One warm spare of a job: one process, or a spare group's (rank 0 first)."""

    spare_id: str
    job_id: str
    processes: tuple[ChildProcess, ...]
    log_paths: tuple[Path, ...]  # each process's
    started_at: float  # time.time()
    gpus: tuple[int, ...] = ()  # the GPUs its processes see (none on a node of CPU slots)
    group_port: int = 0  # a spare group's MASTER_PORT, which the replica keeps
    stopping: bool = False
    watcher: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        """Every one of its processes runs."""
        return all(p.returncode is None for p in self.processes)

    async def hand_over(self, identities: Sequence[Mapping[str, str]],
                        log_paths: Sequence[Path]) -> tuple[ChildProcess, ...] | None:
        """Make this spare the replica ``identities`` name (one per process, in group rank
        order), each process writing to its ``log_paths`` entry from now on; its
        processes, or None if one is gone (then every one is killed)."""
        for process, identity, old, new in zip(self.processes, identities, self.log_paths,
                                               log_paths, strict=True):
            assert process.stdin is not None
            replica = identity.get(environment.REPLICA_ID, "?")
            with contextlib.suppress(OSError):  # a log not moved is no reason for a cold start
                old.replace(new)
            with new.open("ab") as log_file:
                log_file.write(f"=== phalanx: {replica} starting on warm spare "
                               f"{self.spare_id} (pid {process.pid}) at {utc_now()}\n"
                               .encode())
            try:
                process.stdin.write(json.dumps(dict(identity)).encode() + b"\n")
                await process.stdin.drain()
                process.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                break
        else:
            if self.alive:
                return self.processes
        self.kill()
        return None

    def kill(self) -> None:
        """SIGKILL each of its processes' process groups."""
        for process in self.processes:
            kill_group(process.pid)


def kill_group(pid: int) -> None:
    """SIGKILL a spare's process group (it runs in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class SpareSet:
    """The warm spares of the jobs running on this node.

    Args:
        node_id: this node.
        work_dir: the agent's; spares log to ``jobs/<job>/spares/<spare>.log`` there.
        capacity: the node's slots (None: unbounded).
        gpus: the GPU of each of the node's slots (empty: CPU slots).
        environment: job record -> what its processes start with
            (:meth:`.RankSet.job_environment`; raises ``OSError`` when it cannot be made).
        placed: the slots admitted replicas are placed on here (:meth:`.RankSet.slots_placed`).
        unusable: the node's slots that ranks hold or that are cordoned now, by index
            (where a spare's GPUs must not be).
        launcher: starts the processes (:mod:`.zygote`); None: each one cold.
        pin: pins a process to the CPUs of slots (:meth:`.RankSet.pin`).
        user: job id -> the user its processes run as (:meth:`.RankSet.job_user`); a
            spare runs as its job's, as the rank it becomes.
        confine / unconfine: put a spare's process in its memory cgroup as the rank it
            becomes is (:meth:`.RankSet.confine`), and remove that cgroup once a spare
            that was never taken has ended (a taken one's is its rank's).

    Spares start at the agent's priority, not niced as a cold replacement starts: a spare
    warms up ahead of any fault, so its imports and model build cost the job once, early,
    and niced beside ranks that keep the node's cores busy it could still be warming when
    the fault comes.
    """

    def __init__(self, node_id: str, work_dir: Path, capacity: int | None,
                 gpus: tuple[int, ...], environment: Callable[[JobRecord], dict[str, str]],
                 placed: Callable[[], int], unusable: Callable[[], set[int]] = set,
                 launcher: Launcher | None = None,
                 pin: Callable[[int, tuple[int, ...]], None] | None = None,
                 user: Callable[[str], JobUser | None] | None = None,
                 confine: Callable[[JobRecord, int, BinaryIO], None] | None = None,
                 unconfine: Callable[[str, Collection[int]], None] | None = None) -> None:
        self.node_id = node_id
        self.user = user
        self.confine = confine
        self.unconfine = unconfine
        self.unusable = unusable
        self.pin = pin
        self.launcher = launcher or Launcher(work_dir, zygotes=False)
        self.work_dir = work_dir
        self.capacity = capacity
        self.gpus = gpus
        self.environment = environment
        self.placed = placed
        self.records: dict[str, JobRecord] = {}  # jobs that may want spares here, oldest first
        self.sessions: set[str] = set()  # jobs whose ranks run a phalanx session
        self.spares: dict[str, list[Spare]] = {}
        self.failures: dict[str, int] = {}  # job -> spares that died by themselves in a row
        self._held: dict[str, float] = {}  # job -> no restart before this (monotonic)
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def running(self, job_id: str) -> list[Spare]:
        """The job's spares that are alive and not being stopped, oldest first."""
        return [s for s in self.spares.get(job_id, ())
                if not s.stopping and s.alive]

    async def reconcile(self, record: JobRecord) -> None:
        """Keep the spares ``record`` asks for here (none once it is not admitted here),
        and re-balance every job's to the node's free slots."""
        if record.state is JobState.ADMITTED and record.spec.spares != 0 \
                and self.node_id in record.nodes:
            self.records[record.job_id] = record
        else:
            self.records.pop(record.job_id, None)
        await self.refresh()

    async def session_seen(self, job_id: str, running: bool = True) -> None:
        """The job has a generation (``running``), or no longer has one: its spares by
        default follow (:func:`~.core.spares_wanted`)."""
        known = job_id in self.sessions
        if running:
            self.sessions.add(job_id)
        else:
            self.sessions.discard(job_id)
        record = self.records.get(job_id)
        if known != running and record is not None and record.spec.spares is None:
            await self.refresh()

    async def drop(self, job_id: str) -> None:
        """The job is gone: stop its spares."""
        self.records.pop(job_id, None)
        await self.refresh()

    def placeable(self, job_id: str, unusable: set[int]) -> tuple[Spare, tuple[int, ...]] | None:
        """The job's oldest running spare that can run as a replica with the node's
        ``unusable`` slots out of reach, and the slots it would hold (``()`` on a node of
        CPU slots: any free ones); None if there is none."""
        for spare in self.running(job_id):
            slots = core.slots_on_gpus(self.gpus, unusable, spare.gpus)
            if slots is not None:
                return spare, slots
        return None

    def take(self, job_id: str, unusable: set[int]) -> tuple[Spare, tuple[int, ...]] | None:
        """:meth:`placeable`'s spare, no longer a spare from now on, and its slots."""
        found = self.placeable(job_id, unusable)
        if found is None:
            return None
        spare, slots = found
        self.spares[job_id].remove(spare)
        if spare.watcher is not None:
            spare.watcher.cancel()  # its exit is the replica's now
        self.failures.pop(job_id, None)
        log.info("spare taken", extra={"job": job_id, "spare": spare.spare_id,
                                       "pids": [p.pid for p in spare.processes],
                                       "waited_s": round(time.time() - spare.started_at, 3)})
        return spare, slots

    def replenish(self, job_id: str) -> None:
        """Start ``job_id``'s next spare :data:`REPLENISH_AFTER_S` after one was taken."""
        self._held[job_id] = max(self._held.get(job_id, 0.0),
                                 time.monotonic() + REPLENISH_AFTER_S)
        self._spawn(self._refresh_when_released(job_id))

    async def refresh(self) -> None:
        """Start and stop spares so that each job has what :func:`~.core.spare_counts`
        gives it now."""
        async with self._lock:
            if self._closed:
                return
            counts = core.spare_counts(
                self.capacity, self.placed(),
                [(job, core.spares_wanted(r.spec.spares, r.spec.session or job in self.sessions),
                  r.spec.slots_per_group) for job, r in self.records.items()])
            if self.gpus:  # first those whose GPUs no free slot offers any more
                kept = self._gpu_slots()
                for spare in [s for spares in self.spares.values() for s in spares
                              if not s.stopping and s not in kept]:
                    await self._stop(spare)
            for job_id in list(self.spares):
                running = self.running(job_id)
                # The newest go first: the oldest are likeliest to be ready.
                for spare in running[counts.get(job_id, 0):][::-1]:
                    await self._stop(spare)
            now = time.monotonic()
            for job_id, count in counts.items():
                if self._held.get(job_id, 0.0) > now:
                    continue  # backing off after spares that died
                for _ in range(count - len(self.running(job_id))):
                    if not await self._start(self.records[job_id]):
                        break

    async def stop_all(self) -> None:
        """Stop every spare for good (the agent is stopping)."""
        async with self._lock:
            self._closed = True
            for spare in [s for spares in self.spares.values() for s in spares]:
                await self._stop(spare)
        for task in list(self._tasks):
            task.cancel()

    def _gpu_slots(self) -> dict[Spare, tuple[int, ...]]:
        """The running spares that free slots on their GPUs hold, oldest job's first, each
        with those slots (no two spares share one)."""
        taken = set(self.unusable())
        kept: dict[Spare, tuple[int, ...]] = {}
        for job_id in self.spares:
            for spare in self.running(job_id):
                slots = core.slots_on_gpus(self.gpus, taken, spare.gpus)
                if slots is not None:
                    kept[spare] = slots
                    taken.update(slots)
        return kept

    def _slots(self, record: JobRecord) -> tuple[int, ...] | None:
        """The slots whose GPUs a new spare runs on: on a GPU node, the lowest free slots no
        other spare holds (None if there are not enough); ``()`` on CPU slots."""
        if not self.gpus:
            return ()
        taken = set(self.unusable()).union(*self._gpu_slots().values())
        slots = core.node_slots(taken, record.spec.slots_per_group)
        return None if slots[-1] >= len(self.gpus) else slots

    def _variables(self, record: JobRecord, slots: tuple[int, ...],
                   port: int) -> list[dict[str, str]]:
        """Each process's placement variables in a new spare holding ``slots`` (``()`` on
        CPU slots): a world of its own, as the replica of one rank it becomes (its
        script's ``init_process_group`` runs before it is named); or, in a spare group,
        its rank of the group meeting on ``port``, as in the replica group it becomes."""
        ranks = record.spec.ranks_per_replica
        if ranks == 1:
            # Its LOCAL_RANK is a world of one's (0), as the replica's it becomes: it sees
            # its slots' GPUs alone.
            return [{**(core.rank_devices(self.gpus, slots) if self.gpus else {}),
                     **environment.WORLD_OF_ONE}]
        return [{**core.group_variables(self.gpus, share, g, ranks, port),
                 **environment.RankEnvironment(ranks_per_replica=ranks,
                                               group_rank=g).to_env()}
                for g, share in enumerate(core.group_slots(slots, ranks) if slots
                                          else [()] * ranks)]

    async def _start(self, record: JobRecord) -> bool:
        slots = self._slots(record)
        if slots is None:
            return False  # no free GPU for it: the next refresh tries again
        spare_id = f"spare-{next(self._ids)}"
        group = record.spec.ranks_per_replica > 1
        try:
            port = group_master_port(f"{record.job_id}/{spare_id}") if group else 0
        except OSError as exc:
            log.warning("cannot start a spare of %s: %s", record.job_id, exc)
            self._died(record.job_id)
            return False
        folder = self.work_dir / "jobs" / record.job_id / "spares"
        folder.mkdir(parents=True, exist_ok=True)
        started: list[ChildProcess] = []
        log_paths: list[Path] = []
        for g, variables in enumerate(self._variables(record, slots, port)):
            log_paths.append(folder / f"{member_log(spare_id, g if group else None)}.log")
            with log_paths[-1].open("ab") as log_file:
                log_file.write(f"=== phalanx: warm spare {spare_id} of {record.job_id} "
                               f"starting on {self.node_id} at {utc_now()}\n".encode())
                log_file.flush()
                try:
                    env = {**self.environment(record), **variables,
                           environment.SPARE: spare_id}
                    process = await self.launcher.start(
                        record.spec.command, env, log_file, stdin=True,
                        user=None if self.user is None else self.user(record.job_id))
                    started.append(process)
                    if self.confine is not None:  # not held: its imports have begun
                        self.confine(record, process.pid, log_file)
                except OSError as exc:
                    log.warning("cannot start a spare of %s: %s", record.job_id, exc)
                    await self._abandon(record.job_id, started)
                    return False
        if self.gpus and self.pin is not None:
            shares = core.group_slots(slots, record.spec.ranks_per_replica)
            for process, share in zip(started, shares, strict=True):
                self.pin(process.pid, share)
        spare = Spare(spare_id, record.job_id, tuple(started), tuple(log_paths), time.time(),
                      gpus=tuple(self.gpus[s] for s in slots), group_port=port)
        self.spares.setdefault(record.job_id, []).append(spare)
        spare.watcher = asyncio.create_task(self._watch(spare))
        log.info("spare started", extra={"job": record.job_id, "spare": spare_id,
                                         "pids": [p.pid for p in started]})
        return True

    async def _abandon(self, job_id: str, started: list[ChildProcess]) -> None:
        """A spare could not start whole: kill what of it did (a group short of a rank
        never meets), and start another after the back-off."""
        for process in started:
            kill_group(process.pid)
            await process.wait()
        if started and self.unconfine is not None:
            self.unconfine(job_id, [p.pid for p in started])
        self._died(job_id)

    async def _stop(self, spare: Spare) -> None:
        spare.stopping = True
        spare.kill()
        if spare.watcher is not None:
            await asyncio.shield(spare.watcher)

    async def _watch(self, spare: Spare) -> None:
        waits = [asyncio.ensure_future(p.wait()) for p in spare.processes]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            code = next(iter(done)).result()
            if len(waits) > 1:
                spare.kill()  # one of a group gone: the rest can never meet a replica's
                await asyncio.gather(*waits)
        finally:
            for wait in waits:  # taken (cancelled): its exits are the replica's now
                wait.cancel()
        spares = self.spares.get(spare.job_id, [])
        if spare in spares:
            spares.remove(spare)
            if self.unconfine is not None:  # never taken: its cgroup is nobody's
                self.unconfine(spare.job_id, [p.pid for p in spare.processes])
        if not spares:
            self.spares.pop(spare.job_id, None)
        log.info("spare exited", extra={"job": spare.job_id, "spare": spare.spare_id,
                                        "pids": [p.pid for p in spare.processes],
                                        "exit_code": code, "stopped": spare.stopping})
        if not spare.stopping and not self._closed:
            self._died(spare.job_id)

    def _died(self, job_id: str) -> None:
        """A spare of ``job_id`` died by itself (or could not start): start another after
        the back-off."""
        self.failures[job_id] = self.failures.get(job_id, 0) + 1
        delay = core.spare_restart_delay(self.failures[job_id])
        self._held[job_id] = time.monotonic() + delay
        self._spawn(self._refresh_when_released(job_id))

    async def _refresh_when_released(self, job_id: str) -> None:
        held = self._held.get(job_id, 0.0)
        await asyncio.sleep(max(0.0, held - time.monotonic()))
        # The hold is over, whatever the clock says: uvloop's timers may fire up to a
        # millisecond early, and a refresh still inside it would start nothing. A hold
        # made longer meanwhile has its own task to end it.
        if self._held.get(job_id) == held:
            del self._held[job_id]
        await self.refresh()

    def _spawn(self, work: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
