"""Lane controls with real daemons, several on one database: a pause reaches every node
within about a second and outlives a restart, cancel stops running jobs of every kind, and
the incident runbook (pause, quarantine, resume, fix, replay) works end to end.

The daemons' lanes poll only every 60 s (tests/daemon_support.py), so whatever happens
sooner came from a notification.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from cli_support import cli
from daemon_support import HANDLERS, Daemon, db_now, job_state, make_config, wait_until

import jobd
from jobd.outcomes import CANCELLED_ERROR

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]

CONTROL_HANDLERS_MODULE = '''\
"""Handlers that show what a cancel does to them; traces in public.test_effects."""

import asyncio
import os
import time

import psycopg


def _record(job, kind):
    with psycopg.connect(os.environ["JOBD_TEST_EFFECTS_URL"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO public.test_effects (job_id, handler, kind, attempt, pid)"
            " VALUES (%s, %s, %s, %s, %s)",
            (job.id, job.handler, kind, job.attempt, os.getpid()))


def polite(job):
    """Runs until asked to stop (30 s at most), as a long sync handler should."""
    _record(job, "start")
    deadline = time.monotonic() + 30
    while not job.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    _record(job, "saw cancel" if job.cancelled else "end")


def stubborn(job):
    """Ignores a cancel and returns after payload["seconds"]."""
    _record(job, "start")
    time.sleep(float(job.payload.get("seconds", 1)))
    _record(job, "end")


async def sleepy(job):
    _record(job, "start")
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        _record(job, "got CancelledError")
        raise
    _record(job, "end")


async def blocking(job):
    """Makes a blocking call in an async def: nothing else on the event loop runs meanwhile."""
    _record(job, "start")
    time.sleep(float(job.payload.get("seconds", 1)))
    _record(job, "end")


def picky(job):
    """Fails on a payload with "bad" until the file "fixed" exists in its directory."""
    _record(job, "start")
    if job.payload.get("bad") and not os.path.exists("fixed"):
        raise ValueError("poison payload")
    _record(job, "end")
'''

CONTROL_HANDLERS = {**HANDLERS, **{name: f"controlhandlers:{name}"
                                   for name in ("polite", "stubborn", "sleepy", "picky",
                                                "blocking")}}


def write_handlers(directory: Path) -> None:
    (directory / "controlhandlers.py").write_text(CONTROL_HANDLERS_MODULE)


def config(lanes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return make_config(lanes, handlers=CONTROL_HANDLERS)


def jobd_cli(daemon: Daemon, *args: str) -> dict[str, Any]:
    """Run a jobd command against the daemon's database and config; its JSON output."""
    result = cli(*args, "--json", "-c", str(daemon.config_path), "--database-url",
                 daemon.db_url)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def starts(conn: psycopg.Connection, handler: str | None = None,
           after: datetime | None = None) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT job_id, pid, at FROM public.test_effects WHERE kind = 'start'"
        " AND (%s::text IS NULL OR handler = %s) AND (%s::timestamptz IS NULL OR at > %s)"
        " ORDER BY at", (handler, handler, after, after)).fetchall()
    return [{"job_id": r[0], "pid": r[1], "at": r[2]} for r in rows]


def kinds(conn: psycopg.Connection, job_id: int) -> list[str]:
    rows = conn.execute("SELECT kind FROM public.test_effects WHERE job_id = %s ORDER BY id",
                        (job_id,)).fetchall()
    return [row[0] for row in rows]


def count(conn: psycopg.Connection, where: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM all_jobs WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


def worker_pids(*nodes: Daemon) -> dict[str, set[int]]:
    return {node.config_path.stem: set(node.worker_pids("default").values())
            for node in nodes}


def all_done(conn: psycopg.Connection, ids: list[int]) -> bool:
    return all(job_state(conn, job_id) == "done" for job_id in ids)


def test_a_pause_stops_claims_on_every_node_and_a_resume_restarts_them(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    write_handlers(tmp_path)
    lanes = config({"default": {"workers": 1, "concurrency": 2},
                    "other": {"workers": 1, "concurrency": 2}})
    a, b = daemons(lanes, name="a"), daemons(lanes, name="b")
    for node in (a, b):
        node.wait_workers_started("default", 1)
        node.wait_workers_started("other", 1)
    pids = worker_pids(a, b)
    # Jobs of 0.8 s, and workers claim ahead (a buffer of 3 x concurrency): a worker that did
    # not hear of the pause would start a buffered job within the second a slot frees.
    ids = jobd.enqueue_many(effects_db, [jobd.JobSpec("slow", {"seconds": 0.8})
                                         for _ in range(30)])
    # Both nodes run the lane's jobs...
    wait_until(lambda: all(pids[node] & {s["pid"] for s in starts(effects_db)}
                           for node in pids), 15, message="both nodes to run jobs")
    marks = {node: node.mark() for node in (a, b)}
    assert jobd_cli(a, "lanes", "pause", "default")["changed"] is True
    paused_at = db_now(effects_db)
    for node, mark in marks.items():  # every node's worker heard of it, within a second
        heard = node.wait_for_log("lane pauses", process="worker default#0", since=mark,
                                  lane_paused=True, timeout=5)
        heard_at = datetime.fromisoformat(heard["timestamp"].replace("Z", "+00:00"))
        assert heard_at - paused_at < timedelta(seconds=1), (heard_at, paused_at)
    # ... and within a second no node claims any; what ran finishes, what was claimed ahead
    # goes back to the queue.
    wait_until(lambda: count(effects_db, "state = 'claimed'") == 0, 5,
               message="the claimed jobs to finish or go back")
    other = [jobd.enqueue(effects_db, "ok", lane="other") for _ in range(4)]
    # Work in another lane goes on, and the paused lane stays paused for a while.
    wait_until(lambda: all_done(effects_db, other)
               and db_now(effects_db) > paused_at + timedelta(seconds=2), 15,
               message="the other lane's jobs, and two seconds")
    assert starts(effects_db, "slow", after=paused_at + timedelta(seconds=1)) == []
    started = {s["job_id"] for s in starts(effects_db, "slow")}
    assert all(job_state(effects_db, job_id) == "done" for job_id in started)
    assert count(effects_db, "state = 'pending'") == len(ids) - len(started) > 0
    status = jobd_cli(b, "status")
    [lane] = [s for s in status["lanes"] if s["lane"] == "default"]
    assert (lane["paused"], lane["paused_handlers"]) == (True, [])
    assert [(p["lane"], p["handler"]) for p in status["pauses"]] == [("default", None)]

    # Resumed from SQL, as any language can: both nodes claim again at once.
    effects_db.execute("SELECT jobd.resume('default')")
    resumed_at = db_now(effects_db)
    wait_until(lambda: all_done(effects_db, ids), 30, message=lambda: "every job to finish\n"
               + a.tail() + b.tail())
    later = {s["pid"] for s in starts(effects_db, "slow", after=resumed_at)}
    assert all(pids[node] & later for node in pids), (pids, later)
    first = min(s["at"] for s in starts(effects_db, "slow", after=resumed_at))
    assert first - resumed_at < timedelta(seconds=1)


def test_a_handlers_pause_outlives_a_restart_of_the_daemon(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    write_handlers(tmp_path)
    lanes = config({"default": {"workers": 1, "concurrency": 2}})
    first = daemons(lanes, name="first")
    first.wait_workers_started("default", 1)
    assert jobd_cli(first, "lanes", "pause", "default", "--handler", "slow")["changed"]
    held = [jobd.enqueue(effects_db, "slow", {"seconds": 0.1}) for _ in range(3)]
    fine = [jobd.enqueue(effects_db, "ok") for _ in range(3)]
    wait_until(lambda: all_done(effects_db, fine), 15, message="the other handler's jobs")
    first.signal(signal.SIGTERM)
    assert first.wait_exit(30) == 0

    second = daemons(lanes, name="second")
    second.wait_workers_started("default", 1)
    fine = [jobd.enqueue(effects_db, "ok") for _ in range(3)]
    wait_until(lambda: all_done(effects_db, fine), 15, message="the restarted daemon's jobs")
    assert starts(effects_db, "slow") == []
    assert {job_state(effects_db, job_id) for job_id in held} == {"pending"}
    [lane] = [s for s in jobd_cli(second, "status")["lanes"] if s["lane"] == "default"]
    assert (lane["paused"], lane["paused_handlers"]) == (False, ["slow"])

    resumed = jobd_cli(second, "lanes", "resume", "default", "--handler", "slow")
    assert (resumed["changed"], resumed["pauses"]) == (True, [])
    wait_until(lambda: all_done(effects_db, held), 15, message="the paused handler's jobs")


def test_cancel_stops_running_jobs_of_every_kind_on_every_node(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    write_handlers(tmp_path)
    # Leases renewed only every 20 s: a handler told within a second heard of its cancel
    # from the notification, not from a routine renewal.
    slow_renewal = {"heartbeat": "20s", "visibility_timeout": "60s", "concurrency": 2,
                    "prefetch": 0}
    lanes = config({"default": {"workers": 1, **slow_renewal},
                    "retry": {"workers": 1, "max_attempts": 5,
                              "backoff": {"base": "1h", "cap": "1h"}}})
    a, b = daemons(lanes, name="a"), daemons(lanes, name="b")
    for node in (a, b):
        node.wait_workers_started("default", 1)
    running = {name: jobd.enqueue(effects_db, name, {"seconds": 1.5})
               for name in ("polite", "stubborn", "sleepy")}
    running["polite 2"] = jobd.enqueue(effects_db, "polite")
    wait_until(lambda: len(starts(effects_db)) == 4, 15, message="four running jobs")
    assert len({s["pid"] for s in starts(effects_db)}) == 2  # two on each node
    pending = jobd.enqueue(effects_db, "ok", delay=3600)
    failing = jobd.enqueue(effects_db, "picky", {"bad": True}, lane="retry")
    wait_until(lambda: job_state(effects_db, failing) == "failed", 15,
               message="the failing job to wait for its retry")

    result = jobd_cli(a, "jobs", "cancel", *map(str, [*running.values(), pending, failing]))
    asked_at = db_now(effects_db)
    assert (sorted(result["cancelled"]), sorted(result["requested"])) == (
        sorted([pending, failing]), sorted(running.values()))
    assert {job_state(effects_db, pending), job_state(effects_db, failing)} == {"cancelled"}
    wait_until(lambda: all(job_state(effects_db, job_id) == "cancelled"
                           for job_id in running.values()), 15,
               message=lambda: "the running jobs to end cancelled\n" + a.tail() + b.tail())
    # A sync handler that polls job.cancelled stops early; an async one gets CancelledError;
    # one that ignores the request finishes, and is recorded cancelled all the same.
    assert kinds(effects_db, running["polite"]) == ["start", "saw cancel"]
    assert kinds(effects_db, running["polite 2"]) == ["start", "saw cancel"]
    assert kinds(effects_db, running["sleepy"]) == ["start", "got CancelledError"]
    assert kinds(effects_db, running["stubborn"]) == ["start", "end"]
    told = effects_db.execute(
        "SELECT max(at) FROM public.test_effects WHERE kind = 'saw cancel'").fetchone()
    assert told is not None and told[0] - asked_at < timedelta(seconds=1)
    [sleepy] = effects_db.execute("SELECT last_error FROM jobs_archive WHERE id = %s",
                                  (running["sleepy"],)).fetchone() or [None]
    assert sleepy == CANCELLED_ERROR
    # The nodes count the outcome as cancelled (their heartbeat, every 500 ms here).
    wait_until(lambda: effects_db.execute(
        "SELECT coalesce(sum((counters->'default'->>'cancelled')::int), 0) FROM nodes"
    ).fetchone() == (4,), 10, message="the nodes' counters")


def test_the_incident_runbook_pause_quarantine_resume_fix_replay(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    write_handlers(tmp_path)
    lanes = config({"default": {"workers": 1, "concurrency": 4}})
    a, b = daemons(lanes, name="a"), daemons(lanes, name="b")
    for node in (a, b):
        node.wait_workers_started("default", 1)
    # A poison payload keeps failing: stop the handler everywhere first ...
    jobd_cli(a, "lanes", "pause", "default", "--handler", "picky")
    bad = [jobd.enqueue(effects_db, "picky", {"bad": True, "n": n}) for n in range(10)]
    good = [jobd.enqueue(effects_db, "picky", {"bad": False, "n": n}) for n in range(5)]
    others = [jobd.enqueue(effects_db, "ok") for _ in range(5)]
    wait_until(lambda: all_done(effects_db, others), 15, message="the other handler's jobs")
    # ... then move the poison aside in one statement, and let the rest run.
    moved = jobd_cli(b, "dlq", "quarantine", "--handler", "picky", "--where", "bad=true")
    assert (moved["quarantined"], moved["by_lane"]) == (10, {"default": 10})
    jobd_cli(b, "lanes", "resume", "default", "--handler", "picky")
    wait_until(lambda: all_done(effects_db, good), 15, message="the good payloads")
    dead = jobd_cli(a, "dlq", "list", "--limit", "100")
    assert sorted(row["id"] for row in dead) == bad
    assert all(row["last_error"].startswith("quarantined") for row in dead)
    assert starts(effects_db, "picky") and not any(
        s["job_id"] in bad for s in starts(effects_db, "picky"))
    # After the fix, every quarantined job comes back and runs.
    (tmp_path / "fixed").write_text("")
    assert sorted(jobd_cli(a, "dlq", "replay", "--handler", "picky")["replayed"]) == bad
    wait_until(lambda: all_done(effects_db, bad), 15, message="the replayed jobs")


def test_an_async_handler_that_blocks_the_event_loop_is_named_in_the_log(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    write_handlers(tmp_path)
    node = daemons(config({"default": {"workers": 1, "concurrency": 2}}))
    node.wait_workers_started("default", 1)
    since = node.mark()
    culprit = jobd.enqueue(effects_db, "blocking", {"seconds": 2.5})
    warning = node.wait_for_log("an async handler is blocking the event loop: no other async "
                                "job of this worker runs until it returns (await instead, or "
                                "run the blocking call with asyncio.to_thread)",
                                process=None, since=since)
    assert (warning["job_id"], warning["handler"], warning["level"]) == (
        culprit, "blocking", "warning")
    freed = node.wait_for_log("the event loop runs again", process=None, since=since)
    assert freed["blocked_s"] >= 1.0
    wait_until(lambda: job_state(effects_db, culprit) == "done", 15, message="the job to end")
