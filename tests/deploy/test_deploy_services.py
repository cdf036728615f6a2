"""Every deployment runs the services ``phalanx up`` runs: ``control_plane.SERVICES``
(and Kubernetes also ``control_plane.KUBERNETES_ONLY``, the auth callout).

``phalanx up`` starts its instances from the list itself; compose.yaml, the
Prometheus config compose uses, and every rendered Kubernetes overlay must each
run (and probe, and scrape) exactly those services, so a service added to the
list and not to one of the files, or to a file and not to the list, fails here.
"""

from __future__ import annotations

import importlib.util

import pytest
from test_deploy_compose import METRICS_PORT, is_phalanx, load, scrape_targets
from test_deploy_k8s import OVERLAYS, by_kind, render

from phalanx.services import control_plane
from phalanx.services.auth.roles import SERVICE_NAMES, Role

SERVICES = set(control_plane.SERVICES)
#: Run by the Kubernetes base alone (the auth callout).
KUBERNETES_ONLY = set(control_plane.KUBERNETES_ONLY)


def test_each_service_has_a_module_a_role_and_a_service_api_name() -> None:
    for service in (*control_plane.SERVICES, *control_plane.KUBERNETES_ONLY):
        assert importlib.util.find_spec(f"{control_plane.module(service)}.__main__"), service
    assert {role.value for role in SERVICE_NAMES if role is not Role.AGENT} == \
        SERVICES | KUBERNETES_ONLY


def compose_services() -> dict[str, dict]:
    """compose.yaml's long-running phalanx containers that are not workers (agents)."""
    return {name: s for name, s in load()["services"].items()
            if is_phalanx(s) and s.get("restart") != "no" and s["command"][0] != "agent"}


def test_compose_runs_probes_and_scrapes_every_service() -> None:
    services = compose_services()
    assert set(services) == SERVICES
    for name, service in services.items():
        assert service["command"][0] == name
        assert service["healthcheck"]["test"][-1] == SERVICE_NAMES[Role(name)], name
    workers = {name for name, s in load()["services"].items()
               if is_phalanx(s) and s.get("command", [""])[0] == "agent"}
    control = {t for t in scrape_targets() if t.split(":")[0] not in workers}
    assert control == {f"{name}:{METRICS_PORT}" for name in SERVICES}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_runs_and_probes_every_service(overlay: str) -> None:
    deployments = by_kind(render(overlay), "Deployment")
    assert set(deployments) == {f"phalanx-{s}" for s in SERVICES | KUBERNETES_ONLY}
    for service in SERVICES | KUBERNETES_ONLY:
        spec = deployments[f"phalanx-{service}"]["spec"]
        assert spec["replicas"] >= 2, f"{service}: a standby takes over the lease"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["args"][0] == service
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"][3] == SERVICE_NAMES[Role(service)]
