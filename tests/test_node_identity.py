"""Two daemons with the same `node.name` on one host are two nodes: each has its own row,
its own workers' identities, its own crash attribution, schedule declarations and leave."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import daemon_support
import psycopg
import pytest
from cli_support import cli
from daemon_support import Daemon, effects, job_row, job_state, make_config, wait_until

import jobd

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]


def twin_config() -> dict[str, Any]:
    # One job per worker and none claimed ahead, so a busy worker cannot take a second job.
    config = make_config({"default": {"concurrency": 1, "prefetch": 0, "max_attempts": 2}})
    config["schedules"] = [{"id": "nightly", "cron": "0 3 * * *", "handler": "ok"}]
    assert config["node"]["name"] == "testnode"
    return config


def status(db_url: str) -> dict[str, Any]:
    result = cli("status", "--json", "--database-url", db_url)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def worker_id(daemon: Daemon) -> str:
    (entry,) = daemon.workers("default").values()
    return str(entry["worker"])


def test_two_daemons_with_one_node_name_stay_apart(
    daemons: Daemons, effects_db: psycopg.Connection, db_url: str
) -> None:
    first = daemons(twin_config(), name="first")
    second = daemons(twin_config(), name="second")
    first.wait_workers_started("default", 1)
    second.wait_workers_started("default", 1)
    instances = {d.pid: str(d.wait_for_log("supervisor started")["instance"])
                 for d in (first, second)}
    assert len(set(instances.values())) == 2
    assert all(i.startswith("testnode:") for i in instances.values())
    ids = {first.pid: worker_id(first), second.pid: worker_id(second)}
    assert len(set(ids.values())) == 2

    # Status: two nodes of the same name, told apart by instance and pid.
    def listed() -> list[dict[str, Any]] | None:
        nodes = status(db_url)["nodes"]
        live = [n for n in nodes if not n["gone"] and n["workers"] == {"default": 1}]
        return nodes if len(live) == 2 else None

    nodes = wait_until(listed, 15, message="both nodes in jobd status")
    assert {n["node"] for n in nodes} == {"testnode"}
    assert {n["instance"]: n["pid"] for n in nodes} == {i: p for p, i in instances.items()}
    assert all(n["lanes"] == ["default"] for n in nodes)

    # One worker busy with a slow job; the other's worker kills itself on the next one.
    slow = jobd.enqueue(effects_db, "slow", {"seconds": 4})
    wait_until(lambda: effects(effects_db, slow, "start"), 15, message="the slow job to start")
    holder_id = job_row(effects_db, slow)["claimed_by"]
    holder = first if ids[first.pid] == holder_id else second
    other = second if holder is first else first
    assert ids[holder.pid] == holder_id
    poison = jobd.enqueue(effects_db, "suicide")
    wait_until(lambda: job_row(effects_db, poison)["errors"], 20,
               message=lambda: f"the poison job's first failure\n{other.tail()}")
    first_error = job_row(effects_db, poison)["errors"][0]
    # Settled by the node whose worker died, naming that worker, not its namesake's.
    assert first_error["worker"] == ids[other.pid]
    assert "died: killed by SIGKILL" in first_error["error"]
    settled = other.wait_for_log("failed the job that killed its worker")
    assert settled["worker"] == ids[other.pid]
    assert not holder.events("failed the job that killed its worker")
    # The namesake's job ran on, untouched: one start, one attempt.
    wait_until(lambda: job_state(effects_db, slow) == "done", 20,
               message=lambda: f"the slow job to finish\n{holder.tail()}")
    assert job_row(effects_db, slow)["attempts"] == 1
    assert len(effects(effects_db, slow, "start")) == 1
    wait_until(lambda: job_state(effects_db, poison) == "dead", 30,
               message="the poison job to die")

    # Each declares the schedule under its own instance; the one that leaves withdraws only
    # its own declaration and removes only its own row.
    declared = effects_db.execute(
        "SELECT instance FROM jobd.schedule_declarations ORDER BY instance").fetchall()
    assert sorted(i for (i,) in declared) == sorted(instances.values())
    other.signal(signal.SIGTERM)
    assert other.wait_exit(30) == 0
    declared = effects_db.execute("SELECT instance FROM jobd.schedule_declarations").fetchall()
    assert declared == [(instances[holder.pid],)]
    nodes = status(db_url)["nodes"]
    assert [(n["instance"], n["gone"]) for n in nodes] == [(instances[holder.pid], False)]
    # The one left goes on beating and working.
    after = jobd.enqueue(effects_db, "ok")
    wait_until(lambda: job_state(effects_db, after) == "done", 15,
               message=lambda: f"a job on the remaining node\n{holder.tail()}")
