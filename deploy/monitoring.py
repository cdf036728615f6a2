"""Writes the Kubernetes monitoring component's objects made from deploy/'s signals.

deploy/k8s/components/monitoring gives a cluster run by the Prometheus Operator what
compose gets from deploy/prometheus.yml: a PodMonitor, the alert rules as a
PrometheusRule and the dashboard as a ConfigMap that Grafana's dashboard sidecar loads.
kustomize reads no file outside a component's folder, so the rule and the dashboard are
written into it from their one source here: ``python deploy/monitoring.py`` after
changing deploy/prometheus-rules.yml or deploy/grafana/phalanx.json, ``--check`` to
fail when what is written is out of date (the deploy tests run it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
RULES = DEPLOY / "prometheus-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "phalanx.json"
COMPONENT = DEPLOY / "k8s" / "components" / "monitoring"
#: The base's (deploy/k8s/base): a component's own objects do not get it from there.
NAMESPACE = "phalanx"
HEADER = "# Written by deploy/monitoring.py from deploy/{source}: edit that, then run it.\n"


def prometheus_rule() -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "phalanx", "namespace": NAMESPACE},
            "spec": {"groups": yaml.safe_load(RULES.read_text())["groups"]}}


def dashboard_config_map() -> dict:
    # Compact JSON: a ConfigMap's value is capped at 1 MiB with the object, and the
    # sidecar reads any JSON.
    dashboard = json.dumps(json.loads(DASHBOARD.read_text()), separators=(",", ":"))
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "phalanx-dashboard", "namespace": NAMESPACE,
                         "labels": {"grafana_dashboard": "1"}},
            "data": {DASHBOARD.name: dashboard}}


def written() -> dict[Path, str]:
    """Each generated file and the text it must hold."""
    def text(source: Path, obj: dict) -> str:
        return HEADER.format(source=source.relative_to(DEPLOY)) + yaml.safe_dump(
            obj, sort_keys=False, width=100)

    return {COMPONENT / "prometheus-rule.yaml": text(RULES, prometheus_rule()),
            COMPONENT / "dashboard.yaml": text(DASHBOARD, dashboard_config_map())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each file that is out of date")
    args = parser.parse_args(argv)
    wanted = written()
    stale = [path for path, text in wanted.items()
             if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(DEPLOY.parent)} is out of date: run "
                  "python deploy/monitoring.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
