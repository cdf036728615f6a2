"""``phalanx nodes``, ``top``, ``node cordon|uncordon`` and ``chaos``: the cluster's nodes
as the registry holds them, the live view of nodes, jobs and events, taking a node (or
one slot of it, ``--slot``) out of or back into placement, and faults injected through
the agents.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from phalanx.services.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    Parents,
    Subparsers,
    bus_config,
    whole_number,
)

if TYPE_CHECKING:
    from phalanx.schemas.errors import WireError
    from phalanx.schemas.messages import ChaosReply, ChaosRequest
    from phalanx.schemas.registry import NodeView


async def read_nodes(args: argparse.Namespace) -> tuple[list[NodeView], list[WireError]]:
    """The registry's nodes as seen now (lost after ``--lost-after``), and the entries it
    could not read."""
    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import NodeRecord
    from phalanx.schemas.registry import views

    async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
        nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
        entries, errors = await nodes.entries()
    return views((e.value for e in entries), time.time(), args.lost_after), errors


def _node_rows(nodes: list[NodeView]) -> list[dict[str, Any]]:
    import msgspec

    return [{
        "node_id": n.node_id, "state": n.state.value, "slots": n.slots,
        "slots_used": n.slots_used, "failure_domain": n.failure_domain, "labels": n.labels,
        "cordoned": n.cordoned, "heartbeat_age_s": round(n.heartbeat_age_s, 3),
        "host": n.host, "agent_pid": n.agent_pid,
        "cordoned_slots": {str(slot): why for slot, why in sorted(n.cordoned_slots.items())},
        "gpus": [msgspec.to_builtins(g) for g in n.gpus],
    } for n in nodes]


def cmd_nodes(args: argparse.Namespace) -> int:
    from rich.console import Console

    from phalanx.services.tables import node_table

    nodes, errors = asyncio.run(read_nodes(args))
    for error in errors:
        print(f"warning: skipped a registry entry: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps(_node_rows(nodes), indent=2))
    else:
        Console().print(node_table(nodes))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """Nodes, jobs and the latest events, redrawn as the bus reports changes."""
    from rich.console import Console
    from rich.live import Live

    from phalanx.bus.client import Bus
    from phalanx.services import top

    console = Console()

    async def run() -> None:
        async with await Bus.connect(bus_config(args), name="phalanx-top") as bus:
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


async def _agent_request(args: argparse.Namespace, node_id: str | None,
                         request: ChaosRequest) -> ChaosReply | None:
    """``request`` answered by ``node_id``'s agent; for a rank to kill (``node_id``
    None), the agent of the node its job placed the slot on, found on the same
    connection (one connection, not two: the fault strikes sooner)."""
    from phalanx.bus.client import Bus
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import ChaosReply
    from phalanx.services.client import AdmissionClient

    async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
        if node_id is None:
            # a kill_rank request, which holds both (ChaosRequest checks it)
            assert request.job_id is not None and request.rank is not None
            record = await AdmissionClient(bus).job(request.job_id)
            # The rank is a slot number: slots keep their numbers when a placement shrinks
            # or grows, so the node is the slot's, not the list position's.
            node_id = None if record is None else record.placement().get(request.rank)
            if node_id is None:
                return None
        return await bus.request(subjects.agent_chaos(node_id), request, ChaosReply,
                                 timeout_s=5.0)


def cmd_chaos(args: argparse.Namespace) -> int:
    from phalanx.schemas.messages import ChaosAction, ChaosRequest, GpuFaultKind

    if args.action == "kill-rank":
        node = None
        request = ChaosRequest(action=ChaosAction.KILL_RANK, job_id=args.job, rank=args.rank,
                               signal=args.signal)
    elif args.action == "gpu-fault":
        node = args.node
        request = ChaosRequest(action=ChaosAction.GPU_FAULT, gpu=args.gpu,
                               gpu_fault=GpuFaultKind(args.kind),
                               code=args.code if args.kind == "xid" else None)
    else:
        node = args.node
        action = ChaosAction.KILL_AGENT if args.action == "kill-agent" else \
            ChaosAction.PAUSE_AGENT
        request = ChaosRequest(action=action, duration_s=args.seconds)
    reply = asyncio.run(_agent_request(args, node, request))
    if reply is None:
        print(f"phalanx chaos: {args.job!r} has no running rank {args.rank}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{reply.node_id}: {reply.detail}")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """Cordon or uncordon a node: no new placements while cordoned; health is told. With
    ``--slot``, uncordon one slot its agent cordoned (its GPU failed): the rest of the
    node is left as it is, and health is not told (it judges nodes, not slots)."""
    import msgspec

    from phalanx.bus.client import Bus
    from phalanx.bus.kv import TypedKV
    from phalanx.schemas import subjects
    from phalanx.schemas.messages import NodeCondition, NodeConditionChanged, NodeRecord

    cordon = args.action == "cordon"
    if args.slot is not None and cordon:
        print("phalanx node: --slot goes with uncordon (an agent cordons a slot when its GPU "
              "fails; cordon the node to take it all out)", file=sys.stderr)
        return EXIT_USAGE

    def flip(record: NodeRecord | None) -> NodeRecord:
        if record is None:
            raise LookupError(f"no node {args.node!r} in the registry")
        if args.slot is None:
            return msgspec.structs.replace(record, cordoned=cordon)
        if args.slot not in record.cordoned_slots:
            held = sorted(record.cordoned_slots) or "none"
            raise LookupError(f"slot {args.slot} of {args.node} is not cordoned "
                              f"(cordoned slots: {held})")
        return msgspec.structs.replace(record, cordoned_slots={
            s: why for s, why in record.cordoned_slots.items() if s != args.slot})

    async def change() -> None:
        async with await Bus.connect(bus_config(args), name="phalanx-cli") as bus:
            nodes = await TypedKV.open(bus.js, subjects.NODES_BUCKET, NodeRecord)
            await nodes.modify(args.node, flip)  # compare-and-swap: the agent writes too
            if args.slot is None:
                await bus.publish(subjects.node_condition(args.node), NodeConditionChanged(
                    node_id=args.node, reason=f"{args.action} by operator", at=time.time(),
                    condition=NodeCondition.CORDONED if cordon else NodeCondition.UNCORDONED))

    try:
        asyncio.run(change())
    except LookupError as exc:
        print(f"phalanx node: {exc.args[0]}", file=sys.stderr)
        return EXIT_FAILED
    what = args.node if args.slot is None else f"{args.node} slot {args.slot}"
    print(f"{what}: {'cordoned' if cordon else 'uncordoned'}")
    return 0


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    common, lost_after = parents
    nodes = sub.add_parser("nodes", parents=[common, lost_after], help="list registered nodes")
    nodes.add_argument("--json", action="store_true")
    nodes.set_defaults(func=cmd_nodes)

    top = sub.add_parser("top", parents=[common, lost_after],
                         help="live view of nodes, jobs and the latest events")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=cmd_top)

    node = sub.add_parser("node", parents=[common],
                          help="cordon or uncordon a node (or one slot of it)")
    node.add_argument("action", choices=["cordon", "uncordon"])
    node.add_argument("node")
    node.add_argument("--slot", type=int, metavar="S",
                      help="uncordon only slot S, which its agent cordoned (a GPU fault)")
    node.set_defaults(func=cmd_node)

    chaos = sub.add_parser("chaos", help="inject faults through the agents")
    chaos_sub = chaos.add_subparsers(dest="action", required=True)
    kill_rank = chaos_sub.add_parser(
        "kill-rank", parents=[common],
        help="signal one rank of a job through its agent (announced: nothing is "
             "cordoned)")
    kill_rank.add_argument("job")
    kill_rank.add_argument("rank", type=int)
    kill_rank.add_argument("--signal", default="KILL", choices=["KILL", "STOP", "TERM", "CONT"])
    for name, what in (("kill-agent", "SIGKILL a node's agent (announced: nothing is cordoned)"),
                       ("pause-agent", "SIGSTOP a node's agent for --seconds, then resume it")):
        node_chaos = chaos_sub.add_parser(name, parents=[common], help=what)
        node_chaos.add_argument("node")
        node_chaos.add_argument("--seconds", type=float, default=5.0,
                                help="pause-agent: how long the agent stays stopped")
    gpu_fault = chaos_sub.add_parser(
        "gpu-fault", parents=[common],
        help="a GPU fault seen by the agent's next health poll (injected at its NVML "
             "boundary): the GPU's slots are cordoned and their ranks killed")
    gpu_fault.add_argument("node")
    gpu_fault.add_argument("--gpu", type=whole_number, required=True, metavar="I",
                           help="the GPU's index (on a node without GPUs: a slot's)")
    gpu_fault.add_argument("--kind", default="xid",
                           choices=["xid", "ecc", "retired_pages", "row_remap", "lost",
                                    "throttle"],
                           help="what fails (throttle: reported, not a fault)")
    gpu_fault.add_argument("--code", type=whole_number, default=79, metavar="XID",
                           help="the Xid of --kind xid (default 79: fallen off the bus)")
    chaos.set_defaults(func=cmd_chaos)

