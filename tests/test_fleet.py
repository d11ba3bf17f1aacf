"""Many nodes on one database: eight small daemons (one lane, one worker each). `jobd status`
lists every one with its lanes, workers and last heartbeat; one that disappears is marked
gone, and the others sweep its leases so its job runs elsewhere.

The metrics sampler counts the backlog once per interval for the whole fleet, not once per
node. (What an idle fleet costs the database is measured by bench/fleet_idle.py, not here: a
test asserts behaviour, not figures.)"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import daemon_support
import psycopg
import pytest
from cli_support import cli
from daemon_support import Daemon, effects, job_row, job_state, make_config, wait_until

import jobd
from jobd.duties.metrics_sampler import SAMPLE_INTERVAL, take_sample

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db


Daemons = Callable[..., Daemon]

FLEET = 8


def node_config(name: str) -> dict[str, Any]:
    config = make_config({"default": {"concurrency": 1, "prefetch": 0,
                                      "visibility_timeout": "3s", "heartbeat": "1s"}})
    config["node"] = {"name": name}
    return config


def status(db_url: str) -> dict[str, Any]:
    result = cli("status", "--json", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_a_fleet_of_eight_lists_every_node_and_sweeps_the_one_that_disappears(
    daemons: Daemons, effects_db: psycopg.Connection, db_url: str
) -> None:
    names = [f"node-{n}" for n in range(1, FLEET + 1)]
    fleet = {name: daemons(node_config(name), name=name) for name in names}
    for daemon in fleet.values():
        daemon.wait_workers_started("default", 1, timeout=90)

    def all_listed() -> dict[str, Any] | None:
        found = status(db_url)
        live = {n["node"] for n in found["nodes"]
                if not n["gone"] and n["workers"] == {"default": 1}}
        return found if live == set(names) else None

    found = wait_until(all_listed, 30, interval=0.5, message="all eight nodes in jobd status")
    assert len(found["nodes"]) == FLEET
    for node in found["nodes"]:
        assert node["lanes"] == ["default"]
        assert node["pid"] == fleet[node["node"]].pid
        assert 0 <= node["last_heartbeat_age_seconds"] < 10
        assert node["heartbeat_interval_seconds"] == 0.5
    (lane,) = [s for s in found["lanes"] if s["lane"] == "default"]
    assert lane["live_workers"] == FLEET
    text = cli("status", "--database-url", db_url)
    assert text.returncode == 0, text.stderr
    for name in names:
        assert any(line.startswith(f"{name} ") and line.split()[-2:] == ["live", "listen"]
                   for line in text.stdout.splitlines()), text.stdout

    # A job that would run for a minute; its node disappears (killed whole, no goodbye).
    job = jobd.enqueue(effects_db, "slow", {"seconds": 60, "slow_attempts": [1]})
    wait_until(lambda: effects(effects_db, job, "start"), 30, message="the job to start")
    holder_worker = job_row(effects_db, job)["claimed_by"]
    victim = holder_worker.split(":")[0]
    assert victim in fleet
    fleet[victim].stop()

    def marked_gone() -> dict[str, Any] | None:
        found = status(db_url)
        gone = {n["node"] for n in found["nodes"] if n["gone"]}
        live = {n["node"] for n in found["nodes"] if not n["gone"]}
        return found if gone == {victim} and live == set(names) - {victim} else None

    found = wait_until(marked_gone, 40, interval=0.5, message=f"{victim} to be marked gone")
    (gone,) = [n for n in found["nodes"] if n["gone"]]
    assert gone["last_heartbeat_age_seconds"] >= 10
    assert gone["rates"] == {}
    (lane,) = [s for s in found["lanes"] if s["lane"] == "default"]
    assert lane["live_workers"] == FLEET - 1  # a gone node's workers are not counted
    text = cli("status", "--database-url", db_url)
    assert any(line.startswith(f"{victim} ") and "gone" in line
               for line in text.stdout.splitlines()), text.stdout

    # Its lease expires and another node sweeps it: the job runs again elsewhere and is done.
    wait_until(lambda: job_state(effects_db, job) == "done", 40, interval=0.2,
               message=lambda: f"job {job} to be done elsewhere (it is "
                               f"{job_state(effects_db, job)})")
    row = job_row(effects_db, job)
    assert row["attempts"] == 2
    assert f"lease expired (held by {holder_worker})" in row["errors"][0]["error"]
    starts = effects(effects_db, job, "start")
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]
    sweeps = [entry for name, d in fleet.items() if name != victim
              for entry in d.events("expired leases swept")]
    assert len(sweeps) == 1
    assert sweeps[0]["holders"] == {holder_worker: 1}


def test_the_metrics_sampler_counts_the_backlog_once_for_the_fleet(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue_many(conn, [jobd.JobSpec("h", {}, lane="a") for _ in range(5)])
    first = take_sample(conn, ["a"], max_age=SAMPLE_INTERVAL)  # nothing shared yet: counts
    assert first.lanes["a"].depth["due"] == 5
    jobd.enqueue(conn, "h", lane="a")
    # Another node within the interval: the stored counts, as old as they are.
    second = take_sample(conn, ["a"], max_age=SAMPLE_INTERVAL)
    assert second.lanes["a"].depth["due"] == 5
    # The sample's age (jobd_metrics_sample_age_seconds) is that of the counts it shares.
    conn.execute("UPDATE queue_samples SET taken_at = now() - interval '3 seconds'")
    aged = take_sample(conn, ["a"], max_age=SAMPLE_INTERVAL)
    assert aged.lanes["a"].depth["due"] == 5
    assert time.monotonic() - aged.taken_at >= 3.0
    # A lane nobody counted yet makes the node count all its lanes, and share them.
    third = take_sample(conn, ["a", "b"], max_age=SAMPLE_INTERVAL)
    assert third.lanes["a"].depth["due"] == 6 and third.lanes["b"].depth["due"] == 0
    stored = conn.execute("SELECT lane, due FROM queue_samples ORDER BY lane").fetchall()
    assert stored == [("a", 6), ("b", 0)]
    # Counts older than the interval are counted again.
    conn.execute("UPDATE queue_samples SET taken_at = now() - interval '1 minute'")
    jobd.enqueue(conn, "h", lane="a")
    assert take_sample(conn, ["a"], max_age=SAMPLE_INTERVAL).lanes["a"].depth["due"] == 7
