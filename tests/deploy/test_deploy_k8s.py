"""deploy/k8s: rendered by kustomize, validated against the Kubernetes schemas, and run.

``kubectl kustomize`` renders each overlay; every rendered object is validated
offline and strictly (no unknown fields) with ``kubernetes-validate``. The slow
test then runs the local overlay's pods as local processes: two pods per
Deployment, an agent pod on every simulated node the DaemonSet selects, each with
exactly its container's command, args and environment (ConfigMap and Secret
references, the downward API and ``$(VAR)`` expanded as the kubelet does; mounted
ConfigMaps written out), a 3-server NATS cluster configured with the
TLS and authorization of deploy/k8s/nats-values.yaml and the values ``phalanx auth
kubernetes`` writes in the chart's place — then checks
every pod's probes and trains a job through them. Each pod runs what its image holds:
the control plane's processes cannot import torch, numpy, matplotlib or pynvml
(``deploy_local``'s import blocker), as in the ``phalanx-control-plane`` image.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import kubernetes_validate
import metrics_page
import nkeys
import pytest
import yaml
from cryptography import x509
from deploy_local import (
    DEPLOY,
    Container,
    Image,
    Processes,
    World,
    healthy_http,
    processes,
    train,
    wait_for,
)
from test_deploy_compose import RULES

from phalanx.services import control_plane
from phalanx.services.auth import kubernetes
from phalanx.services.auth.issuer import AuthDir, authorization
from phalanx.services.auth.roles import ANY, Role, identity
from phalanx.services.natsd import NatsServer, Routes, RouteSecurity, server_binary
from phalanx.services.ports import free_port

K8S = DEPLOY / "k8s"
OVERLAYS = ("local", "gpu")
KUBERNETES_VERSION = "1.30.0"  # the oldest release we claim to run on
# Simulated nodes: two labelled workers (one with a dotted name, as on EKS) and a
# control-plane node the DaemonSet must leave alone.
NODES = {"kind-worker": {"phalanx.dev/worker": "true"},
         "ip-10-0-0-7.ec2.internal": {"phalanx.dev/worker": "true"},
         "kind-control-plane": {}}
STEPS = 30
SERVICE_METRICS = (9464,)  # the control plane's, in its pods' own network namespaces
# Ports an agent on the host network must leave alone: NATS (client, route, monitoring,
# leaf), the ranks' MASTER_PORT range and Linux's ephemeral ports (gloo's sockets).
NATS_PORTS = (4222, 6222, 8222, 7422)
RANK_PORTS = (29500, 39499)
EPHEMERAL = (32768, 60999)


@functools.cache
def deployment_copy() -> Path:
    """deploy/k8s copied as an operator would use it: the local overlay's bus identities
    made first (``phalanx auth kubernetes``, into its git-ignored ``auth/``)."""
    root = Path(tempfile.mkdtemp(prefix="phalanx-k8s-")) / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("auth"))
    made = subprocess.run([sys.executable, "-m", "phalanx.services.cli", "auth", "kubernetes",
                           str(root / "overlays" / "local" / "auth")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return root


@functools.cache
def _rendered(overlay: str, component: str | None = None) -> str:
    """``kubectl kustomize`` of the overlay; with ``component``, of an overlay of the
    operator's over it that adds that component, as docs/deploy.md shows."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed")
        pytest.skip("kubectl not installed")
    folder = deployment_copy() / "overlays" / overlay
    if component is not None:
        mine = folder.parent / f"{overlay}-{component}"
        mine.mkdir()
        (mine / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [f"../{overlay}"], "components": [f"../../components/{component}"]}))
        folder = mine
    result = subprocess.run([kubectl, "kustomize", str(folder)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(overlay: str, component: str | None = None) -> list[dict]:
    """The overlay's objects (with ``component``), rendered by kustomize (a fresh copy
    each call), read with libyaml's safe loader where PyYAML has it: the pure-Python one
    took seconds."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [d for d in yaml.load_all(_rendered(overlay, component), Loader=loader) if d]


def auth_dir() -> AuthDir:
    """The local overlay's auth directory (:func:`deployment_copy`)."""
    return AuthDir(deployment_copy() / "overlays" / "local" / "auth")


def nats_values() -> dict:
    """deploy/k8s/nats-values.yaml, then the auth directory's values, merged as helm does
    with two ``-f`` files (maps merged key by key, anything else replaced)."""
    def merge(base: dict, top: dict) -> dict:
        return {**base, **{k: merge(base[k], v) if isinstance(v, dict)
                           and isinstance(base.get(k), dict) else v for k, v in top.items()}}

    return merge(yaml.safe_load((K8S / "nats-values.yaml").read_text()),
                 yaml.safe_load((auth_dir().root / "nats-auth-values.yaml").read_text()))


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers_of(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "DaemonSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


# --- rendered and validated ----------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_valid_kubernetes(overlay: str) -> None:
    docs = render(overlay)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_wrong_field() -> None:
    """The validator above is not a rubber stamp."""
    deployment = by_kind(render("local"), "Deployment")["phalanx-admission"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_follow_the_deployment_rules(overlay: str) -> None:
    docs = render(overlay)
    deployments = by_kind(docs, "Deployment")
    assert {f"phalanx-{s}" for s in (*control_plane.SERVICES, *control_plane.KUBERNETES_ONLY)
            } == set(deployments)
    assert all(d["spec"]["replicas"] == 2 for d in deployments.values()), \
        "every lease-holding service runs a standby"
    assert set(by_kind(docs, "DaemonSet")) == {"phalanx-agent"}
    assert not by_kind(docs, "StatefulSet"), "NATS comes from the official chart"
    # Least privilege: no API access at all, no token in any pod.
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding",
                                                 "ClusterRoleBinding")]
    assert all(sa.get("automountServiceAccountToken") is False
               for sa in by_kind(docs, "ServiceAccount").values())
    [environment] = [cm["data"] for name, cm in by_kind(docs, "ConfigMap").items()
                     if name.startswith("phalanx-env")]
    for workload, c in containers_of(docs):
        spec = workload["spec"]["template"]["spec"]
        name = workload["metadata"]["name"]
        # What it names is in its own namespace (a pod sees no other's).
        here = {(d["kind"], d["metadata"]["name"]) for d in docs
                if d["metadata"].get("namespace") == workload["metadata"]["namespace"]}
        assert ("ServiceAccount", spec["serviceAccountName"]) in here, name
        assert {("ConfigMap", s["configMapRef"]["name"]) for s in c["envFrom"]} <= here, name
        assert {("ConfigMap", v["configMap"]["name"]) for v in spec["volumes"]
                if "configMap" in v} <= here, name
        if by_kind(docs, "Secret"):  # rendered (local), not applied beforehand (gpu)
            assert {("Secret", v["secret"]["secretName"]) for v in spec["volumes"]
                    if "secret" in v} <= here, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert {"cpu", "memory", "ephemeral-storage"} <= set(c["resources"]["requests"]), name
        assert {"memory", "ephemeral-storage"} <= set(c["resources"]["limits"]), name
        # A read-only root, every writable place an emptyDir of bounded size, HOME one.
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        scratch = {v["name"]: v["emptyDir"] for v in spec["volumes"] if "emptyDir" in v}
        assert all("sizeLimit" in dir_ for dir_ in scratch.values()), name
        mounted = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounted.get(environment["HOME"]) in scratch, name
        for probe in ("readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            assert command[:2] == ["python", "/opt/phalanx/deploy/probe.py"], name
            assert command[3] == name, f"{name}'s {probe} asks for its own service"
        # Scrape-ready: the annotations name the port called metrics, which is the one
        # the process serves on.
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"]
        assert annotations["prometheus.io/port"] == str(port), name
        assert {"name": "PHALANX_METRICS_PORT", "value": str(port)} in c["env"], name
        if spec.get("hostNetwork"):  # a port of the node: clear of NATS, kubelet, ranks
            assert port not in (*NATS_PORTS, *SERVICE_METRICS, 9100, 10250), name
            assert port < RANK_PORTS[0] and not EPHEMERAL[0] <= port <= EPHEMERAL[1], name
        else:
            assert port in SERVICE_METRICS, name
        # Its own identity over TLS: its seed and the CA mounted from the identities'
        # Secret, those items alone; no credential in a variable or a ConfigMap.
        own = identity(Role.AGENT, ANY) if workload["kind"] == "DaemonSet" \
            else identity(Role(name.removeprefix("phalanx-")))
        values = {e["name"]: e.get("value") for e in c["env"]}
        assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})], name
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == (
            kubernetes.AGENT_SECRET if workload["kind"] == "DaemonSet"
            else kubernetes.IDENTITIES_SECRET), name
        items = {i["key"] for i in volume["secret"]["items"]}
        (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert values["PHALANX_NATS_NKEY"] == f"{mount}/{own}.nk", name
        assert values["PHALANX_NATS_INBOX_PREFIX"] == f"_INBOX.{own}", name
        assert values["PHALANX_NATS_CA"] == f"{mount}/ca.pem", name
        if workload["kind"] == "DaemonSet":  # its ranks connect as their job: a token
            token_key = kubernetes.TOKEN_KEY_ITEM
            assert values["PHALANX_AGENT_RANK_TOKEN_KEY_FILE"] == f"{mount}/{token_key}"
            assert "PHALANX_AGENT_RANK_NKEY" not in values
            assert values["PHALANX_AGENT_REPLICA_KEY_FILE"] == f"{mount}/replication.key"
            assert values["PHALANX_AGENT_REPLICA_TLS_DIR"] == mount  # with ca.pem there
            assert items == {f"{own}.nk", token_key, "ca.pem", "replication.key",
                             "replication.pem", "replication-key.pem"}
        elif name == "phalanx-callout":  # and its keys to sign, verify, revoke, alone
            assert values["PHALANX_CALLOUT_ISSUER_SEED_FILE"] == \
                f"{mount}/{kubernetes.ISSUER_ITEM}"
            assert values["PHALANX_CALLOUT_TOKEN_KEY_FILE"] == \
                f"{mount}/{kubernetes.TOKEN_KEY_ITEM}"
            assert values["PHALANX_CALLOUT_SYSTEM_SEED_FILE"] == \
                f"{mount}/{kubernetes.SYSTEM_ITEM}"
            assert items == {f"{own}.nk", "ca.pem", kubernetes.ISSUER_ITEM,
                             kubernetes.TOKEN_KEY_ITEM, kubernetes.SYSTEM_ITEM}
        else:
            assert items == {f"{own}.nk", "ca.pem"}, name
    for cm in by_kind(docs, "ConfigMap").values():
        assert not any(w in k for k in cm["data"] for w in ("PASSWORD", "TOKEN", "NKEY"))
    agent = by_kind(docs, "DaemonSet")["phalanx-agent"]["spec"]["template"]["spec"]
    assert agent["nodeSelector"]["phalanx.dev/worker"] == "true"
    slots = next(cm["data"]["PHALANX_AGENT_SLOTS"] for cm in by_kind(docs, "ConfigMap")
                 .values() if "PHALANX_AGENT_SLOTS" in cm["data"])
    resources = agent["containers"][0]["resources"]
    if overlay == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == slots, "one slot per GPU"
        assert agent["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            agent["tolerations"]
        assert agent["containers"][0]["image"].endswith("-cuda")
    else:
        assert "nvidia.com/gpu" not in resources["limits"]
        assert int(slots) <= int(resources["requests"]["cpu"]), "a CPU per rank slot"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_gets_the_otlp_settings_and_names_itself(overlay: str) -> None:
    """The exporter switch and the collector's endpoint reach every container (through the
    shared ConfigMap), and none is given a service name: each process names its own spans
    (phalanx-admission, phalanx-agent, and the agent's ranks, which inherit its
    environment, phalanx-rank)."""
    docs = render(overlay)
    config_maps = by_kind(docs, "ConfigMap")
    workloads = 0
    for workload, c in containers_of(docs):
        env = {}
        for source in c.get("envFrom", []):
            env.update(config_maps[source["configMapRef"]["name"]]["data"])
        env.update({e["name"]: e.get("value") for e in c.get("env", [])})
        name = workload["metadata"]["name"]
        assert env["OTEL_TRACES_EXPORTER"] in ("none", "otlp"), name
        assert re.fullmatch(r"https?://[a-z0-9.-]+:4318", env["OTEL_EXPORTER_OTLP_ENDPOINT"]), \
            name
        assert "OTEL_SERVICE_NAME" not in env, name
        workloads += 1
    # and the callout, and the agent
    assert workloads == len(control_plane.SERVICES) + len(control_plane.KUBERNETES_ONLY) + 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_confines_the_pods_it_can_to_what_they_use(overlay: str) -> None:
    """Every pod not on the host network is selected (the agents are on it, where no
    policy applies); it is reachable only on its declared metrics port and reaches only
    the chart's NATS client port, the cluster DNS and the OTLP endpoint's port."""
    docs = render(overlay)
    spec = by_kind(docs, "NetworkPolicy")["phalanx-control-plane"]["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}

    def selected(workload: dict) -> bool:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        return all(labels.get(k) == v for k, v in spec["podSelector"]["matchLabels"].items())

    for workload, c in containers_of(docs):
        on_host = bool(workload["spec"]["template"]["spec"].get("hostNetwork"))
        assert selected(workload) != on_host, workload["metadata"]["name"]
        if not on_host:
            (ingress,) = spec["ingress"]
            assert "from" not in ingress  # scraped from wherever Prometheus runs
            named = {p["name"] for p in c["ports"]}
            assert {p["port"] for p in ingress["ports"]} <= named
    env = next(cm["data"] for cm in by_kind(docs, "ConfigMap").values()
               if "PHALANX_NATS_URL" in cm["data"])
    nats_port = int(env["PHALANX_NATS_URL"].rsplit(":", 1)[1])
    otlp_port = int(env["OTEL_EXPORTER_OTLP_ENDPOINT"].rsplit(":", 1)[1])
    allowed = {(p["port"], p["protocol"]) for rule in spec["egress"] for p in rule["ports"]}
    assert allowed == {(nats_port, "TCP"), (53, "UDP"), (53, "TCP"), (otlp_port, "TCP")}
    nats_rule = next(r for r in spec["egress"] if r["ports"][0]["port"] == nats_port)
    (to,) = nats_rule["to"]
    assert to["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == \
        kubernetes.RELEASE


def test_the_nats_servers_take_routes_only_from_each_other_and_run_unprivileged() -> None:
    """The NATS chart's pods: clients and monitoring from anywhere (agents come from node
    addresses), routes only from the chart's servers; no root, no capabilities."""
    spec = by_kind(render("local"), "NetworkPolicy")["phalanx-nats"]["spec"]
    servers = {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": kubernetes.RELEASE}
    assert spec["podSelector"]["matchLabels"] == servers and spec["policyTypes"] == ["Ingress"]
    open_ports = {p["port"] for rule in spec["ingress"] if "from" not in rule
                  for p in rule["ports"]}
    assert open_ports == {4222, 8222}
    (routes,) = [rule for rule in spec["ingress"] if "from" in rule]
    assert [p["port"] for p in routes["ports"]] == [6222]
    assert routes["from"] == [{"podSelector": {"matchLabels": servers}}]
    values = nats_values()
    for part in (values["container"], values["reloader"]):
        context = part["merge"]["securityContext"]
        assert context["runAsNonRoot"] and not context["allowPrivilegeEscalation"]
        assert context["readOnlyRootFilesystem"] and context["capabilities"] == {"drop": ["ALL"]}
    pod = values["podTemplate"]["merge"]["spec"]["securityContext"]
    assert pod["runAsUser"] != 0 and pod["fsGroup"] == pod["runAsGroup"]


# Pod Security Standards (Kubernetes 1.30's policy): what each level refuses, by field.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL",
                         "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID",
                         "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def pod_security_violations(spec: dict, level: str) -> set[str]:
    """The fields of the pod ``spec`` that Pod Security's ``level`` ("baseline" or
    "restricted") refuses, as the API server's admission judges them."""
    found: set[str] = set()
    pod = spec.get("securityContext", {})
    containers = [*spec.get("initContainers", []), *spec["containers"],
                  *spec.get("ephemeralContainers", [])]
    contexts = [c.get("securityContext", {}) for c in containers]
    found |= {k for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)}
    found |= {"volumes.hostPath" for v in spec.get("volumes", []) if "hostPath" in v}
    found |= {"sysctls" for s in pod.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS}
    for context in (pod, *contexts):
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.add("seccompProfile")
        if context.get("appArmorProfile", {}).get("type") == "Unconfined":
            found.add("appArmorProfile")
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type", "") not in SELINUX_TYPES or "user" in selinux \
                or "role" in selinux:
            found.add("seLinuxOptions")
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.add("hostProcess")
    for c, context in zip(containers, contexts, strict=True):
        if context.get("privileged"):
            found.add("privileged")
        if set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            found.add("capabilities.add")
        if context.get("procMount", "Default") != "Default":
            found.add("procMount")
        if any(port.get("hostPort") for port in c.get("ports", [])):
            found.add("hostPort")
    if level == "baseline":
        return found
    assert level == "restricted", level
    found |= {"volumes" for v in spec.get("volumes", [])
              if not set(v) - {"name"} <= RESTRICTED_VOLUMES}
    for context in contexts:
        if context.get("allowPrivilegeEscalation") is not False:
            found.add("allowPrivilegeEscalation")
        if "ALL" not in context.get("capabilities", {}).get("drop", []):
            found.add("capabilities.drop")
        if set(context.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            found.add("capabilities.add")
        if context.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            found.add("runAsNonRoot")
        if 0 in (context.get("runAsUser"), pod.get("runAsUser")):
            found.add("runAsUser")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.add("seccompProfile")
    return found


def chart_pod(values: dict) -> dict:
    """The NATS chart's server pod as our values shape it: the server and its config
    reloader with the values' security contexts, the pod's, and the kinds of volume the
    chart mounts (its config, pid dir, TLS Secrets and JetStream claim)."""
    assert values["natsBox"]["enabled"] is False, "nats-box: a pod our values do not shape"
    assert not values.get("promExporter", {}).get("enabled"), "a container not shaped here"
    return {"securityContext": values["podTemplate"]["merge"]["spec"]["securityContext"],
            "containers": [{"name": part, "securityContext":
                            values[part]["merge"]["securityContext"]}
                           for part in ("container", "reloader")],
            "volumes": [{"name": "config", "configMap": {}}, {"name": "pid", "emptyDir": {}},
                        {"name": "tls", "secret": {}}, {"name": "js",
                                                        "persistentVolumeClaim": {}}]}


@pytest.mark.parametrize(("overlay", "component"), [*((o, None) for o in OVERLAYS),
                                                    ("local", "job-users")])
def test_each_namespace_enforces_the_pod_security_its_pods_need(
        overlay: str, component: str | None) -> None:
    """phalanx (control plane, callout, NATS) enforces restricted, and every pod of it
    meets it; the agents alone are in phalanx-nodes, privileged for the one setting
    baseline refuses them, the host network."""
    docs = render(overlay, component)
    levels = {n["metadata"]["name"]: n["metadata"]["labels"] for n in docs
              if n["kind"] == "Namespace"}
    assert {name: labels["pod-security.kubernetes.io/enforce"]
            for name, labels in levels.items()} == {kubernetes.NAMESPACE: "restricted",
                                                    kubernetes.NODES_NAMESPACE: "privileged"}
    assert all(d["metadata"]["namespace"] in levels for d in docs if d["kind"] != "Namespace")
    pods = {(d["metadata"]["namespace"], d["metadata"]["name"]): d["spec"]["template"]["spec"]
            for d in docs if "template" in d.get("spec", {})}
    pods[(kubernetes.NAMESPACE, kubernetes.RELEASE)] = chart_pod(nats_values())
    assert {name for namespace, name in pods if namespace == kubernetes.NODES_NAMESPACE} == \
        {"phalanx-agent"}
    for (namespace, name), spec in pods.items():
        if namespace == kubernetes.NAMESPACE:
            assert pod_security_violations(spec, "restricted") == set(), name
    agent = pods[(kubernetes.NODES_NAMESPACE, "phalanx-agent")]
    assert pod_security_violations(agent, "baseline") == {"hostNetwork"}, \
        "base/namespace.yaml names hostNetwork as what makes the agents' namespace privileged"
    restricted = pod_security_violations(agent, "restricted")
    if component == "job-users":  # root with capabilities: baseline allows, restricted not
        assert restricted == {"hostNetwork", "runAsNonRoot", "runAsUser", "capabilities.add"}
    else:
        assert restricted == {"hostNetwork"}


def test_the_pod_security_check_names_each_privileged_setting() -> None:
    """The check above is not a rubber stamp: each setting the restricted profile refuses,
    added to a control-plane pod, is named."""
    spec = by_kind(render("local"), "Deployment")["phalanx-admission"]["spec"]["template"][
        "spec"]
    assert pod_security_violations(spec, "restricted") == set()
    context = spec["containers"][0]["securityContext"]
    changes = {
        "hostNetwork": lambda s: s.update(hostNetwork=True),
        "hostPID": lambda s: s.update(hostPID=True),
        "volumes.hostPath": lambda s: s["volumes"].append({"name": "h", "hostPath": {
            "path": "/"}}),
        "privileged": lambda s: s["containers"][0]["securityContext"].update(privileged=True),
        "allowPrivilegeEscalation": lambda s: s["containers"][0]["securityContext"].pop(
            "allowPrivilegeEscalation"),
        "capabilities.drop": lambda s: s["containers"][0]["securityContext"].update(
            capabilities={"drop": []}),
        "capabilities.add": lambda s: s["containers"][0]["securityContext"].update(
            capabilities={"drop": ["ALL"], "add": ["SETUID"]}),
        "runAsNonRoot": lambda s: s["securityContext"].pop("runAsNonRoot"),
        "runAsUser": lambda s: s["containers"][0]["securityContext"].update(runAsUser=0),
        "seccompProfile": lambda s: s["securityContext"].pop("seccompProfile"),
        "hostPort": lambda s: s["containers"][0]["ports"][0].update(hostPort=9464),
    }
    for field, change in changes.items():
        changed = json.loads(json.dumps(spec))
        change(changed)
        assert field in pod_security_violations(changed, "restricted"), field
    assert context == spec["containers"][0]["securityContext"]


def test_nats_routes_are_mutual_tls_of_the_ca_with_a_password_from_a_secret() -> None:
    """The chart's routes: TLS with the route certificate of phalanx's CA, which names
    every server the routes dial, each end verifying the other's; the routes' password
    from the Secret, one route URL per server."""
    values = nats_values()
    cluster = values["config"]["cluster"]
    secret = by_kind(render("local"), "Secret")[kubernetes.ROUTES_SECRET]
    assert secret["metadata"]["namespace"] == kubernetes.NAMESPACE
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert cluster["tls"]["enabled"] is True
    assert cluster["tls"]["secretName"] == kubernetes.ROUTES_SECRET
    assert cluster["tls"]["merge"] == {"ca_file": "/etc/nats-certs/cluster/ca.crt",
                                       "verify": True, "timeout": 2}
    assert files["ca.crt"] == auth_dir().ca_path.read_bytes()
    cert = x509.load_pem_x509_certificate(files["tls.crt"])
    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    cert.verify_directly_issued_by(ca)
    names = set(cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName))
    replicas = cluster["replicas"]
    (patch,) = cluster["patch"]
    assert patch["op"] == "replace" and patch["path"] == "/routes"
    assert patch["value"] == [f"<< $ROUTE_URL_{i} >>" for i in range(replicas)]
    env = values["container"]["env"]
    assert sorted(env).index("ROUTE_PASSWORD") < sorted(env).index("ROUTE_URL_0"), \
        "the chart lists variables in name order; $(VAR) expands earlier ones alone"
    for i in range(replicas):
        url = env[f"ROUTE_URL_{i}"]
        host = f"nats-{i}.{kubernetes.RELEASE}-headless"
        assert url == f"tls://route:$(ROUTE_PASSWORD)@{host}:6222", url
        assert "*." + host.split(".", 1)[1] in names, host
    assert set(kubernetes.route_hosts(kubernetes.NAMESPACE)) <= names
    assert cluster["merge"]["authorization"]["user"] == "route"
    assert len(files[kubernetes.ROUTE_PASSWORD_ITEM]) >= 32


def test_the_monitoring_component_watches_every_phalanx_pod_with_the_rules_and_dashboard(
        ) -> None:
    """components/monitoring: its PodMonitor selects every phalanx workload's pods, in
    their namespace, on their ``metrics`` port; its PrometheusRule and dashboard ConfigMap
    are deploy/'s rules and dashboard as written now (deploy/monitoring.py)."""
    up_to_date = monitoring_check(DEPLOY)
    assert up_to_date.returncode == 0, up_to_date.stderr
    docs = render("local", "monitoring")
    [monitor] = by_kind(docs, "PodMonitor").values()
    [rule] = by_kind(docs, "PrometheusRule").values()
    dashboard = by_kind(docs, "ConfigMap")["phalanx-dashboard"]
    workloads = {**by_kind(docs, "Deployment"), **by_kind(docs, "DaemonSet")}
    assert {name for name in workloads if name.startswith("phalanx-")} == \
        {f"phalanx-{s}" for s in (*control_plane.SERVICES, "callout", "agent")}
    selector = monitor["spec"]["selector"]["matchLabels"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    for name, workload in workloads.items():
        template = workload["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), name
        assert workload["metadata"]["namespace"] in \
            monitor["spec"]["namespaceSelector"]["matchNames"], name
        ports = {p.get("name") for c in template["spec"]["containers"] for p in c["ports"]}
        assert endpoint["port"] in ports, name
    assert rule["metadata"]["namespace"] == dashboard["metadata"]["namespace"] == "phalanx"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    assert dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(dashboard["data"]["phalanx.json"]) == \
        json.loads((DEPLOY / "grafana" / "phalanx.json").read_text())


def monitoring_check(deploy: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(deploy / "monitoring.py"), "--check"],
                          capture_output=True, text=True, timeout=60)


def test_a_monitoring_object_out_of_date_is_named(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy"
    for part in ("monitoring.py", "prometheus-rules.yml", "grafana",
                 "k8s/components/monitoring"):
        copy = shutil.copytree if (DEPLOY / part).is_dir() else shutil.copyfile
        (deploy / part).parent.mkdir(parents=True, exist_ok=True)
        copy(DEPLOY / part, deploy / part)
    assert monitoring_check(deploy).returncode == 0
    rules = deploy / "prometheus-rules.yml"
    rules.write_text(rules.read_text().replace("for: 2m", "for: 3m"))
    stale = monitoring_check(deploy)
    assert stale.returncode == 1
    assert "k8s/components/monitoring/prometheus-rule.yaml is out of date" in stale.stderr


def test_nats_values_give_a_jetstream_cluster_admitting_exactly_the_identities() -> None:
    values = nats_values()
    assert values["config"]["cluster"]["enabled"] is True
    assert values["config"]["cluster"]["replicas"] >= 3
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["jetstream"]["fileStore"]["pvc"]["size"]
    # TLS from the Secret the overlay renders; one NKEY user per identity, with exactly
    # its role's permissions: the agents' and the ranks' shared, each service its own.
    secrets = by_kind(render("local"), "Secret")
    tls = values["config"]["nats"]["tls"]
    assert tls["enabled"] is True
    assert secrets[tls["secretName"]]["type"] == "kubernetes.io/tls"
    assert {"tls.crt", "tls.key"} <= set(secrets[tls["secretName"]]["data"])
    who = auth_dir().identities()
    assert {w.name for w in who} == {*(identity(r) for r in (
        Role.ADMISSION, Role.HEALTH, Role.ELASTICITY, Role.CHECKPOINT, Role.CLI, Role.VIEWER,
        Role.CALLOUT)), identity(Role.AGENT, ANY)}
    block = values["config"]["merge"]["authorization"]
    assert block["users"] == authorization(who)["users"]
    # Every other connection (a job's ranks, by their token) is the auth callout's to admit;
    # it signs with the key whose seed only its pods mount.
    issuer = base64.b64decode(secrets[kubernetes.IDENTITIES_SECRET]["data"][
        kubernetes.ISSUER_ITEM])
    # The system account's one user is the callout's revoker: its seed is the control
    # plane's alone, and the callout does not decide about it either.
    system_seed = base64.b64decode(secrets[kubernetes.IDENTITIES_SECRET]["data"][
        kubernetes.SYSTEM_ITEM])
    system_user = nkeys.from_seed(bytearray(system_seed)).public_key.decode()
    assert values["config"]["merge"]["system_account"] == kubernetes.SYSTEM_ACCOUNT
    assert values["config"]["merge"]["accounts"] == {
        kubernetes.SYSTEM_ACCOUNT: {"users": [{"nkey": system_user}]}}
    assert kubernetes.SYSTEM_ITEM not in secrets[kubernetes.AGENT_SECRET]["data"]
    assert block["auth_callout"] == {
        "issuer": nkeys.from_seed(bytearray(issuer)).public_key.decode(),
        "auth_users": sorted([*(w.public_key for w in who), system_user])}
    # Each seed in the identities' Secrets is the one whose public key the server admits;
    # the agents' in their namespace's alone, the others' in the control plane's alone.
    control, nodes = (secrets[s]["data"] for s in (kubernetes.IDENTITIES_SECRET,
                                                   kubernetes.AGENT_SECRET))
    assert not {k for k in control if k.endswith(".nk")} & {k for k in nodes
                                                            if k.endswith(".nk")}
    assert not {"replication.key", "replication-key.pem"} & set(control)
    seeds = {**control, **nodes}
    for w in who:
        seed = bytearray(base64.b64decode(seeds[f"{w.name}.nk"]))
        assert nkeys.from_seed(seed).public_key.decode() == w.public_key, w.name
    # No credential in the committed values: the routes' password is a variable of the
    # servers' (from the Secret), which the route URLs expand.
    committed = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    password = committed["config"]["cluster"]["merge"]["authorization"]["password"]
    assert password == "<< $ROUTE_PASSWORD >>"
    assert committed["container"]["env"]["ROUTE_PASSWORD"] == {"valueFrom": {"secretKeyRef": {
        "name": kubernetes.ROUTES_SECRET, "key": kubernetes.ROUTE_PASSWORD_ITEM}}}
    route_password = base64.b64decode(secrets[kubernetes.ROUTES_SECRET]["data"][
        kubernetes.ROUTE_PASSWORD_ITEM]).decode()
    assert route_password not in (K8S / "nats-values.yaml").read_text()
    replicas = next(cm["data"]["PHALANX_NATS_REPLICAS"] for cm in
                    by_kind(render("local"), "ConfigMap").values()
                    if "PHALANX_NATS_REPLICAS" in cm["data"])
    assert int(replicas) <= values["config"]["cluster"]["replicas"]


# --- the local overlay as local processes --------------------------------------------------


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: defined names replaced, ``$$`` escapes, others
    left as they are."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


class Cluster:
    """The rendered objects and the simulated nodes, resolving what a pod's container gets."""

    def __init__(self, docs: list[dict], root: Path) -> None:
        self.docs = docs
        self.root = root
        # By namespace and name: a pod gets what its own namespace holds, as the kubelet
        # resolves its references.
        self.config_maps = {(d["metadata"]["namespace"], d["metadata"]["name"]): d
                            for d in docs if d["kind"] == "ConfigMap"}
        self.secrets = {(s["metadata"]["namespace"], s["metadata"]["name"]):
                        {k: base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
                        for s in docs if s["kind"] == "Secret"}

    def pod(self, workload: dict, pod_name: str, node: str) -> Container:
        spec = workload["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        image = Image.named(c["image"])  # the deploy/Dockerfile target that builds it
        namespace = workload["metadata"]["namespace"]
        fields = {"metadata.name": pod_name, "metadata.namespace": namespace,
                  "spec.nodeName": node, "status.podIP": "127.0.0.1"}
        env = dict(image.env)
        for source in c.get("envFrom", []):
            env.update(self.config_maps[namespace, source["configMapRef"]["name"]]["data"])
        for var in c.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif "fieldRef" in var["valueFrom"]:
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in var["valueFrom"]:
                ref = var["valueFrom"]["secretKeyRef"]
                env[var["name"]] = self.secrets[namespace, ref["name"]][ref["key"]]
            else:
                ref = var["valueFrom"]["configMapKeyRef"]
                env[var["name"]] = self.config_maps[namespace, ref["name"]]["data"][
                    ref["key"]]
        # command replaces the image's entry point (and drops its CMD), args its CMD.
        command = c.get("command", list(image.entrypoint))
        args = c.get("args", list(image.cmd) if "command" not in c else [])
        argv = [expand(a, env) for a in command + args]
        assert not [a for a in argv if re.search(r"\$\([A-Za-z_]", a)], argv
        mounts = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in c.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            key = f"{pod_name}-{mount['name']}"
            mounts[mount["mountPath"]] = key
            if "configMap" in volume:
                directory = self.root / "volumes" / key
                directory.mkdir(parents=True, exist_ok=True)
                for name, text in self.config_maps[namespace, volume["configMap"]["name"]][
                        "data"].items():
                    (directory / name).write_text(text)
            elif "secret" in volume:
                directory = self.root / "volumes" / key
                directory.mkdir(parents=True, exist_ok=True)
                data = self.secrets[namespace, volume["secret"]["secretName"]]
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:  # only the items named, as the kubelet projects them
                    (directory / item["path"]).write_text(data[item["key"]])
                    (directory / item["path"]).chmod(volume["secret"].get("defaultMode", 0o644))
        ports = tuple(p["containerPort"] for p in c.get("ports", []))
        return Container(pod_name, argv, env, c.get("workingDir", image.workdir), mounts, ports,
                         image.absent)

    def probe(self, procs: Processes, pod: str, workload: dict, kind: str):
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        return procs.exec(pod, c[f"{kind}Probe"]["exec"]["command"])

    def judged_live(self, procs: Processes, pod: str, workload: dict):
        """The liveness probe as the kubelet judges it: a pod is restarted only after
        ``failureThreshold`` failures in a row (one slow answer on a loaded node is not
        a dead process). The last result, passing unless all of them failed."""
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        for _ in range(c["livenessProbe"].get("failureThreshold", 3)):
            result = self.probe(procs, pod, workload, "liveness")
            if result.returncode == 0:
                break
        return result


#: Where the chart mounts ``config.nats.tls.secretName`` (its ``config.nats.tls.dir``) and
#: ``config.cluster.tls.secretName`` (``config.cluster.tls.dir``).
CHART_CERT_DIR = "/etc/nats-certs/nats"
CHART_ROUTE_CERT_DIR = "/etc/nats-certs/cluster"
#: The port the chart's servers take routes on (``config.cluster.port``).
CHART_ROUTE_PORT = 6222


def json_patch(doc: dict, patch: list[dict]) -> dict:
    """``patch`` applied to ``doc``'s top-level keys, as the chart's ``patch`` values are
    (the operations our values use)."""
    doc = dict(doc)
    for op in patch:
        key = op["path"].removeprefix("/")
        assert "/" not in key and op["op"] in ("add", "replace", "remove"), op
        if op["op"] == "remove":
            del doc[key]
        else:
            doc[key] = op["value"]
    return doc


def nats_conf(values: dict, cert_dirs: dict[str, str], route_listen: str) -> str:
    """What the chart makes of the values' client TLS, cluster and ``config.merge``, as
    nats.conf: JSON, with ``<< x >>`` unquoted. ``cert_dirs``: where each TLS Secret's
    mount path of the chart's lies here; ``route_listen``: where this server takes
    routes here (the chart's port, 6222, is every pod's own)."""
    config = values["config"]
    conf = dict(config["merge"])
    if config.get("nats", {}).get("tls", {}).get("enabled"):
        conf["tls"] = {"cert_file": f"{cert_dirs[CHART_CERT_DIR]}/tls.crt",
                       "key_file": f"{cert_dirs[CHART_CERT_DIR]}/tls.key"}
    cluster = config["cluster"]
    if cluster.get("enabled"):  # the chart's files/config/cluster.yaml, then merge, patch
        tls = cluster.get("tls", {})
        proto = "tls" if tls.get("enabled") else "nats"
        block: dict = {"name": "nats", "listen": route_listen, "no_advertise": True,
                       "routes": [f"{proto}://nats-{i}.nats-headless:{CHART_ROUTE_PORT}"
                                  for i in range(cluster["replicas"])]}
        if tls.get("enabled"):
            local = cert_dirs[CHART_ROUTE_CERT_DIR]
            block["tls"] = {"cert_file": f"{local}/tls.crt", "key_file": f"{local}/tls.key",
                            **{k: v.replace(CHART_ROUTE_CERT_DIR, local)
                               if isinstance(v, str) else v
                               for k, v in tls.get("merge", {}).items()}}
        block.update(cluster.get("merge", {}))
        conf["cluster"] = json_patch(block, cluster.get("patch", []))
    return re.sub(r'"<< (.*?) >>"', r"\1", json.dumps(conf, indent=2))


def chart_env(values: dict, secrets: dict, namespace: str) -> dict[str, str]:
    """The server container's ``container.env`` as the kubelet gives it: in name order
    (the chart writes the map so), Secret references resolved, ``$(VAR)`` expanded."""
    env: dict[str, str] = {}
    for name, value in sorted(values.get("container", {}).get("env", {}).items()):
        if isinstance(value, str):
            env[name] = expand(value, env)
        else:
            ref = value["valueFrom"]["secretKeyRef"]
            env[name] = secrets[namespace, ref["name"]][ref["key"]]
    return env


@dataclasses.dataclass
class NatsCluster:
    """The chart's servers as local processes: their client URLs, and each one's route
    and monitoring ports."""

    urls: list[str]
    routes: list[int]
    monitors: list[int]


def routes_of(monitor: int) -> set[str]:
    """The servers the one monitored at ``monitor`` has routes to (by name: a pair of
    servers holds a pool of route connections)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/routez", timeout=2) as answer:
        return {r["remote_name"] for r in json.load(answer)["routes"] or []}


def start_nats(procs: Processes, values: dict, secrets: dict, root: Path) -> NatsCluster:
    """The chart's routed nats-servers (``config.cluster.replicas``) with JetStream, the
    values' client TLS, routes (mutual TLS, password) and authorization, each Secret the
    values name mounted where the chart mounts it, the route URLs' host names those of
    the local servers."""
    namespace = kubernetes.NAMESPACE  # the release's
    config = root / "volumes" / "nats-config"
    config.mkdir(parents=True)
    # The TLS Secrets as the chart mounts them; the config names them where they lie here
    # (a file's contents are not translated as a command line is).
    cert_dirs = {}
    for mount, part in ((CHART_CERT_DIR, "nats"), (CHART_ROUTE_CERT_DIR, "cluster")):
        tls = values["config"][part].get("tls", {})
        local = root / "volumes" / f"nats-certs-{part}"
        local.mkdir(parents=True)
        cert_dirs[mount] = str(local)
        for name, text in secrets[namespace, tls["secretName"]].items() \
                if tls.get("enabled") else ():
            (local / name).write_text(text)
    n = values["config"]["cluster"]["replicas"]
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]
    for i, (_, route, _) in enumerate(ports):  # each pod's name on the headless Service
        procs.world.hosts[f"nats-{i}.nats-headless:{CHART_ROUTE_PORT}"] = f"127.0.0.1:{route}"
    env = chart_env(values, secrets, namespace)
    assert Path(server_binary()) == Path(sys.prefix) / "bin" / "nats-server"
    for i, (client, route, monitor) in enumerate(ports):
        # One config for all (the chart's ConfigMap) but for where routes are taken here.
        (config / f"nats-{i}.conf").write_text(nats_conf(values, cert_dirs,
                                                         f"127.0.0.1:{route}"))
        procs.start(Container(f"nats-{i}", [
            "/opt/venv/bin/nats-server", "-c", f"/etc/nats-config/nats-{i}.conf", "-js",
            "-sd", "/data", "-n", f"nats-{i}", "-a", "127.0.0.1", "-p", str(client),
            "-m", str(monitor)], env, "/",
            {"/data": f"nats-{i}-data", "/etc/nats-config": "nats-config"}))
    for i, (_, _, monitor) in enumerate(ports):
        wait_for(lambda m=monitor: healthy_http(f"http://127.0.0.1:{m}/healthz"), 60,
                 f"nats-{i} healthy", detail=procs.logs)
        # Routed to every other server, over the routes' TLS and password.
        wait_for(lambda m=monitor, i=i: routes_of(m) == {f"nats-{j}" for j in range(n)
                                                          if j != i},
                 30, f"nats-{i}'s routes", detail=procs.logs)
    return NatsCluster([f"nats://127.0.0.1:{client}" for client, _, _ in ports],
                       [route for _, route, _ in ports], [m for _, _, m in ports])


def impostors_are_refused(cluster: NatsCluster, procs: Processes, secrets: dict,
                          root: Path) -> None:
    """The cluster's servers refuse a route from a server with another CA's certificate
    (and the routes' password) at the TLS handshake, and one from a server with the
    cluster's certificate but not the password; neither becomes a route of theirs.
    Judged from the servers' own logs: an impostor sees only a closed connection."""
    routes = secrets[kubernetes.NAMESPACE, kubernetes.ROUTES_SECRET]
    mine = root / "impostor-certs"
    mine.mkdir()
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (mine / name).write_text(routes[name])
    cluster_secret = RouteSecurity(cert_file=str(mine / "tls.crt"),
                                   key_file=str(mine / "tls.key"),
                                   ca_file=str(mine / "ca.crt"), user="route",
                                   password=routes[kubernetes.ROUTE_PASSWORD_ITEM])
    foreign = AuthDir.init(root / "foreign")
    impostors = {  # each knows what the other lacks
        # It trusts the cluster's CA, so only the servers' check of its certificate can
        # fail the handshake.
        "other-ca": dataclasses.replace(foreign.route_security(),
                                        ca_file=cluster_secret.ca_file,
                                        password=cluster_secret.password),
        "no-password": dataclasses.replace(cluster_secret, password="guessed"),
    }
    refusals = ("TLS route handshake error: tls: failed to verify certificate: x509: "
                "certificate signed by unknown authority",  # other-ca's
                'authentication error - User "route"')  # no-password's
    logs = [procs.running[f"nats-{i}"].log for i in range(len(cluster.routes))]
    before = [log.stat().st_size for log in logs]
    assert not [r for log in logs for r in refusals if r in log.read_text()]

    def since(i: int) -> str:
        with logs[i].open("rb") as f:
            f.seek(before[i])
            return f.read().decode(errors="replace")

    members = tuple(f"nats://127.0.0.1:{port}" for port in cluster.routes)
    with contextlib.ExitStack() as stack:
        for name, secured in impostors.items():
            stack.enter_context(NatsServer(
                root / name, log_path=root / f"{name}.log", config_file=foreign.config_path,
                routes=Routes(cluster_name="nats", server_name=name, port=free_port(),
                              routes=members, secured=secured)))
        for i in range(len(logs)):
            wait_for(lambda i=i: all(r in since(i) for r in refusals), 20,
                     f"nats-{i} refusing both impostors", detail=lambda i=i: since(i)[-2000:])
        assert all(routes_of(m).isdisjoint(impostors) for m in cluster.monitors)
    for name in impostors:  # never a member: it heard of no JetStream meta leader
        assert "metadata leader" not in (root / f"{name}.log").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_local_overlay_pods_pass_their_probes_and_train_a_job(tmp_path: Path) -> None:
    docs = render("local")
    values = nats_values()
    cluster = Cluster(docs, tmp_path)
    deployments = by_kind(docs, "Deployment")
    agents = by_kind(docs, "DaemonSet")["phalanx-agent"]
    selector = agents["spec"]["template"]["spec"]["nodeSelector"]
    worker_nodes = [n for n, labels in NODES.items()
                    if all(labels.get(k) == v for k, v in selector.items())]
    assert len(worker_nodes) == 2
    with processes(World(tmp_path, {})) as procs:
        nats = start_nats(procs, values, cluster.secrets, tmp_path)
        impostors_are_refused(nats, procs, cluster.secrets, tmp_path)
        urls = nats.urls
        # The Service "nats" of the chart's release, as pods of either namespace name it:
        # any of its servers.
        procs.world.hosts[f"nats.{kubernetes.NAMESPACE}.svc:4222"] = \
            urls[0].removeprefix("nats://")
        pods: dict[str, dict] = {}
        for name, deployment in deployments.items():
            for i in range(deployment["spec"]["replicas"]):
                pods[f"{name}-{i}"] = deployment
        for node in worker_nodes:
            pods[f"phalanx-agent-{node}"] = agents
        for pod, workload in pods.items():
            node = pod.removeprefix("phalanx-agent-") if workload is agents else "kind-worker"
            procs.start(cluster.pod(workload, pod, node))
        for pod, workload in pods.items():
            said: list[str] = [""]

            def ready(pod: str = pod, workload: dict = workload, said: list = said) -> bool:
                assert procs.alive(pod), f"{pod} exited:\n{procs.logs()}"
                result = cluster.probe(procs, pod, workload, "readiness")
                said[0] = result.stdout + result.stderr
                return result.returncode == 0

            wait_for(ready, 90, f"{pod} ready", interval_s=0.5,
                     detail=lambda said=said: said[0])
            live = cluster.judged_live(procs, pod, workload)
            assert live.returncode == 0, live.stdout + live.stderr

        # Each pod holds what its image holds: torch in the agents', none in the services'.
        for pod, workload in pods.items():
            imported = procs.exec(pod, ["python", "-c", "import torch"])
            assert (imported.returncode == 0) == (workload is agents), (pod, imported.stderr)

        # A job: its dataset is written on the first worker (on a real cluster it would
        # be on shared storage); its command runs in the agents' pods.
        first = next(p for p, w in pods.items() if w is agents)
        data = ["--data-dir", "/tmp/phalanx-w-data", "--widths", "64,128,64",
                "--samples", "640"]
        prepared = procs.exec(first, ["python", "examples/train_mlp.py", "--prepare", *data])
        assert prepared.returncode == 0, prepared.stderr
        on_worker = procs.running[first].container
        spec = {"name": "k8s", "team": "research", "priority_class": "normal",
                "replicas": {"min": 2, "max": 4}, "slots_per_replica": 1,
                "hang_timeout_s": 5.0, "grace_period_s": 5,
                "command": [procs.world.localize(on_worker, a) for a in
                            ["python", "examples/train_mlp.py", *data, "--micro-batch", "8",
                             "--steps", str(STEPS)]]}
        spec_path = tmp_path / "job.yaml"
        spec_path.write_text(yaml.safe_dump(spec))
        # The operator's CLI as its identity (the cli seed and the CA from the Secret).
        user_env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_",
                                                                             "OTEL_"))}
        operator = cluster.secrets[kubernetes.NAMESPACE, kubernetes.IDENTITIES_SECRET]
        for name in ("cli.nk", "ca.pem"):
            (tmp_path / name).write_text(operator[name])
        (tmp_path / "cli.nk").chmod(0o600)
        user_env.update(PHALANX_NATS_NKEY=str(tmp_path / "cli.nk"),
                        PHALANX_NATS_INBOX_PREFIX=f"_INBOX.{identity(Role.CLI)}",
                        PHALANX_NATS_CA=str(tmp_path / "ca.pem"))
        admitted, record, progress = asyncio.run(train(urls[0], spec_path, user_env))
        assert record.state.value == "finished", f"{record.reason}\n{procs.logs()}"
        assert set(admitted.nodes) == {"kind-worker", "ip-10-0-0-7-ec2-internal"}
        assert sorted(progress) == [0, 1, 2, 3]
        assert all(p.step == STEPS and p.final for p in progress.values()), progress
        # The ranks' output stays in the agents' pods; the operator reads it over the bus.
        logs = subprocess.run([sys.executable, "-m", "phalanx.services.cli", "logs",
                               record.job_id, "--nats", urls[0]],
                              capture_output=True, text=True, timeout=60, env=user_env)
        assert logs.returncode == 0 and not logs.stderr, logs
        assert logs.stdout.count("=== phalanx: r") == 4, logs.stdout

        # Metrics, scraped as Prometheus's kubernetes-pods job does: at each pod's annotated
        # port and path (here each pod's declared port is a local port of its own).
        def page(pod: str) -> dict:
            annotations = pods[pod]["spec"]["template"]["metadata"]["annotations"]
            declared = int(annotations["prometheus.io/port"])
            port = procs.world.ports.get(pod, {}).get(declared)
            assert port, f"{pod} serves no metrics on its annotated port {declared}"
            try:
                return metrics_page.scrape(
                    f"http://127.0.0.1:{port}{annotations['prometheus.io/path']}")
            except OSError as exc:
                raise AssertionError(f"{pod}'s metrics on port {port}: {exc} (process "
                                     f"{'alive' if procs.alive(pod) else 'exited'})\n"
                                     f"{procs.logs()}") from None

        def total(workload: str, metric: str, **labels: str) -> float:
            return sum(metrics_page.value(page(p), metric, **labels) for p, w in pods.items()
                       if w["metadata"]["name"] == workload)

        for pod in pods:
            assert ("phalanx_bus_reconnects_total", ()) in page(pod), pod
        for node in worker_nodes:  # each agent counted the exits of the ranks it ran
            pod, ran = f"phalanx-agent-{node}", admitted.nodes.count(node.replace(".", "-"))
            wait_for(lambda p=pod, r=ran: metrics_page.value(
                         page(p), "phalanx_agent_rank_exits_total", cause="exited") == r,
                     30, f"{pod}'s {ran} rank exits counted", detail=lambda p=pod: page(p))
        # The leader of each pair counted; its standby nothing.
        assert total("phalanx-admission", "phalanx_admission_admitted_total") == 1
        assert total("phalanx-elasticity", "phalanx_generations_total", reason="start") >= 1

        # Each probe asks for its own pod: one health pod stopped fails its probes, the
        # other still passes.
        procs.stop("phalanx-health-0")
        health = deployments["phalanx-health"]
        for kind, code in (("readiness", 1), ("liveness", 1)):
            result = cluster.probe(procs, "phalanx-health-0", health, kind)
            assert result.returncode == code, result.stdout
            assert "phalanx-health-1" in result.stdout
        assert cluster.probe(procs, "phalanx-health-1", health, "readiness").returncode == 0


def test_readme_deploy_section_matches_the_files() -> None:
    readme = (DEPLOY.parent / "README.md").read_text()
    section = readme.split("## Deploy\n", 1)[1].split("\n## ", 1)[0]
    paths = set(re.findall(r"deploy/[\w./-]+\w", section))
    assert {"deploy/compose.yaml", "deploy/k8s/overlays/local", "deploy/k8s/overlays/gpu",
            "deploy/k8s/nats-values.yaml", "deploy/Dockerfile"} <= paths
    # What the section's own `phalanx auth kubernetes DIR` makes, it need not hold.
    made = re.findall(r"phalanx auth kubernetes (deploy/[\w./-]+\w)", section)
    assert made == ["deploy/k8s/overlays/local/auth"], made
    for path in paths:
        assert path.startswith(made[0]) or (DEPLOY.parent / path).exists(), path
    for overlay in OVERLAYS:
        agent = by_kind(render(overlay), "DaemonSet")["phalanx-agent"]["spec"]["template"]
        for key, value in agent["spec"]["nodeSelector"].items():
            assert f"{key}={value}" in section, (overlay, key)
    gpu = by_kind(render("gpu"), "DaemonSet")["phalanx-agent"]["spec"]["template"]["spec"]
    gpus = gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert f"nvidia.com/gpu: {gpus}" in section and f"{gpus} rank slots" in section
