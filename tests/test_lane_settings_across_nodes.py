"""Nodes that serve one lane with different settings of it: each applies its own to the jobs
it claims, so a job's attempts, timeout or backoff depend on which node took it. Every node
states its lanes' settings in its heartbeat, logs a warning naming what differs, and `jobd
status` lists it, until the configs agree again."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import daemon_support
import psycopg
import pytest
from cli_support import cli
from daemon_support import Daemon, make_config, wait_until

from jobd import config, views
from jobd.duties.node_heartbeat import NodeHeartbeat
from jobd.wake_routing import WakeRouter

daemons = daemon_support.daemons

Daemons = Callable[..., Daemon]


def node(instance: str, lanes: dict[str, dict[str, Any]] | None, *,
         gone: bool = False) -> views.NodeStatus:
    return views.NodeStatus(instance, instance.split(":")[0], 1, datetime.now(UTC), {}, {},
                            gone=gone, lane_settings=lanes)


def test_only_settings_every_live_node_states_and_that_differ_are_disagreements() -> None:
    nodes = [
        node("n1:1:a", {"b": {"max_attempts": 6, "timeout": 20.0},
                        "a": {"max_attempts": 8}}),
        node("n2:2:b", {"b": {"max_attempts": 2, "timeout": 20.0, "added_later": 1},
                        "c": {"max_attempts": 1}}),
        node("n3:3:c", {"b": {"max_attempts": 9, "timeout": 1.0}}, gone=True),
        node("old:4:d", None),  # a daemon that does not state its settings
    ]
    assert views.lane_disagreements(nodes) == {
        "b": {"max_attempts": {"n1:1:a": 6, "n2:2:b": 2}}}


def lane_config(name: str, **settings: Any) -> dict[str, Any]:
    config = make_config({"default": {"concurrency": 1, **settings}})
    config["node"] = {"name": name}
    return config


def status(db_url: str) -> dict[str, Any]:
    result = cli("status", "--json", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def differing(db_url: str) -> dict[str, Any]:
    (lane,) = [s for s in status(db_url)["lanes"] if s["lane"] == "default"]
    return dict(lane["settings_differ"])


@pytest.mark.slow
def test_nodes_that_configure_a_lane_differently_are_told_until_they_agree(
    daemons: Daemons, db_url: str
) -> None:
    first = daemons(lane_config("node-a", max_attempts=6, timeout="20s"), name="a")
    second = daemons(lane_config("node-b", max_attempts=2, timeout="3s"), name="b")
    instances = {d: str(d.wait_for_log("supervisor started")["instance"])
                 for d in (first, second)}
    expected = {"max_attempts": {instances[first]: 6, instances[second]: 2},
                "timeout": {instances[first]: 20.0, instances[second]: 3.0}}
    # Each node's log names the lane and what differs, with every node's value.
    for daemon in (first, second):
        warned = daemon.wait_for_log("live nodes configure this lane differently: each "
                                     "applies its own settings to the jobs it claims; give "
                                     "every node the same", timeout=30)
        assert warned["lane"] == "default"
        assert warned["settings"] == expected
    assert differing(db_url) == expected
    text = cli("status", "--database-url", db_url)
    assert text.returncode == 0, text.stderr
    assert "  default: max_attempts: node-a 6, node-b 2" in text.stdout, text.stdout
    assert "  default: timeout: node-a 20s, node-b 3s" in text.stdout, text.stdout

    # The second node's config is brought in line: both say so, and status lists nothing.
    mark = second.reload(lane_config("node-b", max_attempts=6, timeout="20s"))
    second.wait_for_log("live nodes configure this lane alike again", since=mark, timeout=30,
                        lane="default")
    first.wait_for_log("live nodes configure this lane alike again", timeout=30,
                       lane="default")
    wait_until(lambda: differing(db_url) == {}, 15, message="status to list no difference")
    text = cli("status", "--database-url", db_url)
    assert "configure differently" not in text.stdout, text.stdout


def heartbeat_of(conn: psycopg.Connection, instance: str, text: str) -> NodeHeartbeat:
    """A node's heartbeat, written to the database, stating the lanes of the config text."""
    lanes = config.parse(text).lanes
    heartbeat = NodeHeartbeat(
        lambda: 5.0, instance, lambda: instance.split(":")[0],
        lambda: ({name: 1 for name in lanes}, {}), WakeRouter(), lambda: lanes,
        lane_settings=lambda: {name: lane.fleet_settings() for name, lane in lanes.items()})
    heartbeat.prepare()
    heartbeat.run(conn, 1000.0)
    return heartbeat


def test_one_duration_written_two_ways_is_no_disagreement(
    conn: psycopg.Connection, db_url: str
) -> None:
    # The same durations, in other units: 700ms * 0.001 was 0.7000000000000001, not the
    # 0.7 that 0.7s is, and the nodes were told they differ while status showed 0.7s twice.
    first = heartbeat_of(conn, "node-a:1:a", """
lanes:
  default: {visibility_timeout: 9950ms, heartbeat: 1s, timeout: 2300ms,
            backoff: {base: 700ms, cap: 1.1h}, max_wait: 350ms, slo: {pickup: 1150ms}}
""")
    second = heartbeat_of(conn, "node-b:2:b", """
lanes:
  default: {visibility_timeout: 9.95s, heartbeat: 1s, timeout: 2.3s,
            backoff: {base: 0.7s, cap: 66m}, max_wait: 0.35s, slo: {pickup: 1.15s}}
""")
    first.compare_lanes(conn)  # it wrote its heartbeat before the second node's
    assert first.reported == {} and second.reported == {}
    assert differing(db_url) == {}
