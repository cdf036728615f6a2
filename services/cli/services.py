"""``phalanx agent``, ``admission``, ``health``, ``elasticity`` and ``checkpoint``: run one
node agent or one instance of a leader service in this process, until it is signalled
(what ``phalanx up`` starts, and what a real machine or a deployment runs); and
``phalanx callout``, the auth callout only a Kubernetes deployment runs. Each reads its
settings from the command line and ``PHALANX_<SERVICE>_*``, refusing bad ones before it
connects.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

from phalanx.schemas import settings
from phalanx.services.cli.common import EXIT_USAGE, Parents, Subparsers, bus_config


def cmd_agent(args: argparse.Namespace) -> int:
    if args.supervised:
        from phalanx.services.agent import supervisor

        return supervisor.supervise(supervisor.agent_command(args.argv))
    from phalanx.services.agent.config import AgentConfig
    from phalanx.services.agent.service import AgentService
    from phalanx.services.base import run_service
    from phalanx.services.logs import configure_logging

    config = AgentConfig.from_env(
        node_id=args.node_id, slots=args.slots, cpus=args.cpus,
        failure_domain=args.failure_domain,
        labels=args.labels, heartbeat_interval_s=args.heartbeat_interval,
        lost_after_s=args.lost_after, work_dir=args.work_dir)
    if config.work_dir is None:
        config = dataclasses.replace(
            config, work_dir=str(Path(args.data_dir) / "agents" / config.node_id))
    configure_logging("phalanx-agent", config.node_id, args.log_level)
    return run_service(AgentService(config, bus_config(args)))


def cmd_admission(args: argparse.Namespace) -> int:
    from phalanx.services.admission.config import AdmissionConfig
    from phalanx.services.admission.service import AdmissionService
    from phalanx.services.base import run_service
    from phalanx.services.logs import configure_logging

    config = AdmissionConfig.load(args.config)
    service = AdmissionService(config, bus_config(args), instance=args.instance)
    configure_logging("phalanx-admission", service.instance, args.log_level)
    return run_service(service)


def cmd_health(args: argparse.Namespace) -> int:
    from phalanx.services.base import run_service
    from phalanx.services.health.core import HealthPolicy
    from phalanx.services.health.service import HealthService
    from phalanx.services.logs import configure_logging

    overrides = {}
    for field in dataclasses.fields(HealthPolicy):  # PHALANX_HEALTH_<FIELD> overrides
        raw = os.environ.get(settings.HEALTH(field.name))
        if raw is not None:
            try:
                overrides[field.name] = int(raw) if field.type in (int, "int") else float(raw)
            except ValueError:
                print(f"phalanx health: {settings.HEALTH(field.name)} must be a number, "
                      f"got {raw!r}", file=sys.stderr)
                return EXIT_USAGE
    try:
        policy = HealthPolicy(**{"node_timeout_s": args.lost_after, **overrides})
    except ValueError as exc:
        print(f"phalanx health: {exc}", file=sys.stderr)
        return EXIT_USAGE
    service = HealthService(policy, bus_config(args), instance=args.instance,
                            lease_s=float(os.environ.get(settings.HEALTH("lease_s"), "3")))
    configure_logging("phalanx-health", service.instance, args.log_level)
    return run_service(service)


def cmd_elasticity(args: argparse.Namespace) -> int:
    from phalanx.services.base import run_service
    from phalanx.services.elasticity.core import ElasticityCore
    from phalanx.services.elasticity.service import ElasticityService
    from phalanx.services.logs import configure_logging

    try:
        make_core = functools.partial(
            ElasticityCore,
            wait_timeout_s=float(os.environ.get(settings.ELASTICITY("wait_timeout_s"), "60")),
            max_replacements=int(os.environ.get(settings.ELASTICITY("max_replacements"), "16")))
        make_core()  # refused here, not at the first takeover
        service = ElasticityService(
            make_core, bus_config(args), instance=args.instance,
            lease_s=float(os.environ.get(settings.ELASTICITY("lease_s"), "3")))
    except ValueError as exc:
        print(f"phalanx elasticity: {settings.ELASTICITY.prefix}*: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("phalanx-elasticity", service.instance, args.log_level)
    return run_service(service)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from phalanx.services.base import run_service
    from phalanx.services.checkpoint.service import CheckpointService
    from phalanx.services.logs import configure_logging

    try:
        service = CheckpointService(
            bus_config(args), instance=args.instance,
            lease_s=float(os.environ.get(settings.CHECKPOINT("lease_s"), "3")))
    except ValueError as exc:
        print(f"phalanx checkpoint: {settings.CHECKPOINT.prefix}*: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("phalanx-checkpoint", service.instance, args.log_level)
    return run_service(service)


def cmd_callout(args: argparse.Namespace) -> int:
    from phalanx.schemas.errors import ConfigError
    from phalanx.services.base import run_service
    from phalanx.services.callout.config import CalloutConfig
    from phalanx.services.callout.service import CalloutService
    from phalanx.services.logs import configure_logging

    try:
        service = CalloutService(CalloutConfig.from_env(), bus_config(args),
                                 instance=args.instance)
    except ConfigError as exc:
        print(f"phalanx callout: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging("phalanx-callout", service.instance, args.log_level)
    return run_service(service)


def add_parsers(sub: Subparsers, parents: Parents) -> None:
    common, lost_after = parents
    agent = sub.add_parser("agent", parents=[common, lost_after], help="run a node agent")
    agent.add_argument("--node-id")
    agent.add_argument("--slots", type=int)
    agent.add_argument("--cpus", metavar="LIST",
                       help="the CPUs the agent runs on, e.g. 0-7,16-23: each CPU slot's "
                            "ranks pinned to whole cores of their own among them")
    agent.add_argument("--failure-domain")
    agent.add_argument("--labels", help="key=value,key=value")
    agent.add_argument("--heartbeat-interval", type=float, metavar="S")
    agent.add_argument("--work-dir", help="rank logs and manifest (default: "
                                          "<data-dir>/agents/<node-id>)")
    agent.add_argument("--supervised", action="store_true",
                       help="run the agent under a supervisor that starts it again in place "
                            "when it dies, so its ranks outlive it (a container's first "
                            "process: docs/deploy.md)")
    agent.set_defaults(func=cmd_agent)

    admission = sub.add_parser("admission", parents=[common],
                               help="run an admission service instance")
    admission.add_argument("--instance", help="instance name (default: host-pid-random)")
    admission.set_defaults(func=cmd_admission)

    health = sub.add_parser("health", parents=[common, lost_after],
                            help="run the health service")
    health.add_argument("--instance", help="instance name (default: host-pid-random)")
    health.set_defaults(func=cmd_health)

    elasticity = sub.add_parser("elasticity", parents=[common],
                                help="run the elasticity service (generations of running jobs)")
    elasticity.add_argument("--instance", help="instance name (default: host-pid-random)")
    elasticity.set_defaults(func=cmd_elasticity)

    checkpoint = sub.add_parser("checkpoint", parents=[common],
                                help="run the checkpoint service (the snapshot catalog)")
    checkpoint.add_argument("--instance", help="instance name (default: host-pid-random)")
    checkpoint.set_defaults(func=cmd_checkpoint)

    callout = sub.add_parser("callout", parents=[common],
                             help="run the auth callout (Kubernetes: admits each job's ranks "
                                  "as their job, docs/security.md)")
    callout.add_argument("--instance", help="instance name (default: host-pid-random)")
    callout.set_defaults(func=cmd_callout)
