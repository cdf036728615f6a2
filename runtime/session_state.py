"""What a rank's session holds, shared by the parts that run it.

:class:`~.elastic.ElasticSession` builds one :class:`SessionState`. Membership,
the resume, the fetch, the step runner and the epoch loop receive it, or a
:class:`Seat` (a member's place in the generation it applied), and never the
session itself. The state holds who this replica is (:class:`Replica`), what it
trains and carries, how it talks (bus, inbox, record, progress reporter,
snapshots), and the counters that commits and restores move.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any

import torch

from phalanx.runtime import chaos
from phalanx.runtime.buffers import StepBuffers
from phalanx.runtime.bus_thread import BusThread
from phalanx.runtime.data import ElasticOrder, MicroBatch, evened
from phalanx.runtime.dataset import StepLoader
from phalanx.runtime.durable import DurablePolicy
from phalanx.runtime.group import Group, GroupWork
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.placement import Backend
from phalanx.runtime.progress import ProgressReporter
from phalanx.runtime.reach import UNREACHABLE_AFTER_S
from phalanx.runtime.record import Recorder
from phalanx.runtime.replica_group import ReplicaGroup
from phalanx.runtime.sharded import Sharded
from phalanx.runtime.snapshot import Snapshotter


@dataclasses.dataclass(frozen=True)
class Replica:
    """Who this process is: its job, replica, slot and node, and the admission it runs in."""

    job_id: str
    replica_id: str
    slot: int
    node_id: str
    admission: int  # the job's admission it was started for (0: not known)
    host: str  # where peers reach its rendezvous store (its node's address)
    # Replica ids and generation numbers start over when a requeued job is admitted
    # again: this process's events must not share an id with an earlier admission's,
    # which the stream would drop as duplicates for two minutes.
    process_token: str

    def event_id(self, kind: str) -> str:
        """The stream id of this process's event ``kind`` (``ready``, ``g3-applied``): the
        same for its repeats, which the stream stores once, and for no other process."""
        return f"{self.job_id}-{self.replica_id}-{self.process_token}-{kind}"


@dataclasses.dataclass(frozen=True)
class Seat:
    """A member's place in the generation it applied: its group, rank and world size, and
    how it waits on the group (abortably, reporting progress while it waits)."""

    pg: Group
    rank: int
    world_size: int
    wait: Callable[[GroupWork], None]  # raises Aborted when the generation is given up
    heartbeat: Callable[[], None]


@dataclasses.dataclass(eq=False)
class SessionState:
    """The state of one rank's session (see the module docstring)."""

    replica: Replica
    # What it trains and carries to every replica that receives state.
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sharded: Sharded | None  # a sharded optimizer's handle (:mod:`.sharded`)
    carried: dict[str, Any]  # name -> registered object (``state=``, ``register``)
    buffers: StepBuffers  # every member's buffers alike (:mod:`.buffers`)
    # What it trains on, and how.
    dataset: Any
    loader: StepLoader | None  # None: the dataset's own ``batch``
    order: ElasticOrder
    micro_batch_size: int
    metric_names: tuple[str, ...]
    device: torch.device
    backend: Backend
    deterministic: bool
    checksum: bool
    timeout: datetime.timedelta
    # How it talks, and what it keeps.
    bus: BusThread | None  # None: alone, world size 1
    inbox: Inbox
    record: Recorder | None
    snapshots: Snapshotter | None
    snapshot_dir: str | None
    durable: DurablePolicy | None
    chaos: chaos.Plan
    on_membership: Callable[[Any], None] | None
    #: The replica's group of ranks (:mod:`.replica_group`); None: one rank per replica.
    group: ReplicaGroup | None = None
    #: How long a collective waits without progress before it asks which members' nodes
    #: answer (:mod:`.reach`), and gives the generation up naming those that do not.
    unreachable_after_s: float = UNREACHABLE_AFTER_S
    #: Every member runs as many micro-batches a step (``SyncBatchNorm``'s rounds meet:
    #: :mod:`.sync_batchnorm`).
    even_rounds: bool = False
    reporter: ProgressReporter | None = None  # once connected
    # Moved by commits, copies and restores.
    committed: int = 0  # steps committed: the next step to run
    last_step_s: float = 0.0
    total_steps: int = 0  # of the loop the script runs (0: none yet)

    @property
    def optimizer_state(self) -> torch.optim.Optimizer | Sharded:
        """What carries the optimizer's whole state in a copy or a restore."""
        return self.optimizer if self.sharded is None else self.sharded

    @property
    def speaks(self) -> bool:
        """Whether this process speaks for its replica on the bus (announces it, reports
        its progress and what it applied): a group's rank 0, or the replica's only rank."""
        return self.group is None or self.group.rank == 0

    @property
    def column(self) -> int:
        """Which of a generation's columns this process trains in (its rank in its
        replica's group; 0 with one rank per replica)."""
        return 0 if self.group is None else self.group.rank

    def plan_share(self, index: int, world_size: int, rank: int | None) -> list[MicroBatch]:
        """Step ``index``'s micro-batches for rank ``rank`` of ``world_size`` members (this
        process's part of its group's share, with a replica group; None: a rank that
        sits the step out). With ``even_rounds``, fillers up to the most any member runs
        (:func:`.data.evened`)."""
        epoch, in_epoch = divmod(index, self.order.steps_per_epoch)
        plan = [] if rank is None else self._plan(epoch, in_epoch, world_size, rank)
        if not self.even_rounds:
            return plan
        return evened(plan, self.order.rounds(epoch, in_epoch, world_size,
                                              self.micro_batch_size),
                      self.order.batch(epoch, in_epoch)[-1])

    def _plan(self, epoch: int, in_epoch: int, world_size: int,
              rank: int) -> list[MicroBatch]:
        group = self.group
        return self.order.plan(epoch, in_epoch, world_size, rank, self.micro_batch_size,
                               aligned=self.deterministic,
                               group_size=1 if group is None else group.data_size,
                               group_rank=0 if group is None else group.data_rank)

    def die(self) -> None:
        """Fault injection: die now, as a SIGKILLed rank does (recorded first)."""
        record = self.record
        chaos.die(None if record is None else
                  lambda: record.write(kind="chaos", step=self.committed),
                  oom=self.chaos.kill is not None and self.chaos.kill.oom)
