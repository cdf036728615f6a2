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

Around that loop the session applies the job's generations between steps (a
join or a leave at the same step on every member, a fault at once, aborting the
all-reduce in flight), agrees on the resume step and copies or restores the state
a member lacks, and trains each step on the samples the exactly-once data order
gives it (:mod:`.data`). Outside phalanx (no ``PHALANX_JOB_ID``) the same script
runs alone, as world size 1: the fault-free reference. docs/runtime.md says what
each line buys and how the runtime works inside.

This module is the session a script holds: its construction, the loop it
offers and its bus side (subscriptions). What the session holds is a
:class:`~.session_state.SessionState`, which its parts receive instead of the
session (they never reach into it): :mod:`.membership` (applying generations,
waiting on the group, announcing, leaving),
:mod:`.resume` (the state a generation resumes from), :mod:`.training_step`
(the session's side of a step: the all-reduce, the update, the boundary),
:mod:`.step` (one step's loop, as the script sees it), :mod:`.inbox` (what the
bus thread hands over), :mod:`.group` (abortable waits and the rendezvous),
:mod:`.recovery` (the pure recovery plan), :mod:`.state` (the state copy),
:mod:`.reduce` (the bucketed all-reduce), :mod:`.chaos` (fault injection) and
:mod:`.record`.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import datetime
import gc
import logging
import os
import secrets
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import nats.errors
import torch
import torch.distributed as dist

from phalanx.bus import telemetry
from phalanx.bus.config import BusConfig
from phalanx.runtime import (
    averaged,
    chaos,
    ddp,
    default_group,
    priority,
    reach,
    replica_group,
    schedulers,
    spare,
    sync_batchnorm,
    teardown,
)
from phalanx.runtime.buffers import StepBuffers
from phalanx.runtime.bus_thread import BusThread
from phalanx.runtime.chaos import Kill, Pace, parse_chaos_kill, parse_chaos_pace
from phalanx.runtime.data import ElasticOrder
from phalanx.runtime.dataset import step_loader
from phalanx.runtime.durable import DurablePolicy, DurableWriter, Persisted, committed_records
from phalanx.runtime.epochs import EpochLoader, EpochLoop
from phalanx.runtime.group import Aborted, Group
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.membership import (
    Dropped,
    JobCompletedWithoutThisReplica,
    LeftTheJob,
    Membership,
    MembershipChange,
)
from phalanx.runtime.placement import (
    Backend,
    choose_backend,
    deterministic_cuda,
    model_device,
)
from phalanx.runtime.progress import ProgressReporter
from phalanx.runtime.record import Recorder
from phalanx.runtime.recovery import Retained
from phalanx.runtime.session_state import Replica, SessionState
from phalanx.runtime.sharded import Sharded, is_sharded
from phalanx.runtime.snapshot import Snapshotter
from phalanx.runtime.snapshot_interval import IntervalPolicy, SnapshotSchedule
from phalanx.runtime.state import landing_buffers
from phalanx.runtime.step import Step
from phalanx.runtime.training_step import StepRunner
from phalanx.schemas import environment, subjects
from phalanx.schemas.environment import RankEnvironment
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import Fault, Generation, RankProgress

log = logging.getLogger("phalanx.runtime")
#: How long leaving waits for a durable write under way (the job's last step, often).
DURABLE_FLUSH_S = 60.0


#: The sessions not closed yet: the interpreter's exit closes them (:func:`_close_at_exit`).
_open: weakref.WeakSet[ElasticSession] = weakref.WeakSet()


@atexit.register  # after teardown's handler (imported above), so it runs before that one
def _close_at_exit() -> None:
    """Close the sessions the script left open, as ``with session:`` would: the last
    step's boundary is dropped if an uncaught exception is ending the process."""
    for session in list(_open):
        if teardown.failed():
            session._runner.forget_boundary()
        session.close()


def _warm_up(warmup: Callable[[], None], optimizer: torch.optim.Optimizer) -> None:
    """Run the user's warm-up; its gradients are zeroed, their memory kept touched."""
    warmup()
    optimizer.zero_grad(set_to_none=False)


class ElasticSession:
    """A rank's membership, process group, state and data order.

    Args:
        model / optimizer: what to train; the session never wraps them. ``model`` may be
            the script's ``DistributedDataParallel`` wrapper: the session trains the module
            inside and keeps DDP's own all-reduce off (:mod:`.ddp`).
        dataset: map-style; if it has ``batch(indices)`` (and no ``loader`` options are
            given) that is used for a micro-batch, else a standard DataLoader.
        loader: options of the ``DataLoader`` that reads the micro-batches
            (``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor`` ...);
            the session owns the sampling. With workers, they are persistent and read
            a step's next micro-batches while the current one computes.
        global_batch: samples per optimizer step across all ranks.
        micro_batch_size: the most samples one forward pass takes (gradient accumulation).
        seed: fixes the data order.
        drop_last: an epoch's last, partial batch is dropped, as a ``DistributedSampler``
            and ``DataLoader`` with ``drop_last=True`` drop it: an epoch is then
            ``len(dataset) // global_batch`` steps (what DDP's ``len(loader)`` gives a
            scheduler sized by it), each sample of them once; otherwise the last step
            trains the rest.
        bus: the bus thread (None: alone, world size 1).
        job_id / replica_id / slot / node_id: who this rank is.
        admission: the job's admission this rank was started for (``JobRecord.admission``;
            0: not known), carried in its events.
        advertise_host: the address peers reach this replica's rendezvous store at (its
            node's; the agent sets ``PHALANX_ADVERTISE_HOST``).
        record_dir: where to append this replica's record (None: no record).
        checksum: verify every state copy with Adler-32.
        collective_timeout_s: gloo's own timeout, the last resort.
        unreachable_after_s: how long a collective waits without progress before this
            rank asks which members' nodes answer a connect; if some do not (a link cut
            between nodes, which fails no process), it gives the generation up and
            reports them unreachable, and elasticity forms one without them
            (:mod:`.reach`). A collective that is only slow goes on waiting.
        on_membership: called after each applied generation.
        deterministic: make the summed gradient bitwise independent of the world size: the
            global batch is cut into the same micro-batches at any size, each micro-batch's
            gradient is accumulated and all-reduced in float64 (exact for these sums), then
            rounded once. The model is then the same whatever the membership did, at the
            cost of twice the all-reduce bytes and shares even to a micro-batch.
        warmup: one forward and backward pass of the user's, run before the replica
            reports ready, so its first real step (the survivors wait for it when it
            joins) is not slowed by cold caches and first allocations.
        landing: the buffers a joiner receives the optimizer state into
            (:func:`.state.landing_buffers`), made beforehand; None: made when it joins.
            A warm spare makes them, and runs ``warmup``, while it waits (:meth:`from_env`).
        nice_when_ready: the nice value to return to once ready (an agent starts a
            replacement at a lower CPU priority: :mod:`.priority`); None: unchanged.
        chaos_kill: where this process SIGKILLs itself (:class:`.chaos.Kill`): in a step or
            the first step of a generation, at its ``"boundary"`` (before the step),
            ``"allreduce"`` (in its all-reduce: no peer completes the step) or ``"update"``
            (in the optimizer step: :mod:`.chaos`).
        chaos_pace: a slowed job (:class:`.chaos.Pace`): it waits before each step until
            released.
        state: name -> object with ``state_dict``/``load_state_dict`` (LR schedulers, an
            EMA, a loss scaler) carried with the model and optimizer to every replica that
            receives state; more with :meth:`register`. An LR scheduler built on
            ``optimizer`` before the session is carried without it, as ``lr_scheduler``
            (:mod:`.schedulers`).
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
        backend: the job spec's ``auto``, ``nccl`` or ``gloo`` (:mod:`.placement`): the
            process group of every generation, for the model's device.
        ranks_per_replica: the job's (its agent's ``PHALANX_RANKS_PER_REPLICA``): a
            replica is a group of that many ranks whose model is sharded over the
            group (:mod:`.replica_group`); alone, a sharded model's group is the
            script's default process group.
        data_parallel: in a replica group, the 1-D device mesh whose ranks take different
            data (``mesh["dp"]`` of a ``("dp", "tp")`` mesh: tensor-parallel ranks take
            the same batch); None: every rank of the group its own.

    Raises:
        ValueError: an unknown ``backend``, ``nccl`` for a model not on a GPU, a model on
            more than one device, two LR schedulers of ``optimizer`` not registered, or a
            ``SyncBatchNorm`` the session cannot synchronise (deterministic mode, a replica
            group: :func:`.sync_batchnorm.adopt`).
        RuntimeError: ``nccl`` with a torch built without NCCL; alone, a default group
            the script made of more than one rank for a model that is not sharded.
        GroupMismatch: the model's sharding is not the replica group's (the error names
            the fix).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 dataset: Any, *, global_batch: int, micro_batch_size: int | None = None,
                 seed: int = 0, drop_last: bool = False, bus: BusThread | None = None,
                 job_id: str = "local", replica_id: str = "r0-0", slot: int = 0,
                 node_id: str = "local", record_dir: str | None = None, checksum: bool = False,
                 collective_timeout_s: float = 30.0,
                 unreachable_after_s: float = reach.UNREACHABLE_AFTER_S,
                 on_membership: Callable[[MembershipChange], None] | None = None,
                 deterministic: bool = False, warmup: Callable[[], None] | None = None,
                 nice_when_ready: int | None = None,
                 chaos_kill: Kill | None = None, chaos_pace: Pace | None = None,
                 state: Mapping[str, Any] | None = None, metrics: Sequence[str] = (),
                 loader: Mapping[str, Any] | None = None,
                 snapshot_interval: IntervalPolicy | None = None, snapshot_keep: int = 2,
                 snapshot_dir: str | None = None,
                 durable: DurablePolicy | None = None, backend: str = "auto",
                 landing: list[torch.Tensor] | None = None, admission: int = 0,
                 advertise_host: str = "127.0.0.1", ranks_per_replica: int | None = None,
                 data_parallel: Any = None) -> None:
        teardown.watch()
        trained = ddp.unwrap(model)  # the script's model, or the module in its DDP wrapper
        group = replica_group.of(trained, ranks_per_replica if bus is not None else None,
                                 data_parallel)
        norms = sync_batchnorm.adopt(trained, deterministic=deterministic,
                                     grouped=group is not None)
        # Deterministic mode cuts a step the same at any world size: its BatchNorm
        # statistics can then move once per micro-batch of the cut (.buffers).
        buffers = StepBuffers(trained, getattr(model, "broadcast_buffers", True),
                              slots=-(-global_batch // micro_batch_size)
                              if deterministic and group is None and micro_batch_size
                              else None)
        if group is None:
            default_group.take_over(alone=bus is None)  # the script's, DDP's let go of
        else:
            replica_group.prepare(trained)
            if is_sharded(optimizer):
                raise ValueError("a replica group's model is sharded already: its optimizer "
                                 "steps its own shards, not a ZeroRedundancyOptimizer")
            landing = []
        device = model_device(trained)  # the model's, and what the session allocates
        chosen = choose_backend(backend, device)
        if chosen is Backend.NCCL and not dist.is_nccl_available():
            raise RuntimeError(f"backend nccl: torch {torch.__version__} is built without "
                               "NCCL")
        if len(set(metrics)) != len(metrics) or "loss" in metrics:
            raise ValueError(f"metrics must be distinct names other than 'loss', got "
                             f"{list(metrics)}")
        if deterministic and device.type == "cuda":
            deterministic_cuda()  # before the warm-up's first kernels
        writer = DurableWriter(durable.url, durable.keep, self._persisted) \
            if durable is not None and durable.every and bus is not None else None
        self._s = SessionState(
            replica=Replica(job_id, replica_id, slot, node_id, admission, advertise_host,
                            secrets.token_hex(4)),
            model=trained, optimizer=optimizer,
            sharded=Sharded(optimizer) if is_sharded(optimizer) else None,
            carried={}, buffers=buffers, dataset=dataset,
            loader=step_loader(dataset, loader),
            order=ElasticOrder(len(dataset), global_batch, seed, drop_last),
            micro_batch_size=micro_batch_size or global_batch, metric_names=tuple(metrics),
            device=device, backend=chosen, deterministic=deterministic, checksum=checksum,
            timeout=datetime.timedelta(seconds=collective_timeout_s), bus=bus,
            inbox=Inbox(replica_id),
            # A group's ranks each keep their own (what each trained on).
            record=None if record_dir is None else Recorder(
                record_dir, replica_id if group is None or group.rank == 0
                else f"{replica_id}.g{group.rank}", admission),
            snapshots=Snapshotter(
                bus, job_id, replica_id, node_id, keep=snapshot_keep, durable=writer,
                schedule=SnapshotSchedule(dataclasses.replace(
                    snapshot_interval, durable_every=durable.every if durable else 0)),
                column=(0, 1) if group is None else (group.rank, group.size))
            if bus is not None and snapshot_interval is not None and snapshot_dir else None,
            snapshot_dir=snapshot_dir, durable=durable, chaos=chaos.Plan.of(chaos_kill),
            on_membership=on_membership, group=group,
            unreachable_after_s=unreachable_after_s, even_rounds=bool(norms))
        self._started = False  # a step was taken: the registered state is fixed
        for name, obj in (state or {}).items():
            self.register(name, obj)
        self._carry_found()
        #: The generation this replica is a member of, its rank, world size and group.
        self._membership = Membership(self._s)
        #: What a step asks of the session: its batches, the all-reduce, the update.
        self._runner = StepRunner(self._s, self._membership, norms)
        # The DDP-shaped loop: epochs(), loader, backward, commit.
        self._loop = EpochLoop(self._runner, self.steps)
        self._chaos_pace = chaos_pace
        self._nice_when_ready = nice_when_ready
        if warmup is not None and bus is not None:
            _warm_up(warmup, optimizer)
        if bus is not None:
            self._connect(bus, landing)
        elif group is None:
            default_group.answer(0, 1)
        _open.add(self)

    @classmethod
    def from_env(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any,
                 global_batch: int | None = None, *, env: Mapping[str, str] | None = None,
                 **kwargs: Any) -> ElasticSession:
        """The session of the replica an agent launched, or a lone one outside phalanx.

        ``global_batch`` and ``kwargs`` are the constructor's. ``PHALANX_MICRO_BATCH_SIZE``
        (a job spec's ``env``) is ``micro_batch_size`` where the script gives none: how
        many samples fit in one forward pass is the machine's, not the script's.

        Reads :class:`~phalanx.schemas.environment.RankEnvironment` from ``env`` (default
        ``os.environ``): the bus, job, replica, slot and node the agent set (with no
        ``PHALANX_JOB_ID`` or ``PHALANX_NATS_URL`` the session trains alone), its backend
        (default ``auto``), checkpoint policy and nice value to return to, and what the
        job's spec may set: the record dir, ``PHALANX_STATE_CHECKSUM=1``,
        ``PHALANX_DETERMINISTIC=1`` and fault injection (``PHALANX_CHAOS_*``,
        :mod:`.chaos`).

        Raises:
            BusUnavailable: the bus cannot be reached at start (no generation to join).
            ConfigError: a malformed variable (a ``PHALANX_CHAOS_KILL``,
                ``PHALANX_MICRO_BATCH_SIZE`` …), named.
        """
        env = os.environ if env is None else env
        if global_batch is not None:
            kwargs["global_batch"] = global_batch
        rank = RankEnvironment.from_env(env)
        if rank.micro_batch_size is not None:
            kwargs.setdefault("micro_batch_size", rank.micro_batch_size)
        if env.get(environment.SPARE):  # a warm spare, model built: wait to be told who it is
            # A spare group's rank receives its state into its shards, not landing buffers.
            if all(p.device.type == "cpu" for p in model.parameters()) \
                    and (rank.ranks_per_replica or 1) == 1:
                # What does not depend on who it becomes is done now, not once it is named:
                # the warm-up, and the optimizer's first step (its state's buffers, and
                # torch._dynamo's import: ~1 s of a replacement's start on W). In host
                # memory only: a GPU's memory is its slot's rank's, not a waiting spare's.
                warmup = kwargs.pop("warmup", None)
                if warmup is not None:
                    _warm_up(warmup, optimizer)
                kwargs.setdefault("landing", landing_buffers(optimizer))
            env = spare.wait_for_identity(env)
            rank = RankEnvironment.from_env(env)  # with the identity it was handed
        kwargs.setdefault("record_dir", rank.record_dir)
        kwargs.setdefault("checksum", rank.checksum)
        kwargs.setdefault("deterministic", rank.deterministic)
        kwargs.setdefault("backend", rank.backend or "auto")
        if rank.checkpoint is not None:  # set by the agent with the job's checkpoint policy
            kwargs.setdefault("snapshot_dir", rank.checkpoint.snapshot_dir)
            kwargs.setdefault("snapshot_interval", IntervalPolicy.of(rank.checkpoint))
            kwargs.setdefault("durable", DurablePolicy.of(rank.checkpoint))
            kwargs.setdefault("snapshot_keep", rank.checkpoint.memory_keep)
        if rank.nice_when_ready is not None:
            kwargs.setdefault("nice_when_ready", rank.nice_when_ready)
        if not rank.job_id or not rank.nats_url:
            kwargs.setdefault("replica_id", "local")
            return cls(model, optimizer, dataset, **kwargs)
        replica_id = rank.replica
        chaos_kill = parse_chaos_kill(rank.chaos_kill or "", replica_id,
                                      rank.group_rank if (rank.ranks_per_replica or 1) > 1
                                      else None)
        chaos.hold(rank.chaos_hold or "", replica_id)
        kwargs.setdefault("chaos_pace", parse_chaos_pace(rank.chaos_pace or ""))
        telemetry.setup_tracing("phalanx-rank", env)  # off unless OTEL_* asks for it
        bus = BusThread(BusConfig.load(env=env), f"rank:{rank.job_id}:{replica_id}")
        return cls(model, optimizer, dataset, bus=bus.start(), job_id=rank.job_id,
                   replica_id=replica_id, slot=rank.slot, node_id=rank.node_id or "local",
                   chaos_kill=chaos_kill, admission=rank.admission or 0,
                   advertise_host=rank.advertise_host or "127.0.0.1",
                   ranks_per_replica=rank.ranks_per_replica or 1, **kwargs)

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
        if name in self._s.carried:
            raise ValueError(f"{name!r} is registered already")
        if self._started:
            raise ValueError(f"register {name!r} before the first step: a replica that "
                             "received state without it would differ from its peers")
        self._s.carried[name] = obj

    def _carry_found(self) -> None:
        """Register what the script did not and must be carried all the same: the
        optimizer's LR scheduler (:mod:`.schedulers`) and an averaged model
        (:mod:`.averaged`), when the session is made and again before its first step."""
        for attempt in range(2):
            candidates = schedulers.alive(*schedulers.KINDS, averaged.KIND)
            registered = list(self._s.carried.values())
            try:
                found = {**schedulers.unregistered(self._s.optimizer, registered, candidates),
                         **averaged.unregistered(self._s.model, registered, candidates)}
                break
            except ValueError:
                if attempt:
                    raise
                # One dropped but held in a reference cycle (a traceback's) is no longer
                # the script's: collected, then looked for again (only then: a collection
                # costs a rank ~0.1 s).
                del candidates
                gc.collect()
        for name, obj in found.items():
            if name in self._s.carried:
                raise ValueError(f"another {type(obj).__name__} than the one carried as "
                                 f"{name!r}: register each by name (state= or "
                                 "session.register)")
            self.register(name, obj)

    def __enter__(self) -> ElasticSession:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        teardown.exit_status(exc)
        if exc is not None:
            self._runner.forget_boundary()
        self.close()

    # --- the bus side (runs on the bus thread) ---------------------------------------------

    def _connect(self, bus: BusThread, landing: list[torch.Tensor] | None) -> None:
        s = self._s
        # Every replica hosts a store; a generation rendezvouses on its rank 0's.
        self._membership.host_store()
        if s.speaks:  # a group's rank 0 reports the group's progress
            s.reporter = ProgressReporter(None, s.replica.job_id, s.replica.slot,
                                          replica_id=s.replica.replica_id, bus=bus)
        job_id = s.replica.job_id
        bus.subscribe(subjects.job_generation(job_id), Generation, s.inbox.on_generation)
        bus.subscribe(subjects.job_fault(job_id), Fault, s.inbox.on_fault)
        bus.subscribe(subjects.health_job_ranks(job_id), RankProgress, s.inbox.on_progress)
        stored = bus.run(self._stored_generation(bus), 10)
        if stored is not None:
            s.inbox.on_generation(stored, None)
            if stored.member(s.replica.replica_id) is None and s.sharded is None \
                    and s.group is None:
                # Joining a running job.
                self._membership.landing = landing if landing is not None \
                    else landing_buffers(s.optimizer)
        assert bus.bus is not None
        bus.bus.on_reconnect(lambda: self._resync_generation(bus))
        if self._nice_when_ready is not None:
            priority.restore(self._nice_when_ready)
        self._membership.announce()

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
                self._s.inbox.on_generation(stored, None)
            return
        log.warning("could not read the stored generation after reconnecting")

    async def _stored_generation(self, bus: BusThread) -> Generation | None:
        from phalanx.bus.kv import TypedKV  # the KV helpers are only needed here

        assert bus.bus is not None
        kv = await TypedKV.open(bus.bus.js, subjects.GENERATIONS_BUCKET, Generation)
        entry = await kv.get(self._s.replica.job_id)
        return None if entry is None else entry.value

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

        With a replica group every rank of the primary replica is primary: gathering a
        sharded model's state is a collective of the group (the script then writes it
        on its group rank 0).
        """
        if self._s.bus is not None and self.generation is None and not self._started:
            self._membership.wait_for_newer(-1, 1)  # the first generation (or the job's first step)
            newest = self._s.inbox.newest()[0]
            member = None if newest is None else newest.member(self._s.replica.replica_id)
            return member is not None and member.rank == 0
        return self.rank == 0

    @property
    def rank(self) -> int | None:
        """This replica's rank in the generation it applied last (0 alone); None while it
        is not a member (never taken in, or dropped): it holds no trained state then."""
        return self._membership.rank

    @property
    def world_size(self) -> int:
        """The size of the generation this replica applied last (1 alone)."""
        return self._membership.world_size

    @property
    def generation(self) -> Generation | None:
        """The generation this replica applied last; None before the first, and alone."""
        return self._membership.generation

    @property
    def pg(self) -> Group | None:
        """The process group of :attr:`generation`; None alone and once it is given up."""
        return self._membership.pg

    @property
    def committed(self) -> int:
        """Steps committed: the next step to run (-1 while a state copy is under way)."""
        return self._s.committed

    @property
    def model(self) -> torch.nn.Module:
        """What the session trains: the script's model, or the module in its DDP wrapper."""
        return self._s.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._s.optimizer

    @property
    def dataset(self) -> Any:
        return self._s.dataset

    @property
    def order(self) -> ElasticOrder:
        """The data order: which samples each step trains on (:mod:`.data`)."""
        return self._s.order

    @property
    def micro_batch_size(self) -> int:
        """The most samples one forward pass takes."""
        return self._s.micro_batch_size

    @property
    def device(self) -> torch.device:
        """Where the model lives, and everything the session allocates for it."""
        return self._s.device

    @property
    def backend(self) -> Backend:
        """The process group every generation builds (:mod:`.placement`)."""
        return self._s.backend

    @property
    def replica(self) -> Replica:
        """Who this process is: its job, replica, slot and node."""
        return self._s.replica

    @property
    def carried(self) -> Mapping[str, Any]:
        """The objects carried with the model and optimizer, by name (:meth:`register`,
        and the LR scheduler and averaged model found without it)."""
        return types.MappingProxyType(self._s.carried)

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
        s = self._s
        s.total_steps = total_steps
        if s.reporter is not None:
            s.reporter.total_steps = total_steps
        if not self._started:
            self._carry_found()  # built after the session, before its first step
        self._started = True
        while s.committed < total_steps:
            self._runner.finish_commit()
            # A member killed between steps dies where it stands, before it applies a
            # generation that came meanwhile (as a kill from outside would), so a test's
            # faults at one boundary strike in one generation however late a rank runs.
            if self.generation is not None and s.chaos.due(s.committed, "boundary"):
                s.die()
            try:
                if not self._membership.ensure(total_steps):
                    self._membership.leave_without_joining()
            except (LeftTheJob, JobCompletedWithoutThisReplica):
                self.close()  # then the process ends, status 0
                raise
            if s.committed >= total_steps:  # restored (or received) the job's last step
                break
            if s.chaos.due(s.committed, "boundary"):  # joined, or moved to it
                s.die()
            if self._chaos_pace is not None:
                self._chaos_pace.wait()
            step = Step(self._runner, s.committed)
            yield step
            if step.outcome is None:
                raise RuntimeError(f"step {step.index} was not committed: call step.commit()")
        self._runner.finish_commit()

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

    def _persisted(self, done: Persisted) -> None:
        """The durable writer's report (on its thread): announce a step it committed."""
        log.info("durable: shard %d of step %d written (%d B, %.2f s)%s", done.shard,
                 done.step, done.nbytes, done.seconds, ", step committed" if done.committed
                 else "")
        bus, replica = self._s.bus, self._s.replica
        if done.committed is None or bus is None:
            return
        for message in committed_records(done.committed, done.location, replica.node_id,
                                         time.time()):
            bus.publish(subjects.ckpt_snapshot(replica.job_id), message)

    def close(self) -> None:
        """Leave: let a durable write under way end (the job's last step is persisted),
        flush the record, stop the bus thread and the loader's workers (idempotent).

        A rank that trained in process groups then exits without tearing gloo down
        (:mod:`.teardown` says why): the interpreter's exit ends with ``os._exit`` once
        every ``atexit`` handler registered after ``phalanx.runtime`` was imported has
        run and output is flushed. The status is kept when the runtime can see it:
        ``sys.exit(n)`` or an exception leaving ``with session:``, an uncaught exception
        (1); otherwise 0.

        A script that left the loop early (``break``) ends its last step here. A session
        the script does not close is closed as the interpreter exits (the default group,
        :mod:`.default_group`, stays until then: a script may ask it after the loop).
        """
        _open.discard(self)
        s = self._s
        self._runner.finish_commit()
        if s.snapshots is not None:
            s.snapshots.settle()  # a snapshot still being written off the device
        writer = None if s.snapshots is None else s.snapshots.durable
        if writer is not None and not writer.wait_idle(DURABLE_FLUSH_S):
            log.error("the durable write of the last step did not end within %.0f s: that "
                      "step is not persisted", DURABLE_FLUSH_S)
        if s.bus is not None:
            s.bus.close()
            telemetry.shutdown_tracing()
        if s.bus is not None or s.group is not None:
            # Under phalanx, or alone in the script's own group of several ranks (a
            # sharded model under torchrun): a rank of that run died of SIGABRT ("terminate
            # called without an active exception") in gloo's teardown at exit, its
            # training done and saved, about one run in 40.
            teardown.arm()
        if s.record is not None:
            s.record.close()
        if s.loader is not None:
            s.loader.close()
        self._loop.close()


__all__ = ["Aborted", "Dropped", "ElasticSession", "JobCompletedWithoutThisReplica",
           "LeftTheJob", "MembershipChange", "Retained", "Step"]
