"""Elastic data-parallel training inside a rank: membership changes without a restart.

A training script hands its model and optimizer (and any other state to
carry, such as an LR scheduler) to an :class:`ElasticSession` and runs its
usual loop over :meth:`ElasticSession.steps`::

    session = ElasticSession.from_env(model, optimizer, dataset, global_batch=64,
                                      state={"scheduler": scheduler})
    for step in session.steps(total_steps):
        for x, y in step:
            step.backward(loss_fn(model(x), y))
        step.clip_grad_norm_(1.0)           # on the all-reduced gradient
        if step.commit():                   # False: aborted, it runs again
            scheduler.step()
    if session.is_primary:
        torch.save(model.state_dict(), path)
    session.close()

What the session does around that loop:

* **Membership.** The rank's replica reports *ready* (model built) and trains
  in whatever generation elasticity publishes. Each generation gets a fresh
  gloo process group, rendezvousing through the store of the generation's
  rank 0 under the generation's own namespace; every replica hosts such a
  store, so no single process is needed across generations.
* **Step boundaries.** A *join* is applied between steps, at the same step on
  every member: each gradient all-reduce carries one extra number, how many
  members have seen a newer generation, so all of them switch after the same
  step. A *leave* (a planned shrink: admission took the slots of some members)
  is switched the same way: the leaving members take part in every step up to
  and including the one after which everyone switches, commit it, and then end
  with :class:`LeftTheJob` (status 0) while the others go on in the new
  generation; no step is aborted and no sample is lost or repeated.
* **Faults.** A fault of a member (announced on the bus by health) or a
  *fault* generation aborts the in-flight all-reduce at once on every rank:
  the rank stops waiting for it, abandons that process group (its gloo
  threads are left to time out; their buffers are never reused) and discards
  the partial step. The gloo timeout is only a last resort.
* **State.** After rebuilding, the members agree on the resume step (the
  highest step any of them committed, by one all-reduce); members behind it,
  and joiners, receive model, optimizer, registered objects (``state=`` /
  :meth:`ElasticSession.register`), RNG and step from the lowest rank that
  has it, peer to peer (:mod:`.state`).
* **A step** is reduce (:meth:`Step.reduce`: gradients, the loss and the
  script's metrics summed over the ranks, abortably), then apply
  (:meth:`Step.commit`: ``optimizer.step()``). Between the two every rank
  holds the same global gradient: clipping and skip-on-inf go there.
* **Who holds the result.** ``session.rank`` is None until the replica is a
  member; :attr:`ElasticSession.is_primary` is True only on rank 0 of the last
  generation it applied (alone: always). A replica the job completes without
  (still starting or waiting to join when the last step is committed) never
  returns from :meth:`ElasticSession.steps`: it raises
  :class:`JobCompletedWithoutThisReplica`, a ``SystemExit`` with status 0, so
  code after the loop (a save of its untrained parameters) does not run. A
  stop (the agent's SIGTERM) while waiting ends the process by the signal.
* **Data.** Step ``s`` trains on the samples :class:`~.data.ElasticOrder`
  assigns to ``(epoch, step)`` and this rank, in micro-batches weighted by
  ``len / global_batch``; gradients are *summed*, so the global batch and
  the learning rate are the same at every world size. ``on_membership`` lets
  a user change them per world size instead.

Outside phalanx (no ``PHALANX_JOB_ID``) the same script runs alone, as world
size 1, with the same data order: that is the fault-free reference.

With ``PHALANX_RECORD_DIR`` set, every replica appends what it did to
``<dir>/<replica>.jsonl``: the samples of each step it took part in (written
before its gradients leave the process), each commit, each generation it
applied with the time of every phase. Tests and benchmarks check those.

This module is the session: membership, generations and the step's
collectives. The other concepts live beside it: :mod:`.step` (one step's
loop, reduce and apply), :mod:`.inbox` (what the bus thread hands over),
:mod:`.group` (abortable waits and the rendezvous), :mod:`.recovery` (the
pure recovery plan), :mod:`.state` (the state copy), :mod:`.reduce` (the
bucketed all-reduce), :mod:`.chaos` (fault injection) and :mod:`.record`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import torch
import torch.distributed as dist
from opentelemetry import context as otel_context
from torch.distributed.optim import ZeroRedundancyOptimizer

from phalanx.bus import telemetry
from phalanx.bus.config import BusConfig
from phalanx.runtime import chaos, priority, teardown
from phalanx.runtime.bus_thread import BusThread
from phalanx.runtime.chaos import Pace, parse_chaos_kill, parse_chaos_pace
from phalanx.runtime.data import ElasticOrder, MicroBatch
from phalanx.runtime.dataset import step_loader
from phalanx.runtime.durable import (
    Committed,
    DurableCorrupt,
    DurablePolicy,
    DurableWriter,
    Persisted,
    committed_records,
    corrupt_records,
)
from phalanx.runtime.durable import restore as restore_durable
from phalanx.runtime.epochs import EpochLoader, EpochLoop
from phalanx.runtime.group import Aborted, Waits, rendezvous
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.progress import ProgressReporter
from phalanx.runtime.record import Recorder
from phalanx.runtime.recovery import MemberProgress, StateLost, plan_recovery
from phalanx.runtime.reduce import (
    BucketedReduce,
    bucket_plan,
    flat_gradients,
    write_gradients,
)
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.snapshot import Snapshotter, restore
from phalanx.runtime.snapshot_file import Header
from phalanx.runtime.snapshot_interval import TAIL_LENGTH, IntervalPolicy, SnapshotSchedule
from phalanx.runtime.state import (
    StateTransferError,
    landing_buffers,
    receive_state,
    send_state,
)
from phalanx.schemas import subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    Fault,
    Generation,
    GenerationApplied,
    GenerationReason,
    RankProgress,
    ReplicaReady,
    SnapshotRecord,
    SnapshotTier,
    StateSource,
)

log = logging.getLogger("phalanx.runtime")
#: How long leaving waits for a durable write under way (the job's last step, often).
DURABLE_FLUSH_S = 60.0


class Dropped(RuntimeError):
    """This replica is not a member of the job's newest generation."""


class JobCompletedWithoutThisReplica(SystemExit):
    """The job's last step was committed before this replica became a member.

    It holds no trained state (its parameters are the initial ones), so nothing
    after the training loop may run as if it did. Raised by
    :meth:`ElasticSession.steps` after :meth:`ElasticSession.close`: a ``SystemExit``
    with status 0, so ``except Exception`` does not catch it, ``finally`` blocks and
    context managers still run, and the process ends as a successful one (the job's
    completion is not its failure).
    """

    def __init__(self, job_id: str, replica_id: str, step: int) -> None:
        super().__init__(0)
        self.job_id, self.replica_id, self.step = job_id, replica_id, step

    def __str__(self) -> str:
        return (f"{self.job_id} completed (step {self.step}) before {self.replica_id} "
                "became a member: it holds no trained state")


class LeftTheJob(SystemExit):
    """This replica left the job in a planned shrink, after the step the members switched
    at (it committed it, like everyone else).

    Raised by :meth:`ElasticSession.steps` after :meth:`ElasticSession.close`: a
    ``SystemExit`` with status 0 — the replica did its part — so code after the training
    loop (a save, an evaluation of the final model) does not run on a process that holds
    the state of a step the job has since gone past.
    """

    def __init__(self, job_id: str, replica_id: str, step: int, generation: int) -> None:
        super().__init__(0)
        self.job_id, self.replica_id = job_id, replica_id
        self.step, self.generation = step, generation

    def __str__(self) -> str:
        return (f"{self.replica_id} left {self.job_id} after step {self.step}: generation "
                f"{self.generation} goes on without it")


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """Passed to ``on_membership`` after each generation is applied."""

    generation: int
    world_size: int
    rank: int
    resume_step: int


@dataclasses.dataclass(frozen=True)
class Retained:
    """A step's local gradient kept when its all-reduce was aborted, to be reused."""

    step: int
    generation: Generation  # the one the step was attempted in
    gradient: torch.Tensor  # this rank's summed share, not yet all-reduced
    indices: list[int]  # the samples it covers
    metrics: torch.Tensor  # their share of the loss and of the script's metrics (float64)


#: How a replica's log line of an applied generation names a state that came from a tier.
_FROM = {StateSource.MEMORY: " (restored from the nodes' memory)",
         StateSource.BUDDY: " (restored from the nodes' memory and buddy replicas)",
         StateSource.DURABLE: " (restored from durable storage)",
         StateSource.OLDER: " (the step the job had reached was lost: trained again)",
         StateSource.START: " (the job's state was lost: from the start)"}


class ElasticSession:
    """A rank's membership, process group, state and data order.

    Args:
        model / optimizer: what to train; the session never wraps them.
        dataset: map-style; if it has ``batch(indices)`` (and no ``loader`` options are
            given) that is used for a micro-batch, else a standard DataLoader.
        loader: options of the ``DataLoader`` that reads the micro-batches
            (``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor`` ...);
            the session owns the sampling. With workers, they are persistent and read
            a step's next micro-batches while the current one computes.
        global_batch: samples per optimizer step across all ranks.
        micro_batch_size: the most samples one forward pass takes (gradient accumulation).
        seed: fixes the data order.
        bus: the bus thread (None: alone, world size 1).
        job_id / replica_id / slot / node_id: who this rank is.
        record_dir: where to append this replica's record (None: no record).
        checksum: verify every state copy with Adler-32.
        collective_timeout_s: gloo's own timeout, the last resort.
        on_membership: called after each applied generation.
        deterministic: make the summed gradient bitwise independent of the world size: the
            global batch is cut into the same micro-batches at any size, each micro-batch's
            gradient is accumulated and all-reduced in float64 (exact for these sums), then
            rounded once. The model is then the same whatever the membership did, at the
            cost of twice the all-reduce bytes and shares even to a micro-batch.
        warmup: one forward and backward pass of the user's, run before the replica
            reports ready, so its first real step (the survivors wait for it when it
            joins) is not slowed by cold caches and first allocations.
        nice_when_ready: the nice value to return to once ready (an agent starts a
            replacement at a lower CPU priority: :mod:`.priority`); None: unchanged.
        chaos_kill: ``(step, phase)`` at which this process SIGKILLs itself, ``phase``
            ``"boundary"`` (before the step), ``"allreduce"`` (while its all-reduce runs) or
            ``"update"`` (in the optimizer step: :mod:`.chaos`).
        chaos_pace: a slowed job (:class:`.chaos.Pace`): it waits before each step until
            released.
        state: name -> object with ``state_dict``/``load_state_dict`` (LR schedulers, an
            EMA, a loss scaler) carried with the model and optimizer to every replica that
            receives state; more with :meth:`register`.
        metrics: names of scalars the script adds per step with :meth:`Step.add`; each is
            summed over the ranks with the gradients (the loss always is).
        snapshot_interval: which committed steps to snapshot this rank's share of the
            state after, into its node agent's shared memory (:mod:`.snapshot`): a fixed
            interval or one adapted to the measured cost (:mod:`.snapshot_interval`);
            None: never.
        snapshot_keep: buffers in each share's ring (2: double-buffered).
        snapshot_dir: the node's snapshot store for this job (where a restore reads).
        durable: the job's durable tier (:mod:`.durable`): where snapshots are persisted
            every ``durable.every`` steps, and where a job whose members and nodes hold
            nothing newer resumes from (its own steps, or ``durable.resume_from``'s).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dataset: Any, *, global_batch: int, micro_batch_size: int | None = None,
                 seed: int = 0, bus: BusThread | None = None, job_id: str = "local",
                 replica_id: str = "r0-0", slot: int = 0, node_id: str = "local",
                 record_dir: str | None = None, checksum: bool = False,
                 collective_timeout_s: float = 30.0,
                 on_membership: Callable[[MembershipChange], None] | None = None,
                 deterministic: bool = False, warmup: Callable[[], None] | None = None,
                 nice_when_ready: int | None = None,
                 chaos_kill: tuple[int, str] | None = None, chaos_pace: Pace | None = None,
                 state: Mapping[str, Any] | None = None, metrics: Sequence[str] = (),
                 loader: Mapping[str, Any] | None = None,
                 snapshot_interval: IntervalPolicy | None = None, snapshot_keep: int = 2,
                 snapshot_dir: str | None = None,
                 durable: DurablePolicy | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        #: A sharded optimizer's handle (:mod:`.sharded`); None for a plain optimizer.
        self._sharded = Sharded(optimizer) \
            if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        self.dataset = dataset
        self.order = ElasticOrder(len(dataset), global_batch, seed)
        self._loader = step_loader(dataset, loader)
        self.micro_batch_size = micro_batch_size or global_batch
        self.bus = bus
        self.job_id = job_id
        self.replica_id = replica_id
        self.slot = slot
        self.node_id = node_id
        self.checksum = checksum
        self.timeout = datetime.timedelta(seconds=collective_timeout_s)
        self.on_membership = on_membership
        self.deterministic = deterministic
        self.chaos_kill = chaos_kill
        self.chaos_pace = chaos_pace
        self._state: dict[str, Any] = {}
        self._started = False  # a step was taken: the registered state is fixed
        for name, obj in (state or {}).items():
            self.register(name, obj)
        self.metric_names = tuple(metrics)
        if len(set(self.metric_names)) != len(self.metric_names) or "loss" in metrics:
            raise ValueError(f"metrics must be distinct names other than 'loss', got "
                             f"{list(metrics)}")
        self._accumulated: torch.Tensor | None = None  # float64 gradient sum (deterministic)
        self._retained: Retained | None = None  # from an aborted step
        # The step given up last, when and why: a span of the generation that ends the wait.
        self._aborted: tuple[int, int, str] | None = None
        self._reduce: BucketedReduce | None = None  # the step's all-reduce, once armed
        self._buckets: list[list[int]] | None = None
        # The buckets of the last completed all-reduce, reused; dropped after an abort.
        self._bucket_buffers: list[torch.Tensor] | None = None
        # A repaired step: (step, this rank's plan, its kept gradient if it has one).
        self._repair: tuple[int, list[MicroBatch], Retained | None] | None = None
        # The first step after a state copy: (step, the ranks that compute it).
        self._sitting_out: tuple[int, list[int]] | None = None
        self.committed = 0  # steps committed: the next step to run
        self.generation: Generation | None = None
        # None while not a member (never taken in, or dropped): such a replica holds no
        # trained state, and `rank == 0` must not single it out to save.
        self.rank: int | None = 0 if bus is None else None
        self.world_size = 1
        self.pg: dist.ProcessGroup | None = None
        self.last_step_s = 0.0
        self._last_commit_at: float | None = None  # perf_counter of this process's last commit
        self._switch_agreed = False  # the last all-reduce said: switch to the next generation
        self._applied: GenerationApplied | None = None  # to report after the next commit
        # The committed step whose snapshot, record and report wait for the boundary after
        # the script's post-commit code: (step, commit time, the step time before, the
        # commit before).
        self._boundary: tuple[Step, float, float, float | None] | None = None
        self._restored_from = StateSource.MEMBERS  # where the last applied state came from
        self._total_steps = 0
        self._inbox = Inbox(replica_id)
        self._waits = Waits(self._inbox, self._heartbeat)
        self._loop = EpochLoop(self)  # the DDP-shaped loop: epochs(), loader, backward, commit
        self._record = None if record_dir is None else Recorder(record_dir, replica_id)
        self._progress: ProgressReporter | None = None
        self._store: dist.TCPStore | None = None
        self._stores: dict[str, dist.Store] = {}
        self._landing: list[torch.Tensor] = []  # for the optimizer state a joiner receives
        self.nice_when_ready = nice_when_ready
        self.snapshot_dir = snapshot_dir
        self.durable = durable
        writer = DurableWriter(durable.url, durable.keep, self._persisted) \
            if durable is not None and durable.every and bus is not None else None
        self._snapshots = Snapshotter(
            bus, job_id, replica_id, node_id, keep=snapshot_keep, durable=writer,
            schedule=SnapshotSchedule(dataclasses.replace(
                snapshot_interval, durable_every=durable.every if durable else 0))) \
            if bus is not None and snapshot_interval is not None and snapshot_dir else None
        if warmup is not None and bus is not None:
            warmup()
            optimizer.zero_grad(set_to_none=False)  # the gradients' memory stays touched
        if bus is not None:
            self._connect(bus)

    @classmethod
    def from_env(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any,
                 *, env: Mapping[str, str] | None = None, **kwargs: Any) -> ElasticSession:
        """The session of the replica an agent launched, or a lone one outside phalanx.

        Reads ``PHALANX_NATS_URL``, ``PHALANX_JOB_ID``, ``PHALANX_REPLICA_ID``,
        ``PHALANX_RANK`` (the slot), ``PHALANX_NODE_ID``, and optionally
        ``PHALANX_RECORD_DIR``, ``PHALANX_STATE_CHECKSUM=1``, ``PHALANX_DETERMINISTIC=1`` and
        ``PHALANX_CHAOS_KILL=<replica>:<step>:<boundary|allreduce|update>[,...]`` (fault injection).
        ``PHALANX_ADVERTISE_HOST`` is the address peers reach this replica's store at
        (set by the agent to its node's host; default 127.0.0.1). ``PHALANX_NICE_WHEN_READY``
        is set by the agent that started this replica at a lower CPU priority.

        Raises:
            BusUnavailable: the bus cannot be reached at start (no generation to join).
            ConfigError: a malformed ``PHALANX_CHAOS_KILL``.
        """
        env = os.environ if env is None else env
        kwargs.setdefault("record_dir", env.get("PHALANX_RECORD_DIR") or None)
        kwargs.setdefault("checksum", env.get("PHALANX_STATE_CHECKSUM") == "1")
        kwargs.setdefault("deterministic", env.get("PHALANX_DETERMINISTIC") == "1")
        if env.get("PHALANX_SNAPSHOT_DIR"):  # set by the agent with the job's checkpoint policy
            kwargs.setdefault("snapshot_dir", env["PHALANX_SNAPSHOT_DIR"])
            kwargs.setdefault("snapshot_interval", IntervalPolicy.from_env(env))
            kwargs.setdefault("durable", DurablePolicy.from_env(env))
            kwargs.setdefault("snapshot_keep", int(env.get("PHALANX_CHECKPOINT_MEMORY_KEEP",
                                                           "2")))
        if env.get(priority.ENV, "").lstrip("-").isdigit():
            kwargs.setdefault("nice_when_ready", int(env[priority.ENV]))
        if not env.get("PHALANX_JOB_ID") or not env.get("PHALANX_NATS_URL"):
            kwargs.setdefault("replica_id", "local")
            return cls(model, optimizer, dataset, **kwargs)
        replica_id = env.get("PHALANX_REPLICA_ID") or f"r{env.get('PHALANX_RANK', '0')}-0"
        chaos_kill = parse_chaos_kill(env.get("PHALANX_CHAOS_KILL", ""), replica_id)
        kwargs.setdefault("chaos_pace", parse_chaos_pace(env.get("PHALANX_CHAOS_PACE", "")))
        telemetry.setup_tracing("phalanx-rank", env)  # off unless OTEL_* asks for it
        bus = BusThread(BusConfig.load(env=env), f"rank:{env['PHALANX_JOB_ID']}:{replica_id}")
        return cls(model, optimizer, dataset, bus=bus.start(), job_id=env["PHALANX_JOB_ID"],
                   replica_id=replica_id, slot=int(env.get("PHALANX_RANK", "0")),
                   node_id=env.get("PHALANX_NODE_ID", "local"), chaos_kill=chaos_kill, **kwargs)

    def register(self, name: str, obj: Any) -> None:
        """Carry ``obj``'s state with the model and optimizer (before the first step).

        ``obj`` has ``state_dict()`` and ``load_state_dict()``: an LR scheduler, an EMA
        of the weights, a loss scaler, a metric's running state. A replica that receives
        its state from a peer (a joiner, a replacement, a member behind the resume
        step) loads the peer's ``state_dict`` into it, after the optimizer's, with the
        same checks; every replica must register the same names.

        Raises:
            TypeError: ``obj`` lacks ``state_dict``/``load_state_dict``.
            ValueError: ``name`` is taken, or the session has taken a step already.
        """
        if not callable(getattr(obj, "state_dict", None)) \
                or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"{name!r}: {type(obj).__name__} has no state_dict/load_state_dict")
        if name in self._state:
            raise ValueError(f"{name!r} is registered already")
        if self._started:
            raise ValueError(f"register {name!r} before the first step: a replica that "
                             "received state without it would differ from its peers")
        self._state[name] = obj

    def __enter__(self) -> ElasticSession:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        teardown.exit_status(exc)
        if exc is not None:  # the script failed after its last commit: no boundary to keep
            self._boundary = None
        self.close()

    # --- the bus side (runs on the bus thread) ---------------------------------------------

    def _connect(self, bus: BusThread) -> None:
        # Every replica hosts a store; a generation rendezvouses on its rank 0's.
        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                    timeout=self.timeout, use_libuv=True)
        host = os.environ.get("PHALANX_ADVERTISE_HOST", "127.0.0.1")
        self.endpoint = f"{host}:{self._store.port}"
        self._progress = ProgressReporter(None, self.job_id, self.slot,
                                          replica_id=self.replica_id, bus=bus)
        bus.subscribe(subjects.job_generation(self.job_id), Generation,
                      self._inbox.on_generation)
        bus.subscribe(subjects.job_fault(self.job_id), Fault, self._inbox.on_fault)
        bus.subscribe(subjects.health_job_ranks(self.job_id), RankProgress,
                      self._inbox.on_progress)
        stored = bus.run(self._stored_generation(bus), 10)
        if stored is not None:
            self._inbox.on_generation(stored, None)
            if stored.member(self.replica_id) is None and self._sharded is None:
                self._landing = landing_buffers(self.optimizer)  # joining a running job
        assert bus.bus is not None
        bus.bus.on_reconnect(lambda: self._resync_generation(bus))
        if self.nice_when_ready is not None:
            priority.restore(self.nice_when_ready)
        self._announce()

    async def _resync_generation(self, bus: BusThread) -> None:
        """After a bus outage: a generation published meanwhile was missed; the stored
        one is the newest (members waiting for it would otherwise wait forever)."""
        for attempt in range(20):  # JetStream may take a moment to come back with the server
            try:
                stored = await self._stored_generation(bus)
            except (PhalanxError, TimeoutError, OSError, nats.errors.Error) as exc:
                log.debug("reading the stored generation (attempt %d): %s", attempt, exc)
                await asyncio.sleep(0.25)
                continue
            if stored is not None:
                self._inbox.on_generation(stored, None)
            return
        log.warning("could not read the stored generation after reconnecting")

    async def _stored_generation(self, bus: BusThread) -> Generation | None:
        from phalanx.bus.kv import TypedKV  # the KV helpers are only needed here

        assert bus.bus is not None
        kv = await TypedKV.open(bus.bus.js, subjects.GENERATIONS_BUCKET, Generation)
        entry = await kv.get(self.job_id)
        return None if entry is None else entry.value

    def _announce(self) -> None:
        assert self.bus is not None
        # Repeats within the stream's duplicate window are stored once.
        self.bus.publish_event(subjects.replica_ready(self.job_id), ReplicaReady(
            job_id=self.job_id, replica_id=self.replica_id, slot=self.slot,
            node_id=self.node_id, endpoint=self.endpoint, committed_step=self.committed,
            sent_at=time.time()), f"{self.job_id}-{self.replica_id}-ready")

    # --- waiting (training thread) -----------------------------------------------------------

    def _must_abort(self) -> bool:
        """A member of the current generation failed, or a fault generation replaced it."""
        return self._inbox.must_abort(self.generation)

    def _wait(self, work: dist.Work) -> None:
        """Wait for ``work``; raise :class:`Aborted` the moment the generation is abandoned."""
        self._waits.work(work, self._must_abort)

    def _heartbeat(self) -> None:
        """Progress while waiting: a rank waiting for its peers is not hung (in collectives,
        rendezvous and store calls alike; the reporter sends at most one per 0.1 s)."""
        if self._progress is not None and self.generation is not None:
            self._progress.report(max(self.committed, 0), self.last_step_s)

    # --- the training loop ---------------------------------------------------------------

    @property
    def is_primary(self) -> bool:
        """Whether this replica is the one to write what the training produced.

        True alone (world size 1), and under phalanx on the member that is rank 0 of
        the last generation it applied; False on a replica that never became a member
        or was dropped. Before the first step it is decided by the job's newest
        generation (waiting for the first one if none is known yet), so a one-time
        message after :meth:`from_env` is printed by one replica. After :meth:`steps`
        returns, every member holds the same final state, so saving on the primary
        writes it once::

            if session.is_primary:
                torch.save(model.state_dict(), path)
        """
        if self.bus is not None and self.generation is None and not self._started:
            self._wait_for_newer(-1, 1)  # the first generation (or the job's first step)
            newest = self._inbox.newest()[0]
            member = None if newest is None else newest.member(self.replica_id)
            return member is not None and member.rank == 0
        return self.rank == 0

    def steps(self, total_steps: int) -> Iterator[Step]:
        """Steps ``committed .. total_steps-1``; a step aborted by a fault is run again.

        Returns only on a replica that committed step ``total_steps - 1``.

        Raises:
            Dropped: this replica is no longer a member (it was judged failed).
            LeftTheJob: this replica left in a planned shrink (a ``SystemExit`` with status
                0, raised after :meth:`close`).
            JobCompletedWithoutThisReplica: the job completed before this replica became
                a member (a ``SystemExit`` with status 0, raised after :meth:`close`).
        """
        self._total_steps = total_steps
        if self._progress is not None:
            self._progress.total_steps = total_steps
        self._started = True
        while self.committed < total_steps:
            self._finish_commit()
            if not self._ensure_membership(total_steps):
                self._leave_without_joining()
            if self.chaos_kill == (self.committed, "boundary"):
                self._chaos_kill()
            if self.chaos_pace is not None:
                self.chaos_pace.wait()
            step = Step(self, self.committed)
            yield step
            if step.outcome is None:
                raise RuntimeError(f"step {step.index} was not committed: call step.commit()")
        self._finish_commit()

    # --- the DDP-shaped loop (runtime/epochs.py) ------------------------------------------

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs to train, for a DDP script's ``for epoch ... for batch in loader:``.

        Runs :meth:`steps` over ``count`` epochs of the data order: the first epoch
        yielded is the committed step's (after a join or a restore), and each ends, the
        loop over :attr:`loader` stopping, once its last step is committed. The code
        after that loop is part of the epoch's last step (snapshotted with it).

        Raises:
            ValueError: ``count`` < 1.
            RuntimeError: called twice, or the loop over the loader left an epoch
                before its last step was committed.
            Dropped / LeftTheJob / JobCompletedWithoutThisReplica: as :meth:`steps`.
        """
        return self._loop.epochs(count)

    @property
    def loader(self) -> EpochLoader:
        """In place of the ``DataLoader`` over a ``DistributedSampler``: iterated inside
        ``for epoch in session.epochs(n)``, this rank's batch of each step of the epoch
        from the committed step (one per micro-batch with ``micro_batch_size``); a step
        a fault aborted is yielded again with the new membership's share."""
        return self._loop.loader

    def backward(self, loss: torch.Tensor) -> None:
        """In place of ``loss.backward()`` in the loop over :attr:`loader`: the batch's
        mean loss, weighted by its share of the global batch; on the step's last batch
        also the gradient all-reduce, so ``.grad`` then holds the global gradient (as
        after DDP's backward)."""
        self._loop.backward(loss)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """:meth:`Step.clip_grad_norm_` of the step in the loop over :attr:`loader`: the
        norm before clipping on the step's last batch (an inf or nan norm skips the
        update on every rank); None on another batch or an aborted step."""
        return self._loop.clip_grad_norm_(max_norm, norm_type)

    def commit(self) -> bool:
        """In place of ``optimizer.step()`` in the loop over :attr:`loader`: True once
        the step is committed; False on a batch that is not the step's last, or when a
        fault aborted the step (its batches come again). Step a scheduler only on True.
        :attr:`committed` is then the number of steps committed (the step's index + 1).
        """
        return self._loop.commit()

    def _leave_without_joining(self) -> None:
        """The job completed before this replica became a member: end the process (status
        0) without returning into the script, whose post-training code would otherwise
        treat the untrained parameters as the result."""
        finished = self._inbox.finished_step
        completed = JobCompletedWithoutThisReplica(self.job_id, self.replica_id, finished)
        log.info("%s", completed)
        if self._record is not None:
            self._record.write(kind="left", step=finished)
        self.close()
        raise completed

    def _leave(self, generation: Generation) -> None:
        """A planned shrink took this replica out: it committed the step the members switched
        after; end the process with status 0 (its agent frees the slot when it exits)."""
        left = LeftTheJob(self.job_id, self.replica_id, self.committed - 1,
                          generation.generation)
        log.info("%s", left)
        self.rank = None  # the job goes on without it: it is nobody's primary
        if self._record is not None:
            self._record.write(kind="left", step=self.committed, generation=generation.generation,
                               planned=True)
        self.close()
        raise left

    def _chaos_kill(self) -> None:
        """Fault injection: die now, as a SIGKILLed rank does (recorded first)."""
        record = self._record
        chaos.die(None if record is None else
                  lambda: record.write(kind="chaos", step=self.committed))

    def _ensure_membership(self, total_steps: int) -> bool:
        """Apply a pending generation, waiting for one if this rank has none usable."""
        while True:
            newest, context = self._inbox.newest()
            finished = self._inbox.finished_step
            if self.bus is None:
                return True  # alone: world size 1, no process group
            if self.generation is None and finished >= total_steps:
                return False
            planned = newest is not None and newest.reason in (GenerationReason.JOIN,
                                                                 GenerationReason.LEAVE)
            if self.generation is not None and self.pg is not None and (
                    newest is None or newest.generation == self.generation.generation
                    or (planned and not self._switch_agreed)):
                # A join or a leave waits until every member has seen it (the flag in the
                # all-reduce).
                return True
            if newest is not None and (self.generation is None
                                       or newest.generation > self.generation.generation):
                if self._switch_agreed and self._sharded is not None and self.pg is not None:
                    self._hand_over()
                if newest.member(self.replica_id) is None:
                    if self.generation is not None and newest.reason is GenerationReason.LEAVE \
                            and self._switch_agreed:
                        self._leave(newest)
                    if self.generation is not None:
                        self.rank = None  # its state is no longer the job's
                        raise Dropped(f"{self.replica_id} is not a member of generation "
                                      f"{newest.generation} of {self.job_id}")
                else:
                    try:
                        self._apply(newest, context)
                        return True
                    except Aborted as exc:  # anything else is a bug: the rank crashes
                        log.warning("generation %d not applied: %s", newest.generation, exc)
                        self._abandon()
                        if newest.generation == self._inbox.newest_number():
                            self._wait_for_newer(newest.generation, total_steps)
                        continue
            # Here the newest generation is this replica's own, or one it is not in (and it
            # never was a member): wait for a newer one than that.
            self._wait_for_newer(-1 if newest is None else newest.generation, total_steps)

    def _wait_for_newer(self, than: int, total_steps: int) -> None:
        last_announce = time.monotonic()
        while self._inbox.newest_number() <= than:
            if self.generation is None and self._inbox.finished_step >= total_steps:
                return
            self._inbox.sleep(0.5)
            self._heartbeat()
            if self.generation is None and time.monotonic() - last_announce > 2.0:
                self._announce()  # elasticity may have restarted: say it again
                last_announce = time.monotonic()

    def _hand_over(self) -> None:
        """A planned change with a sharded optimizer: before the members switch (and the
        leaving ones go), every member of the old generation gathers the consolidated
        optimizer state, to be re-partitioned in the new one. Cut short by a fault, the
        members hold only their partitions, and the new generation restores a snapshot."""
        assert self._sharded is not None and self.pg is not None
        try:
            self._sharded.gather(self.pg, self._wait)
        except Aborted as exc:
            log.warning("the optimizer's partitions were not handed over: %s", exc)
            self._sharded.full = None
            self._abandon()

    def _update(self, step: Step) -> bool:
        """The optimizer step; False if a fault cut a sharded optimizer's broadcast of the
        updated parameters short (the step is torn: it is not committed, and the members
        hold no complete step until they restore one)."""
        dies = self.chaos_kill == (step.index, "update")
        if self._sharded is None:
            self.optimizer.step()
            if dies:
                self._chaos_kill()
            return True
        try:
            self._sharded.step(self.pg, self._wait, self._chaos_kill if dies else None)
            return True
        except Aborted as exc:
            log.warning("step %d's parameter broadcast aborted: %s", step.index, exc)
            self._aborted = (step.index, time.time_ns(), str(exc))
            self._abandon()
            return False

    def _keeps(self) -> Callable[[int], bool] | None:
        """A restore's filter: a sharded optimizer's entries of this member's new partition
        (every member restores, so nobody needs the whole state from it)."""
        return None if self._sharded is None else self._sharded.keeps(self.rank,
                                                                      self.world_size)

    @property
    def _optimizer_state(self) -> torch.optim.Optimizer | Sharded:
        """What carries the optimizer's whole state in a copy or a restore."""
        return self.optimizer if self._sharded is None else self._sharded

    def _trace_abort(self, generation: Generation, received_ns: int) -> None:
        """The last step given up, as the first recovery phase in ``generation``'s trace:
        from the abort until this replica starts applying the generation."""
        if self._aborted is None:
            return
        step, aborted_ns, why = self._aborted
        self._aborted = None
        span = telemetry.tracer().start_span("abort step", start_time=aborted_ns, attributes={
            "phalanx.job": self.job_id, "phalanx.replica": self.replica_id,
            "phalanx.step": step, "phalanx.generation": generation.generation,
            "phalanx.abort.cause": why})
        span.end(end_time=max(aborted_ns, received_ns))

    def _abandon(self) -> None:
        # Kept, not aborted or destroyed: a gloo group whose work is still blocked on a dead
        # peer must be left to its own timeout (abort() makes its exit std::terminate).
        if self.pg is not None:
            self._waits.abandoned.append(self.pg)
        self.pg = None

    def _apply(self, generation: Generation, context: Any) -> None:
        """Rebuild the process group for ``generation`` and agree on the state."""
        received = time.time()
        token = otel_context.attach(context) if context is not None else None
        try:
            self._trace_abort(generation, int(received * 1e9))
            with telemetry.tracer().start_as_current_span(
                    f"apply generation {generation.generation}", attributes={
                        "phalanx.job": self.job_id, "phalanx.replica": self.replica_id,
                        "phalanx.generation": generation.generation,
                        "phalanx.reason": generation.reason.value,
                        "phalanx.world_size": generation.world_size}) as applying:
                self._abandon()
                member = generation.member(self.replica_id)
                assert member is not None
                with telemetry.tracer().start_as_current_span("rebuild process group"):
                    pg = self._rendezvous(generation, member.rank)
                built = time.time()
                self.pg, self.generation = pg, generation
                self._switch_agreed = False
                self.rank, self.world_size = member.rank, generation.world_size
                self._inbox.forget_faults(generation)
                with telemetry.tracer().start_as_current_span("copy state") as copying:
                    resume, nbytes = self._sync_state(generation)
                    copying.set_attribute("phalanx.state_bytes", nbytes)
                if self._sharded is not None:
                    self._sharded.repartition(self.rank, self.world_size)
                synced = time.time()
                applying.set_attributes({"phalanx.rank": member.rank,
                                         "phalanx.resume_step": resume})
        finally:
            if token is not None:
                otel_context.detach(token)
        if self._record is not None:
            self._record.write(kind="generation", generation=generation.generation,
                               reason=generation.reason.value, rank=self.rank,
                               world_size=self.world_size, received=received, built=built,
                               synced=synced, resume=resume, state_bytes=nbytes,
                               restored_from=self._restored_from.value)
        # Reported once the first step in the generation is committed: elasticity starts
        # replacements only then, so their start-up does not slow the survivors' recovery.
        self._applied = GenerationApplied(
            job_id=self.job_id, generation=generation.generation, replica_id=self.replica_id,
            committed_step=self.committed, resume_step=resume, rebuild_s=built - received,
            state_copy_s=synced - built, state_bytes=nbytes, restored_from=self._restored_from)
        if self._progress is not None:
            self._progress.generation = generation.generation
        # In the replica's log (the agent's file for its output): where membership changed.
        print(f"=== phalanx: generation {generation.generation} ({generation.reason.value}"
              f"{': ' + generation.cause if generation.cause else ''}): {self.replica_id} is "
              f"rank {self.rank} of {self.world_size}, resuming after step {resume}"
              f"{_FROM.get(self._restored_from, '')}", flush=True)
        if self.on_membership is not None:
            self.on_membership(MembershipChange(generation.generation, self.world_size,
                                                self.rank, resume))

    def _rendezvous(self, generation: Generation, rank: int) -> dist.ProcessGroup:
        """A gloo group for ``generation``, given up at once if it is superseded meanwhile
        (its rank 0 died, say) or the job ends before this replica gets in."""
        def give_up() -> str | None:
            if self._inbox.newest_number() > generation.generation:
                return f"generation {generation.generation} was superseded"
            if self.generation is None and self._inbox.finished_step >= self._total_steps:
                return "the job finished before this replica joined"
            return None

        assert self._store is not None
        return rendezvous(self._waits, self._stores, (self.replica_id, self._store),
                          generation, rank, self.timeout, give_up)

    def _sync_state(self, generation: Generation) -> tuple[int, int]:
        """Agree on the resume step, a repair and who copies state (:mod:`.recovery`), then
        copy: ranks behind the resume step receive the state of one that has it."""
        assert self.pg is not None
        landing, self._landing = self._landing, []  # used by this copy or never
        retained = self._retained
        self._retained = self._repair = self._sitting_out = None
        # A member holding only its partition of a sharded optimizer holds no whole step.
        mine = MemberProgress(self.committed if self._sharded is None
                              or self._sharded.holds_all else -1)
        if retained is not None and self._sharded is None:
            old = retained.generation
            mine = MemberProgress(self.committed, retained.step, old.generation,
                                  old.member(self.replica_id).rank, old.world_size)
        info = torch.zeros(self.world_size, 5, dtype=torch.int64)
        info[self.rank] = torch.tensor(mine.row())
        self._wait(self.pg.allreduce([info]))
        rows = [MemberProgress(*row) for row in info.tolist()]
        job_step = generation.resume_step
        members_step = max(row.committed for row in rows)
        origin = StateSource.MEMBERS
        restored = self._restore_snapshot(generation, members_step)
        if restored is not None:
            restored, origin = restored
        durable = self._restore_durable(generation, max(members_step, restored or -1))
        if durable is not None:
            restored, origin = durable, StateSource.DURABLE
        if restored is not None:  # every member holds the restored step now, nothing kept
            rows, retained = [MemberProgress(restored)] * len(rows), None
            job_step = min(job_step, restored)
        newest = max(row.committed for row in rows)
        if 0 <= newest < job_step:
            # No member and no tier holds the step the job reached (every holder died with
            # its memory, snapshots off or not yet taken): go on from the newest step that
            # is left, as a restart would, and say so.
            origin = StateSource.START if newest == 0 else StateSource.OLDER
            self._state_lost(generation, job_step, newest, origin)
            job_step = newest
        self._restored_from = origin
        if self._sharded is not None and restored is None \
                and max(row.committed for row in rows) < 0:
            raise StateLost(f"generation {generation.generation}: every member holds only "
                            "its partition of the sharded optimizer and no snapshot of a "
                            "complete step is left on the members' nodes (a sharded "
                            "optimizer recovers from a fault only from snapshots: "
                            "checkpoint.memory_every_steps)")
        plan = plan_recovery(rows, generation.generation, job_step)
        resume, source = plan.resume, plan.source
        if plan.repair is not None:
            epoch, in_epoch = divmod(resume, self.order.steps_per_epoch)
            micro = self.order.repair_plan(
                epoch, in_epoch, plan.repair.old_world_size, plan.repair.lost_ranks,
                self.world_size, self.rank, self.micro_batch_size,
                aligned=self.deterministic)
            kept = retained if retained is not None and retained.step == resume else None
            self._repair = (resume, micro, kept)
        if plan.sitting_out is not None:
            self._sitting_out = (resume, list(plan.sitting_out))
        nbytes = 0
        if self.rank == source:
            for dst in plan.behind:
                nbytes += send_state(self.pg, dst, self.model, self._optimizer_state, resume,
                                     self._wait, checksum=self.checksum,
                                     extra=self._state).nbytes
        elif self.rank in plan.behind:
            # Until the copy is complete this rank holds no step's state: if the copy is
            # cut short, the next generation sees it as behind everyone and copies again.
            self.committed = -1
            step, stats = receive_state(self.pg, source, self.model, self._optimizer_state,
                                        self._wait, landing, extra=self._state)
            if step != resume:
                raise StateTransferError(f"asked for step {resume}, received step {step}")
            self.committed, nbytes = step, stats.nbytes
            if self._record is not None:
                self._record.write(kind="adopt", generation=generation.generation,
                                   step=step, source=source, state_bytes=nbytes)
        return resume, nbytes

    def _state_lost(self, generation: Generation, reached: int, newest: int,
                    origin: StateSource) -> None:
        """The job had reached step ``reached`` and nothing holds it: the members go on
        from ``newest`` (their newest step, 0: the initial state), ``origin`` saying which."""
        log.error("%s: no member and no checkpoint tier holds step %d, which job %s had "
                  "reached: generation %d resumes after step %d (%d steps trained again)",
                  self.replica_id, reached, self.job_id, generation.generation, newest,
                  reached - newest)
        if self._record is not None:
            self._record.write(kind="restore", generation=generation.generation, step=newest,
                               tier=origin.value, reached=reached, state_bytes=0,
                               seconds=0.0, corrupt=[])

    def _restore_snapshot(self, generation: Generation,
                          members_step: int) -> tuple[int, StateSource] | None:
        """If the members' nodes hold snapshots newer than ``members_step`` (the newest
        step a member holds), load the newest complete one on every member: its step, and
        whether buddies' replicas were needed."""
        if self._snapshots is None:
            return None
        assert self.pg is not None and self.snapshot_dir is not None
        started = time.time()

        def report(header: Header, problem: str, replica: bool) -> None:
            log.error("snapshot skipped: %s", problem)
            if self._record is not None:
                self._record.write(kind="corrupt", step=header.step, shard=header.shard,
                                   shards=header.shards, problem=problem)
            assert self.bus is not None
            self.bus.publish(subjects.ckpt_snapshot(self.job_id), SnapshotRecord(
                job_id=self.job_id, step=header.step, shard=header.shard,
                num_shards=header.shards, node_id=self.node_id,
                tier=SnapshotTier.BUDDY if replica else SnapshotTier.LOCAL,
                nbytes=header.length, checksum=f"{header.checksum:016x}",
                created_at=time.time(), generation=header.generation,
                total_bytes=header.total, corrupt=True, detail=problem))

        restored = restore(self.pg, self._wait, self.rank, self.world_size,
                           Path(self.snapshot_dir), self.job_id, members_step, self.model,
                           self._optimizer_state, self._state, report, self._keeps())
        if restored is None:
            return None
        self.committed = restored.step
        log.warning("%s restored step %d from the nodes' memory (%d B) in generation %d",
                    self.replica_id, restored.step, restored.nbytes, generation.generation)
        if self._record is not None:
            self._record.write(kind="restore", generation=generation.generation,
                               step=restored.step, tier="memory", state_bytes=restored.nbytes,
                               seconds=time.time() - started, corrupt=restored.corrupt,
                               from_replicas=restored.from_replicas)
        return restored.step, StateSource.BUDDY if restored.from_replicas \
            else StateSource.MEMORY

    def _restore_durable(self, generation: Generation, newer_than: int) -> int | None:
        """If durable storage holds a committed step newer than ``newer_than`` (what the
        members and their nodes' memory hold), load it on every member: its step."""
        if self.durable is None or self.pg is None:
            return None
        started = time.time()

        def report(step: Committed, problem: DurableCorrupt) -> None:
            log.error("durable step skipped: %s", problem)
            if self._record is not None:
                self._record.write(kind="corrupt", step=step.step, shards=step.shards,
                                   shard=problem.shard, job=step.job_id, tier="durable",
                                   problem=str(problem))
            if self.bus is not None:  # in the catalog of the job that wrote it
                assert self.durable is not None
                location = self.durable.location(step)
                for message in corrupt_records(step, problem, location, self.node_id,
                                               time.time()):
                    self.bus.publish(subjects.ckpt_snapshot(step.job_id), message)

        restored = restore_durable(self.pg, self._wait, self.world_size, self.durable,
                                   self.job_id, newer_than, self.model, self._optimizer_state,
                                   self._state, report, self._keeps())
        if restored is None:
            return None
        step, nbytes = restored
        self.committed = step
        log.warning("%s restored step %d from durable storage (%d B) in generation %d",
                    self.replica_id, step, nbytes, generation.generation)
        if self._record is not None:
            self._record.write(kind="restore", generation=generation.generation, step=step,
                               tier="durable", state_bytes=nbytes,
                               seconds=time.time() - started, corrupt=[])
        return step

    def _persisted(self, done: Persisted) -> None:
        """The durable writer's report (on its thread): announce a step it committed."""
        log.info("durable: shard %d of step %d written (%d B, %.2f s)%s", done.shard,
                 done.step, done.nbytes, done.seconds, ", step committed" if done.committed
                 else "")
        if done.committed is None or self.bus is None:
            return
        for message in committed_records(done.committed, done.location, self.node_id,
                                         time.time()):
            self.bus.publish(subjects.ckpt_snapshot(self.job_id), message)

    # --- one step ------------------------------------------------------------------------

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _fold_gradients(self) -> None:
        """Deterministic mode: add the micro-batch's gradient to the float64 sum."""
        flat = flat_gradients(self._params(), torch.float64)
        self._accumulated = flat if self._accumulated is None else self._accumulated + flat
        self.optimizer.zero_grad(set_to_none=False)

    def _allreduce_gradients(self, step: Step) -> bool:
        """Sum gradients and metrics over the members; False if the step was aborted.

        On success ``step.loss`` and ``step.metrics`` hold the sums over the ranks.
        """
        params = self._params()
        kept = step.kept.gradient if step.kept is not None else None
        metrics = step.local_metrics()
        reduce = self._reduce
        self._reduce = None

        def tail() -> torch.Tensor:
            # Then this member's snapshot measurements (every member agrees on the interval
            # from their sums), and how many members have seen a newer (join) generation.
            measured = [0.0] * TAIL_LENGTH if self._snapshots is None \
                else self._snapshots.schedule.tail()
            return torch.cat([metrics, torch.tensor([*measured, self._seen_newer()],
                                                    dtype=torch.float64)])

        if self.deterministic or self.pg is None:
            if self.deterministic:
                local = self._accumulated if self._accumulated is not None else torch.zeros(
                    sum(p.numel() for p in params), dtype=torch.float64)
                self._accumulated = None
            else:
                local = flat_gradients(params)
            if kept is not None:  # a repaired step: this rank's share from the aborted try
                local = local + kept
            if self.pg is None:
                write_gradients(params, local)
                step.reduced(metrics)
                return True
            flat = torch.cat([local.to(torch.float64), tail()])
            run = self._reduce_whole(flat, len(metrics) + TAIL_LENGTH + 1, step)
            local_gradient = (lambda: local)  # noqa: E731  (already at hand)
        else:
            reduce = reduce or self._bucketed(step, tail)  # not armed: no micro-batch here
            reduce.tail = tail
            run = (lambda: reduce.finish(self._wait))  # noqa: E731
            local_gradient = reduce.local_gradient
        try:
            summed = run()
        except Aborted as exc:
            log.warning("step %d aborted: %s", step.index, exc)
            self._aborted = (step.index, time.time_ns(), str(exc))
            self._retained = Retained(step.index, self.generation, local_gradient(),
                                       step.indices, metrics)
            self._abandon()
            return False
        if reduce is not None:
            self._bucket_buffers = reduce.flats  # given back: the all-reduce completed
        step.reduced(summed[:len(metrics)])
        if self._snapshots is not None:
            self._snapshots.schedule.agree(summed[len(metrics):-1].tolist())
        if summed[-1] > 0:
            self._switch_agreed = True
            if self._inbox.newest_number() <= self.generation.generation:
                self._wait_for_newer(self.generation.generation, self._total_steps)
        return True

    def _seen_newer(self) -> float:
        return 1.0 if self._inbox.newest_number() > self.generation.generation else 0.0

    def _reduce_whole(self, flat: torch.Tensor, tail: int,
                      step: Step) -> Callable[[], torch.Tensor]:
        """One all-reduce of the whole flat gradient and the ``tail`` last elements
        (deterministic mode)."""
        def run() -> torch.Tensor:
            work = self.pg.allreduce([flat])
            if self.chaos_kill == (step.index, "allreduce"):
                threading.Timer(0.005, self._chaos_kill).start()
            self._wait(work)
            write_gradients(self._params(), flat)  # rounds float64 sums once
            return flat[-tail:]

        return run

    def _bucketed(self, step: Step,
                  tail: Callable[[], torch.Tensor] | None = None) -> BucketedReduce:
        """A bucketed all-reduce for ``step``, started by the gradient hooks as backward runs."""
        params = self._params()
        if self._buckets is None:
            self._buckets = bucket_plan(params)
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(
                    lambda _, i=i: self._reduce.gradient_ready(i) if self._reduce else None)
        reduce = BucketedReduce(self.pg, params, self._buckets,
                                step.kept.gradient if step.kept is not None else None,
                                tail or (lambda: torch.zeros(0)), self._bucket_buffers)
        # Lent to this step's all-reduce; an aborted one never gives them back (its gloo
        # threads may still write into them), so the next step allocates new ones.
        self._bucket_buffers = None
        if self.chaos_kill == (step.index, "allreduce"):
            reduce.on_first_launch = lambda: threading.Timer(0.005, self._chaos_kill).start()
        return reduce

    def _arm(self, step: Step) -> None:
        """Before the step's last backward: let the hooks start the all-reduce as it runs."""
        if not self.deterministic and self.pg is not None:
            self._reduce = self._bucketed(step)

    def _plan_step(self, index: int) -> tuple[list[MicroBatch], Retained | None]:
        """Step ``index``'s micro-batches for this rank, and a repaired step's kept share."""
        order = self.order
        epoch, in_epoch = divmod(index, order.steps_per_epoch)
        if self._repair is not None and self._repair[0] == index:
            _, plan, kept = self._repair
            self._repair = None
            return plan, kept
        if self._sitting_out is not None and self._sitting_out[0] == index:
            active = self._sitting_out[1]
            self._sitting_out = None
            if self.rank not in active:
                return [], None
            return order.plan(epoch, in_epoch, len(active), active.index(self.rank),
                              self.micro_batch_size, aligned=self.deterministic), None
        return order.plan(epoch, in_epoch, self.world_size, self.rank, self.micro_batch_size,
                          aligned=self.deterministic), None

    def _load(self, plan: list[MicroBatch]) -> Iterator[Any]:
        """The batches of ``plan``'s micro-batches, in order (lazily)."""
        if self._loader is None:  # the dataset's own gather
            return (self.dataset.batch(mb.indices) for mb in plan)
        return self._loader.batches(plan)

    def _generation_number(self) -> int:
        return self.generation.generation if self.generation is not None else 0

    def _record_batch(self, step: Step) -> None:
        """The record's line of what ``step`` trained on (before its gradients leave)."""
        if self._record is not None:
            self._record.write(
                kind="batch", step=step.index, generation=self._generation_number(),
                rank=self.rank, world_size=self.world_size, indices=step.indices,
                loss=float(step.local_metrics()[0]),
                kept=0 if step.kept is None else len(step.kept.indices))

    def _committed(self, step: Step, now: float) -> None:
        """``step`` is committed (its optimizer step applied at ``now``). What the script
        does after ``commit()`` returns (a scheduler's step, an EMA's update, a counter) is
        part of the step too, so the step is snapshotted, recorded and reported at the
        *boundary*: when the script next asks for a step, the loop ends, or the session is
        closed (:meth:`_finish_commit`)."""
        self.committed = step.index + 1
        step_before, previous = self.last_step_s, self._last_commit_at
        self.last_step_s, self._last_commit_at = now - step.started, now
        self._boundary = (step, now, step_before, previous)

    def _finish_commit(self) -> None:
        """At the boundary after a committed step: snapshot the whole training state (the
        model, the optimizer and every registered object as the script left them), record,
        report. The snapshot comes first: a step reported committed is in memory."""
        if self._boundary is None:
            return
        step, now, step_before, previous = self._boundary
        self._boundary = None
        extra: dict[str, Any] = {} if step.updated else {"skipped": True}
        if self._snapshots is not None:
            snapshot_s = None
            if self._snapshots.due(self.committed) \
                    and self._snapshots.take(self.model, self._optimizer_state, self._state,
                                             self.committed, self.generation.generation,
                                             self.rank, self.world_size) is not None:
                snapshot_s = extra["snapshot_s"] = self._snapshots.last_copy_s
            # The interval the members agreed on in this step (bench/snapshot.py reads both).
            extra["snapshot_every"] = self._snapshots.schedule.interval
            self._snapshots.schedule.measured(
                self.last_step_s, None if self._snapshots.last_was_first else snapshot_s)
        if self._record is not None:
            self._record.write(kind="commit", step=step.index,
                               generation=self._generation_number(), rank=self.rank,
                               **step.timings(now), **extra)
        if self._progress is not None:
            self._progress.report(self.committed, self.last_step_s,
                                  final=self.committed == self._total_steps)
        if self._applied is not None and self.bus is not None:
            # What the change cost this member: the gap between its commits around it,
            # beyond the step it took before (a joiner had no commit before it).
            pause = None if previous is None else max(0.0, now - previous - step_before)
            applied = msgspec.structs.replace(self._applied, committed_step=self.committed,
                                              pause_s=pause)
            self.bus.publish_event(
                subjects.generation_applied(self.job_id), applied,
                f"{self.job_id}-{self.replica_id}-g{applied.generation}-applied")
            self._applied = None

    def close(self) -> None:
        """Leave: let a durable write under way end (the job's last step is persisted),
        flush the record, stop the bus thread (idempotent).

        A rank that trained in process groups then exits without tearing gloo down
        (:mod:`.teardown` says why): the interpreter's exit ends with ``os._exit`` once
        every ``atexit`` handler registered after ``phalanx.runtime`` was imported has
        run and output is flushed. The status is kept when the runtime can see it:
        ``sys.exit(n)`` or an exception leaving ``with session:``, an uncaught exception
        (1); otherwise 0.

        A script that left the loop early (``break``) ends its last step here.
        """
        self._finish_commit()
        writer = None if self._snapshots is None else self._snapshots.durable
        if writer is not None and not writer.wait_idle(DURABLE_FLUSH_S):
            log.error("the durable write of the last step did not end within %.0f s: that "
                      "step is not persisted", DURABLE_FLUSH_S)
        if self.bus is not None:
            self.bus.close()
            telemetry.shutdown_tracing()
            teardown.arm()
        if self._record is not None:
            self._record.close()


# Imported last: a step refers back to the session (the names stay importable from here).
from phalanx.runtime.step import Step  # noqa: E402

__all__ = ["Aborted", "Dropped", "ElasticSession", "JobCompletedWithoutThisReplica",
           "LeftTheJob", "MembershipChange", "Retained", "Step"]
