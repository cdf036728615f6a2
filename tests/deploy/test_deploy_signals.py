"""deploy/'s signals: the Prometheus alert rules and the Grafana dashboard.

``promtool`` (Debian's ``prometheus`` package, which .ci/run installs) checks the rules,
and, since it has no command that parses a bare PromQL expression, every panel expression
of the dashboard too, as a recording rule of a generated rules file. Every metric either
names is one a phalanx process exports (read from :mod:`phalanx.services.metrics`'s
families), so a renamed metric cannot leave a panel or an alert silently empty. The
dashboard is read through Grafana's own dashboard schema (the types of its foundation SDK,
generated from it) and must come back whole: a field Grafana does not know would be lost.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml
from deploy_local import DEPLOY
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from test_deploy_compose import PROMETHEUS, RULES, prometheus_binary

from phalanx.services import metrics

DASHBOARD = DEPLOY / "grafana" / "phalanx.json"
RULE_TESTS = DEPLOY / "prometheus-rules.test.yml"
#: Every family a phalanx process can export, by group.
GROUPS = (metrics.BUS, metrics.LEADERSHIP, metrics.ADMISSION, metrics.HEALTH,
          metrics.ELASTICITY, metrics.AGENT, metrics.CALLOUT)
#: Series Prometheus makes itself for every target.
PROMETHEUS_OWN = {"up"}


def exported() -> set[str]:
    """The sample names phalanx's families put on a ``/metrics`` page."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "gauge": ("",)}
    return {family.name + suffix for group in GROUPS for collector in group
            for family in collector.collect() for suffix in suffixes[family.type]}


def metric_names(expr: str) -> set[str]:
    """The series names an expression of ours reads: identifiers outside label matchers
    and grouping clauses that are no function or aggregation (all of ours are called)."""
    bare = re.sub(r"\{[^}]*\}", "", expr)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    return {name for name in re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", bare)
            if not re.fullmatch(r"(and|or|unless|bool|offset)", name)}


def promtool_check_rules(path: Path) -> None:
    result = subprocess.run([prometheus_binary("promtool"), "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def panel_targets() -> list[tuple[str, dict]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target) for panel in dashboard["panels"]
            for target in panel.get("targets", [])]


def test_the_names_read_from_an_expression_are_its_series_only() -> None:
    """The reader the checks below rely on: labels, functions, ranges are not series."""
    assert metric_names('histogram_quantile(0.95, sum by (le, phalanx_job) '
                        '(rate(phalanx_recovery_seconds_bucket{reason="fault"}[10m])))') \
        == {"phalanx_recovery_seconds_bucket"}
    assert metric_names("up{job=\"phalanx\"} == 0") == {"up"}


def test_the_alert_rules_pass_promtool_and_prometheus_loads_them() -> None:
    promtool_check_rules(RULES)
    assert RULES.name in yaml.safe_load(PROMETHEUS.read_text())["rule_files"]
    result = subprocess.run([prometheus_binary("promtool"), "check", "config", str(PROMETHEUS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "1 rule files found" in result.stdout, result.stdout


def test_the_alerts_cover_what_an_operator_must_hear_of() -> None:
    names = {rule["alert"] for rule in alerts()}
    assert names == {"PhalanxJobStalled", "PhalanxNoLeader", "PhalanxNodeLost",
                     "PhalanxMassSilence", "PhalanxRecoverySlow", "PhalanxBusDown",
                     "PhalanxScrapeDown", "PhalanxCalloutUnavailable",
                     "PhalanxCalloutBadTokens"}
    for rule in alerts():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    slow = next(r for r in alerts() if r["alert"] == "PhalanxRecoverySlow")["expr"]
    # The threshold is a bucket bound of the histogram, spelled as the client spells it.
    bound = float(re.search(r'le="([^"]+)"', slow)[1])
    assert bound in metrics.RECOVERY._upper_bounds and f'le="{bound}"' in slow


def promtool_test_rules(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([prometheus_binary("promtool"), "test", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_every_alert_fires_on_a_kubernetes_scrapes_series_and_keeps_quiet_otherwise() -> None:
    """``promtool test rules`` on prometheus-rules.test.yml passes, and every alert has a
    case there where it fires on series labelled as a Kubernetes pods job labels them
    (an alert keyed to compose's job name never fired there)."""
    result = promtool_test_rules(RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    firing: dict[str, set[str]] = {}
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        jobs = {job for series in case["input_series"]
                for job in re.findall(r'\bjob="([^"]+)"', series["series"])}
        for expected in case.get("alert_rule_test", []):
            if expected["exp_alerts"]:
                firing.setdefault(expected["alertname"], set()).update(jobs)
    for rule in alerts():
        assert "kubernetes-pods" in firing.get(rule["alert"], set()), rule["alert"]


def test_a_wrong_expectation_fails_the_rule_tests(tmp_path: Path) -> None:
    (tmp_path / RULES.name).write_text(RULES.read_text())
    tests = RULE_TESTS.read_text()
    wrong = tmp_path / RULE_TESTS.name
    wrong.write_text(tests.replace("{severity: critical, service: admission}",
                                   "{severity: critical, service: health}"))
    assert wrong.read_text() != tests
    result = promtool_test_rules(wrong)
    assert result.returncode != 0 and "PhalanxNoLeader" in result.stdout + result.stderr


def test_every_metric_the_alerts_name_is_exported() -> None:
    known = exported() | PROMETHEUS_OWN
    for rule in alerts():
        names = metric_names(rule["expr"])
        assert names and names <= known, (rule["alert"], names - known)


def test_the_dashboard_is_a_grafana_dashboard_of_prometheus_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "phalanx" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    source, *choices = dashboard["templating"]["list"]
    assert (source["type"], source["query"], source["name"]) == \
        ("datasource", "prometheus", "datasource")
    for choice in choices:  # each reads its values through the chosen data source
        assert choice["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_every_panel_expression_parses_and_reads_exported_metrics(tmp_path: Path) -> None:
    targets = panel_targets()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": target["expr"]}
        for i, (_, target) in enumerate(targets)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    promtool_check_rules(path)
    known = exported() | PROMETHEUS_OWN
    for title, target in targets:
        names = metric_names(target["expr"])
        assert names and names <= known, (title, names - known)


def test_a_panel_expression_that_does_not_parse_fails_the_check(tmp_path: Path) -> None:
    """promtool is no rubber stamp for the generated file."""
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "dashboard:broken", "expr": "sum by (phalanx_job (phalanx_job_step)"}]}]}))
    result = subprocess.run([prometheus_binary("promtool"), "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0


def test_the_dashboard_shows_what_an_operator_watches() -> None:
    read = set().union(*(metric_names(target["expr"]) for _, target in panel_targets()))
    assert {"phalanx_job_step_rate", "phalanx_job_world_size", "phalanx_job_generation",
            "phalanx_generations_total", "phalanx_recovery_seconds_bucket",
            "phalanx_agent_ranks", "phalanx_leader", "phalanx_bus_bad_messages_total",
            "phalanx_bus_handler_errors_total", "phalanx_bus_denials_total",
            "phalanx_bus_connected"} <= read
    assert read >= {n for n in exported() if n.startswith("phalanx_bus_")}


def test_every_panel_follows_the_namespace_and_job_chosen() -> None:
    """The dashboard's ``namespace`` and ``job`` variables (all by default) narrow every
    series a panel reads: by namespace always (compose's series have none, which ``.*``
    matches), by job where the family has a job label."""
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    for name in ("namespace", "job"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
    by_job = {family.name for group in GROUPS for collector in group
              for family in collector.collect()
              if metrics.JOB_LABEL in getattr(collector, "_labelnames", ())}
    assert by_job
    for title, target in panel_targets():
        for name, labels in re.findall(r"\b(phalanx_[a-z_]+)\{([^}]*)\}", target["expr"]):
            assert 'namespace=~"$namespace"' in labels, (title, name)
            family = re.sub(r"_(bucket|count|sum|total)$", "", name)
            assert ('phalanx_job=~"$job"' in labels) == (family in by_job), (title, name)
        bare = re.findall(r"\b(phalanx_[a-z_]+)\b(?![{(])", target["expr"])
        assert not [n for n in bare if n != metrics.JOB_LABEL], (title, bare)


def lost_in_grafanas_schema(dashboard: dict) -> list[str]:
    """What of ``dashboard`` does not survive a decode and encode by Grafana's dashboard
    schema types: each field (at any depth) dropped or changed, by its path."""
    plugins.register_default_plugins()  # the panel and query types by name (prometheus …)
    again = json.loads(json.dumps(Dashboard.from_json(dashboard), cls=JSONEncoder))

    def lost(ours: object, theirs: object, path: str) -> list[str]:
        if isinstance(ours, dict) and isinstance(theirs, dict):
            problems = []
            for key, value in ours.items():
                where = f"{path}.{key}"
                problems += lost(value, theirs[key], where) if key in theirs \
                    else [f"{where}: dropped"]
            return problems
        if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
            return [problem for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                    for problem in lost(a, b, f"{path}[{i}]")]
        return [] if ours == theirs else [f"{path}: {ours!r} became {theirs!r}"]

    return sorted(lost(dashboard, again, ""))


def test_the_dashboard_reads_whole_through_grafanas_dashboard_schema() -> None:
    assert lost_in_grafanas_schema(json.loads(DASHBOARD.read_text())) == []


def test_a_field_grafana_does_not_know_fails_the_schema_check() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][1]["gridPosition"] = dashboard["panels"][1].pop("gridPos")
    dashboard["panels"][1]["targets"][0]["expression"] = "up"
    assert lost_in_grafanas_schema(dashboard) == [
        ".panels[1].gridPosition: dropped", ".panels[1].targets[0].expression: dropped"]
    dashboard["panels"][1]["gridPos"] = dashboard["panels"][1].pop("gridPosition")
    dashboard["panels"][1]["targets"][0].pop("expression")
    assert lost_in_grafanas_schema(dashboard) == []
