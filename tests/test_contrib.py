"""What contrib/ ships: Prometheus alert rules (checked and unit-tested by the real
promtool) and the Grafana dashboard (parsed, every panel queried, every query valid PromQL,
every metric one the exporter publishes)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobd.metrics import FAMILY_NAMES

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
ALERTS = CONTRIB / "prometheus" / "alerts.yml"
ALERT_TESTS = CONTRIB / "prometheus" / "alerts.test.yml"
DASHBOARD = CONTRIB / "grafana" / "jobd.json"

# The families the daemon exports (jobd/metrics.py; tests/test_metrics.py checks that a
# running daemon serves each of them).
METRICS = set(FAMILY_NAMES)
HISTOGRAMS = {"jobd_job_duration_seconds", "jobd_pickup_delay_seconds"}
NAME = re.compile(r"\bjobd_[a-z0-9_]+")

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="needs promtool (Debian package prometheus)")


def metric_names(expr: str) -> set[str]:
    """The metrics an expression reads; a histogram's series count as the histogram."""
    names = set()
    for name in NAME.findall(expr):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        names.add(base if base in HISTOGRAMS else name)
    return names


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


# --- alert rules ---------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text("utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


@needs_promtool
def test_the_alert_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


@needs_promtool
def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_rule_is_tested_firing_and_silent() -> None:
    cases: dict[str, list[bool]] = {}
    for test in yaml.safe_load(ALERT_TESTS.read_text("utf-8"))["tests"]:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], []).append(bool(case["exp_alerts"]))
    names = [rule["alert"] for rule in alert_rules()]
    assert sorted(cases) == sorted(names)
    assert {name: sorted(set(outcomes)) for name, outcomes in cases.items()} == {
        name: [False, True] for name in names}


def test_every_rule_has_a_for_a_severity_a_summary_a_description_and_a_runbook() -> None:
    for rule in alert_rules():
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}, rule["alert"]
        assert metric_names(rule["expr"]) <= METRICS, rule["alert"]


def test_the_slo_rule_compares_each_lane_with_its_own_slo() -> None:
    [rule] = [r for r in alert_rules() if r["alert"] == "JobdPickupSLOBreached"]
    assert re.search(r"jobd_oldest_unclaimed_age_seconds\)\s*> on \(lane\)", rule["expr"])
    assert metric_names(rule["expr"]) == {"jobd_oldest_unclaimed_age_seconds",
                                          "jobd_lane_slo_pickup_seconds"}


# --- the Grafana dashboard -----------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text("utf-8"))


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queried_panels() -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard()["panels"]) if p["type"] != "row"]


def expressions() -> list[str]:
    return [target["expr"] for panel in queried_panels() for target in panel["targets"]]


def test_every_panel_has_a_query() -> None:
    panels = queried_panels()
    assert panels
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert all(target.get("expr", "").strip() for target in panel["targets"]), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_metric_the_dashboard_reads_is_one_the_exporter_publishes() -> None:
    used = set().union(*(metric_names(expr) for expr in expressions()))
    assert used <= METRICS, used - METRICS
    # The panels the issue asks for read these.
    assert {"jobd_jobs_completed_total", "jobd_job_duration_seconds",
            "jobd_pickup_delay_seconds", "jobd_queue_depth", "jobd_oldest_unclaimed_age_seconds",
            "jobd_lane_slo_pickup_seconds", "jobd_dlq_depth", "jobd_workers",
            "jobd_worker_restarts_total", "jobd_oldest_transaction_age_seconds"} <= used
    quantiles = [e for e in expressions() if "histogram_quantile" in e]
    assert {name for e in quantiles for name in metric_names(e)} == HISTOGRAMS


def test_the_lane_variable_repeats_a_row_per_lane() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    lane = variables["lane"]
    assert lane["multi"] and lane["includeAll"]
    assert metric_names(lane["definition"]) <= METRICS
    rows = [p for p in dashboard()["panels"] if p["type"] == "row" and p.get("repeat")]
    assert [row["repeat"] for row in rows] == ["lane"]
    lane_queries = [e for e in expressions() if "$lane" in e]
    assert len(lane_queries) > len(expressions()) / 2


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = list(all_panels(dashboard()["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # Grafana's variables filled in as Grafana would; promtool then parses each expression
    # as a recording rule.
    rules = [{"record": f"jobd:dashboard_query:{index}",
              "expr": expr.replace("$__rate_interval", "5m").replace("$lane", "default")}
             for index, expr in enumerate(expressions())]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}),
                    "utf-8")
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
