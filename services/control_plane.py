"""What a phalanx cluster runs beside its agents: the control-plane services, listed once.

Each name is a service of which any number of instances run and one leads: the
command ``phalanx <name>``, the module ``phalanx.services.<name>`` and the bus role
of the same name, with its service API name (what the probes ask for) in
:data:`~phalanx.services.auth.roles.SERVICE_NAMES`. ``phalanx up``
(:mod:`~phalanx.services.cluster`) starts instances of each from this list;
``deploy/compose.yaml`` has a service of each name, ``deploy/prometheus.yml``
scrapes each, and the Kubernetes base has a Deployment ``phalanx-<name>`` of each.
``tests/deploy/test_deploy_services.py`` fails when one of them lists a service this
list does not, or lacks one it does.
"""

from __future__ import annotations

SERVICES: tuple[str, ...] = ("admission", "health", "elasticity", "checkpoint")

#: Services only the Kubernetes base runs: the auth callout (``phalanx callout``), which
#: admits each job's ranks as their job where the server's config cannot list a user per
#: job. Bare metal (``phalanx up --secure``) writes each job's NKEY user into the server's
#: config instead, and compose runs no authentication, so neither runs it.
KUBERNETES_ONLY: tuple[str, ...] = ("callout",)


def module(service: str) -> str:
    """The module ``python -m`` runs for ``service``."""
    return f"phalanx.services.{service}"
