"""Schedule ownership with two real daemons on one database: a node whose config lacks a
schedule does not switch it off, a conflict is logged and shown without flapping, and when the
declaring node leaves the schedule stops firing (or the other definition is adopted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, make_config, wait_until

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]


def node_config(name: str, schedules: list[dict[str, Any]]) -> dict[str, Any]:
    config = make_config({"default": {"workers": 1}})
    config["node"] = {"name": name}
    config["schedules"] = schedules
    return config


def every_minute(**options: Any) -> dict[str, Any]:
    return {"id": "s", "cron": "* * * * *", "handler": "ok", "catchup": "all", **options}


def fires(conn: psycopg.Connection, due_after: datetime | None = None) -> int:
    """The ledger's fires of s; with ``due_after``, only those of occurrences after it."""
    row = conn.execute("SELECT count(*) FROM schedule_fires WHERE schedule_id = 's'"
                       " AND (%s::timestamptz IS NULL OR fire_at > %s)",
                       (due_after, due_after)).fetchone()
    assert row is not None
    return int(row[0])


def rewind(conn: psycopg.Connection, minutes: int) -> datetime:
    """Move the cursor back: with catch-up `all`, the next tick fires the occurrences of the
    last ``minutes`` that the ledger does not have yet. Returns the cursor's new position."""
    row = conn.execute("UPDATE schedules SET materialized_until = now() - make_interval(mins => %s)"
                       " WHERE id = 's' RETURNING materialized_until", (minutes,)).fetchone()
    assert row is not None
    return row[0]


def instance_of(daemon: Daemon) -> str:
    return str(daemon.wait_for_log("supervisor started")["instance"])


def duty_passes_after_now(conn: psycopg.Connection, instance: str, count: int,
                          daemon: Daemon) -> None:
    """Wait until ``instance`` has run ``count`` duty passes that started after this call."""
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    since = row[0]
    seen: list[object] = []

    def passed() -> bool:
        heartbeat = conn.execute("SELECT seen_at FROM nodes WHERE instance = %s",
                                 (instance,)).fetchone()
        if heartbeat is not None and heartbeat[0] > since and heartbeat[0] not in seen:
            seen.append(heartbeat[0])
        return len(seen) >= count

    wait_until(passed, 15, message=lambda: f"{count} duty passes of {instance}\n"
                                           f"{daemon.tail()}")


def schedules_list(db_url: str) -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBD_")}
    done = subprocess.run([sys.executable, "-m", "jobd", "schedules", "list", "--json",
                           "--database-url", db_url], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return {row["id"]: row for row in json.loads(done.stdout)}


def test_a_node_without_the_schedule_keeps_it_firing_until_the_declaring_node_leaves(
    daemons: Daemons, effects_db: psycopg.Connection, db_url: str
) -> None:
    a = daemons(node_config("node-a", [every_minute()]), name="a")
    a_instance = instance_of(a)
    wait_until(lambda: schedules_list(db_url).get("s", {}).get("state") == "enabled", 15,
               message=lambda: f"schedule s to be declared\n{a.tail()}")
    rewind(effects_db, 5)
    wait_until(lambda: fires(effects_db) >= 5, 15, message=lambda: f"5 fires\n{a.tail()}")

    # Node B starts with no schedules at all (an empty or older config).
    b = daemons(node_config("node-b", []), name="b")
    b_instance = instance_of(b)
    duty_passes_after_now(effects_db, b_instance, 2, b)  # it synced before its first pass
    listed = schedules_list(db_url)["s"]
    assert (listed["state"], listed["enabled"]) == ("enabled", True)
    assert listed["declared_by"] == [a_instance]
    before = fires(effects_db)
    # Fifteen minutes back: the ledger has the last five or six of them (six when a minute
    # began since the first rewind), so nine or ten fire now; then every one of the fifteen
    # occurrences after the cursor is in the ledger.
    since = rewind(effects_db, 15)
    wait_until(lambda: fires(effects_db, due_after=since) >= 15, 15,
               message=lambda: f"the 15 minutes after the cursor fired\n{a.tail()}\n{b.tail()}")
    assert fires(effects_db) >= before + 9

    # A leaves: nobody declares s any more, so it stops firing; it is not disabled.
    a.signal(signal.SIGTERM)
    assert a.wait_exit(30) == 0
    assert schedules_list(db_url)["s"]["state"] == "undeclared"
    stopped_at = fires(effects_db)
    rewind(effects_db, 30)
    duty_passes_after_now(effects_db, b_instance, 3, b)
    assert fires(effects_db) == stopped_at
    assert schedules_list(db_url)["s"]["enabled"] is True


def test_a_conflict_is_logged_and_shown_and_resolved_when_the_old_node_leaves(
    daemons: Daemons, effects_db: psycopg.Connection, db_url: str
) -> None:
    a = daemons(node_config("node-a", [every_minute(cron="*/5 * * * *")]), name="a")
    a_instance = instance_of(a)
    wait_until(lambda: "s" in schedules_list(db_url), 15,
               message=lambda: f"schedule s\n{a.tail()}")
    b = daemons(node_config("node-b", [every_minute(cron="*/10 * * * *")]), name="b")
    b_instance = instance_of(b)
    warning = b.wait_for_log("schedule definitions differ between live nodes; the stored one "
                             "is kept until no live node declares it")
    assert (warning["schedule"], warning["stored_by"], warning["differing"]) == (
        "s", [a_instance], [b_instance])
    assert warning["level"] == "warning"

    # No flapping: while both run, the stored definition stays A's.
    duty_passes_after_now(effects_db, b_instance, 4, b)
    listed = schedules_list(db_url)["s"]
    assert (listed["state"], listed["cron"], listed["differing"]) == (
        "conflict", "*/5 * * * *", [b_instance])
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBD_")}
    status = subprocess.run([sys.executable, "-m", "jobd", "status", "--database-url", db_url],
                            capture_output=True, text=True, timeout=60, env=env)
    assert status.returncode == 0, status.stderr
    assert f"s: stored by {a_instance}; differing: {b_instance}" in status.stdout

    # A leaves: no live node declares the stored definition any more; B's is adopted.
    a.signal(signal.SIGTERM)
    assert a.wait_exit(30) == 0
    b.wait_for_log("schedule definition changed: no live node declares the previous one",
                   schedule="s")
    listed = schedules_list(db_url)["s"]
    assert (listed["state"], listed["cron"]) == ("enabled", "*/10 * * * *")
