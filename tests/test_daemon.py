"""The daemon end to end: real supervisor and worker processes against a real PostgreSQL.

Each test starts `python -m jobd run` with a config of its own (see tests/daemon_support.py)
and watches it through its JSON log lines, /proc and the database. Lanes poll only every 60s,
so work that starts sooner than that was started by a wake-up.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import (
    Daemon,
    alive,
    db_now,
    effects,
    group_members,
    job_row,
    job_state,
    make_config,
    wait_until,
)
from netcut import silent_server

import jobd
from jobd.db import connect
from jobd.handlers import HandlerCheck, ImportPath

# The fixtures the tests use, from the support module.
daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]


def wait_state(conn: psycopg.Connection, job_id: int, state: str, timeout: float,
               daemon: Daemon) -> None:
    wait_until(lambda: job_state(conn, job_id) == state, timeout,
               message=lambda: f"job {job_id} to be {state} (it is "
                               f"{job_state(conn, job_id)})\n{daemon.tail()}")


def claimed_count(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM jobs WHERE state = 'claimed'").fetchone()
    assert row is not None
    return int(row[0])


def log_seconds(entry: dict) -> float:
    return datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()


# --- 1. jobs flow --------------------------------------------------------------------------


def test_enqueued_jobs_run_and_end_done(daemons: Daemons, effects_db: psycopg.Connection
                                        ) -> None:
    early = [jobd.enqueue(effects_db, "ok", {"n": n}) for n in range(3)]
    daemon = daemons(make_config({"default": {"workers": 2, "concurrency": 2}}))
    slots = daemon.wait_workers_started("default", 2)
    late = [jobd.enqueue(effects_db, "ok", {"n": n}) for n in range(3, 6)]
    for job_id in early + late:
        wait_state(effects_db, job_id, "done", 15, daemon)
        [end] = effects(effects_db, job_id, "end")
        assert end["attempt"] == 1
        assert end["pid"] in slots.values()
    # The workers are the supervisor's children, titled by lane, slot and load.
    wait_until(lambda: sorted(re.sub(r" busy \d+/2$", "", title)
                              for title in daemon.child_processes().values())
               == ["jobd: worker default#0", "jobd: worker default#1"], 5,
               message=lambda: f"worker titles, got {daemon.child_processes()}")
    assert set(daemon.child_processes()) == set(slots.values())
    assert claimed_count(effects_db) == 0


# --- 2. a worker killed mid-job ------------------------------------------------------------


def test_a_worker_killed_mid_job_is_replaced_and_its_job_retried_without_lease_expiry(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1, "visibility_timeout": "60s"}}))
    [pid] = daemon.wait_workers_started("default", 1).values()
    worker_id = daemon.workers("default")[("default", 0)]["worker"]
    job_id = jobd.enqueue(effects_db, "slow", {"seconds": 120, "slow_attempts": [1]})
    wait_until(lambda: effects(effects_db, job_id, "start"), 10, message="the job to start")
    assert effects(effects_db, job_id, "start")[0]["pid"] == pid
    assert job_row(effects_db, job_id)["claimed_by"] == worker_id

    mark = daemon.mark()
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    exited = daemon.wait_for_log("worker exited", since=mark, pid=pid)
    assert exited["cause"] == "killed by SIGKILL"
    failed = daemon.wait_for_log("failed the job that killed its worker", since=mark,
                                 worker=worker_id)
    assert (failed["retried_job_ids"], failed["dead_job_ids"]) == ([job_id], [])
    # What to pause (jobd lanes pause LANE --handler HANDLER), without a query.
    assert (failed["lane"], failed["handlers"]) == ("default", ["slow"])
    respawned = daemon.wait_for_log("worker spawned", since=mark, lane="default", slot=0)
    assert respawned["pid"] != pid

    wait_state(effects_db, job_id, "done", 20, daemon)
    assert time.monotonic() - killed_at < 20  # the lease (60s) did not have to run out
    row = job_row(effects_db, job_id)
    assert row["attempts"] == 2
    [error] = row["errors"]
    assert error["attempt"] == 1
    assert error["worker"] == worker_id
    assert "died: killed by SIGKILL" in error["error"]
    assert [e["pid"] for e in effects(effects_db, job_id, "end")] == [respawned["pid"]]
    assert claimed_count(effects_db) == 0
    assert not alive(pid)


def test_a_killed_worker_gives_back_the_jobs_it_had_not_started(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """Only the jobs whose handlers ran can have killed the worker (its run board says
    which): they become suspects; the ones it held in its buffer go back unharmed, to run
    side by side again, not one at a time."""
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 2, "prefetch": 8,
                                              "visibility_timeout": "60s"}}))
    [pid] = daemon.wait_workers_started("default", 1).values()
    worker_id = daemon.workers("default")[("default", 0)]["worker"]
    ids = jobd.enqueue_many(effects_db, [
        jobd.JobSpec("slow", {"seconds": 2, "n": n}) for n in range(8)])
    wait_until(lambda: len(effects_db.execute(
        "SELECT 1 FROM public.test_effects WHERE kind = 'start'").fetchall()) == 2, 10,
        message="two jobs to start")
    held = effects_db.execute("SELECT count(*) FROM jobs WHERE claimed_by = %s",
                              (worker_id,)).fetchone()
    assert held is not None and held[0] > 2, "the worker holds jobs it has not started"
    started = sorted(row[0] for row in effects_db.execute(
        "SELECT job_id FROM public.test_effects WHERE kind = 'start'").fetchall())

    mark = daemon.mark()
    os.kill(pid, signal.SIGKILL)

    suspects = daemon.wait_for_log("a worker died running several jobs; each runs alone "
                                   "next, to find the one that killed it (their attempts are "
                                   "given back)", since=mark, worker=worker_id)
    assert suspects["suspect_job_ids"] == started
    assert (suspects["lane"], suspects["handlers"]) == ("default", ["slow"])
    given_back = daemon.wait_for_log("gave back the jobs a dead worker held but had not "
                                     "started", since=mark, worker=worker_id)
    assert set(given_back["job_ids"]) <= set(ids) - set(started)
    assert len(given_back["job_ids"]) == held[0] - 2
    for job_id in ids:
        wait_state(effects_db, job_id, "done", 30, daemon)
    rows = effects_db.execute("SELECT id, attempts FROM all_jobs WHERE id = ANY(%s)",
                              (ids,)).fetchall()
    assert sorted(rows) == sorted((job_id, 1) for job_id in ids)  # nobody spent an attempt


def kill_a_node_running_two_of_eight(daemons: Daemons, effects_db: psycopg.Connection,
                                     lane: dict[str, Any], job_max_attempts: int | None
                                     ) -> list[int]:
    """Eight slow jobs into a node of one worker at concurrency 2: once two have started,
    kill the node whole (its run board dies with it) and start a successor. Each job must end
    dead if it had started, else done: a job on its last attempt held unstarted would be
    dead without having run. Returns the jobs' ids."""
    config = make_config({"default": {"workers": 1, "concurrency": 2,
                                      "visibility_timeout": "3s", **lane}})
    daemon = daemons(config, name="crashing")
    daemon.wait_workers_started("default", 1)
    ids = jobd.enqueue_many(effects_db, [
        jobd.JobSpec("slow", {"seconds": 2, "n": n}, max_attempts=job_max_attempts)
        for n in range(8)])
    wait_until(lambda: len(effects_db.execute(
        "SELECT 1 FROM public.test_effects WHERE kind = 'start'").fetchall()) == 2, 10,
        message="two jobs to start")
    started = sorted(row[0] for row in effects_db.execute(
        "SELECT job_id FROM public.test_effects WHERE kind = 'start'").fetchall())
    assert claimed_count(effects_db) == 2  # nothing held ahead
    os.killpg(daemon.pid, signal.SIGKILL)  # the whole node
    daemon.wait_exit(10)

    daemons(config, name="successor").wait_workers_started("default", 1)
    for job_id in ids:
        wait_state(effects_db, job_id, "dead" if job_id in started else "done", 30,
                   daemon)
    return ids


def test_a_lane_of_single_attempts_holds_only_the_jobs_it_runs(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """A whole node's crash spends an attempt on every job the node held: the run board that
    tells started jobs from jobs claimed ahead dies with it. With ``max_attempts: 1`` the
    ones only claimed ahead went to the dead-letter queue without having run; such a lane
    now claims nothing ahead unless it sets ``prefetch``."""
    ids = kill_a_node_running_two_of_eight(daemons, effects_db, {"max_attempts": 1}, None)
    rows = effects_db.execute("SELECT id, attempts FROM all_jobs WHERE id = ANY(%s)",
                              (ids,)).fetchall()
    assert sorted(rows) == sorted((job_id, 1) for job_id in ids)


@pytest.mark.parametrize("ordering", [{}, {"fair_by": "handler", "max_wait": "1m"}],
                         ids=["plain", "fair-and-aging"])
def test_jobs_on_their_last_attempt_are_not_held_ahead_in_a_lane_of_more_attempts(
    daemons: Daemons, effects_db: psycopg.Connection, ordering: dict[str, Any]
) -> None:
    """The same for jobs enqueued with ``max_attempts = 1`` into a lane that retries: its
    workers claim ahead, but a claim takes such a job only into a free slot, in a fair or
    age-promoting lane as in a plain one."""
    kill_a_node_running_two_of_eight(daemons, effects_db, {"max_attempts": 5, **ordering}, 1)


# --- 3. a job that kills its worker every time ---------------------------------------------


def test_a_job_that_kills_its_worker_reaches_the_dead_letter_queue(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Its attempts run out before its crashes do (max_crashes, the next test).
    daemon = daemons(make_config(
        {"default": {"workers": 2, "concurrency": 2, "max_attempts": 3, "max_crashes": 5}}))
    daemon.wait_workers_started("default", 2)
    poison = jobd.enqueue(effects_db, "suicide")
    normal = [jobd.enqueue(effects_db, "ok", {"n": n}) for n in range(6)]

    wait_state(effects_db, poison, "dead", 40, daemon)
    row = job_row(effects_db, poison)
    assert row["attempts"] == 3
    assert len(row["errors"]) == 3
    assert [e["attempt"] for e in row["errors"]] == [1, 2, 3]
    for error in row["errors"]:
        assert "died: killed by SIGKILL" in error["error"]
    # Three attempts spent, each alone; a run beside other jobs gave its attempt back.
    assert len(effects(effects_db, poison, "start")) >= 3
    for job_id in normal:
        wait_state(effects_db, job_id, "done", 15, daemon)
        assert job_row(effects_db, job_id)["attempts"] == 1

    backoffs = daemon.events("worker restart backing off")
    assert len(backoffs) >= 3
    # Each crash the poison causes is explained (pinned on it alone, or it and its
    # neighbours made suspects) and forgiven: its slot restarts after the base delay
    # (250 ms) and the crash does not grow the slot's backoff, so no slot backs off past
    # the 0.5 s its second unforgiven crash would give.
    forgiven = daemon.events("crash explained by its jobs; restarting without further backoff")
    assert len(forgiven) >= 2 and {entry["delay"] for entry in forgiven} == {0.25}
    assert max(entry["delay"] for entry in backoffs) <= 0.5
    # A crash loop is not a boot failure: the lane keeps its workers.
    assert not daemon.events("lane halted: its workers fail to boot; fix the config and send "
                             "SIGHUP")
    wait_until(lambda: len(daemon.worker_pids("default")) == 2, 15,
               message="both slots to be running again")


def test_a_job_that_ends_its_worker_with_status_0_is_a_crash_and_reaches_the_dead_letter_queue(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """Status 0 the supervisor did not ask for (the worker never shut down) is a crash: the
    job spends an attempt each time, and the slot backs off instead of respawning at once.
    The second such crash dead-letters it (max_crashes, default 2), attempts left or not."""
    daemon = daemons(make_config(
        {"default": {"workers": 1, "concurrency": 1, "max_attempts": 3}},
        handlers={**daemon_support.HANDLERS, "exit_zero": "testhandlers:exit_zero"}))
    daemon.wait_workers_started("default", 1)
    poison = jobd.enqueue(effects_db, "exit_zero")

    wait_state(effects_db, poison, "dead", 40, daemon)
    row = job_row(effects_db, poison)
    assert row["attempts"] == 2
    assert [e["attempt"] for e in row["errors"]] == [1, 2]
    assert [e.get("killed_worker") for e in row["errors"]] == [True, True]
    for error in row["errors"]:
        assert "died: exit code 0 without shutting down" in error["error"]
    assert row["last_error"].endswith("dead-lettered: it killed its worker 2 times running "
                                      "alone (lanes.default.max_crashes: 2)")
    crashes = daemon.events("worker exited", cause="exit code 0 without shutting down")
    assert len(crashes) == 2
    # Each crash put the slot through its restart delay: one spawn per crash, not a fork
    # loop (there is no other worker to run the retries).
    assert len(daemon.events("worker restart backing off")) >= 2
    daemon.wait_for_log("worker spawned", count=3)
    assert len(daemon.events("worker spawned")) == 3
    assert len(effects(effects_db, poison, "start")) == 2
    assert not daemon.events("released the jobs of a stopped worker")


class RetryNotWoken(AssertionError):
    """A retry that was due did not start: nothing woke the lane for it."""


def test_a_crash_retry_starts_when_its_backoff_ends_not_at_the_next_poll(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Up to three kills of the job's worker while it runs alone: max_crashes (default 2)
    # would dead-letter it at the second.
    daemon = daemons(make_config({"default": {
        "workers": 1, "max_attempts": 5, "max_crashes": 5,
        "backoff": {"base": "20s", "cap": "20s"}}}))
    daemon.wait_workers_started("default", 1)
    job_id = jobd.enqueue(effects_db, "slow", {"seconds": 120, "slow_attempts": [1, 2, 3]})

    def started(attempt: int) -> bool:
        return any(e["attempt"] == attempt for e in effects(effects_db, job_id, "start"))

    # The retry delay is drawn at random (full jitter). A retry that falls due before the
    # replacement worker's first claim is found by that claim and shows nothing: kill the
    # job's worker again until a retry falls due later than that.
    for attempt in (1, 2, 3):
        wait_until(lambda attempt=attempt: started(attempt), 30,
                   message=lambda attempt=attempt: f"attempt {attempt}\n{daemon.tail()}")
        pid = effects(effects_db, job_id, "start")[-1]["pid"]
        mark = daemon.mark()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda attempt=attempt: len(job_row(effects_db, job_id)["errors"]) == attempt,
                   10, message="the crash to be attributed")
        retry_at = job_row(effects_db, job_id)["run_at"]
        wait_until(lambda attempt=attempt, retry_at=retry_at: started(attempt + 1)
                   or db_now(effects_db) > retry_at + timedelta(seconds=3),
                   40, message="the retry to start or its deadline to pass")
        if not started(attempt + 1):
            raise RetryNotWoken(
                f"the retry of job {job_id} was due at {retry_at} and had not started 3s "
                f"later (the lane polls every 60s)\n{daemon.tail(12)}")
        replacement = daemon.wait_for_log("worker started", process=None, since=mark)
        if retry_at.timestamp() > log_seconds(replacement) + 0.5:
            return  # due well after the replacement's first claim, and woken for all that
    pytest.skip("every retry fell due before the replacement worker's first claim")


# --- 4. a hung worker ----------------------------------------------------------------------


def test_a_stopped_worker_is_aborted_killed_and_replaced(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1}},
                                 supervisor={"worker_timeout": "2s"}))
    [pid] = daemon.wait_workers_started("default", 1).values()
    mark = daemon.mark()
    os.kill(pid, signal.SIGSTOP)  # never continued: the fixture's cleanup kills everything

    hung = daemon.wait_for_log("worker hung; aborting it", since=mark, pid=pid, timeout=10)
    assert hung["silent"] >= 2.0
    exited = daemon.wait_for_log("worker exited", since=mark, pid=pid, timeout=15)
    assert exited["cause"].startswith("hung: no liveness report")
    # A stopped process cannot run its SIGABRT handler: only the SIGKILL after ABORT_GRACE
    # (5s) ends it.
    assert log_seconds(exited) - log_seconds(hung) >= 4.5
    wait_until(lambda: not alive(pid), 5, message=f"pid {pid} to be gone")

    respawned = daemon.wait_for_log("worker spawned", since=mark, lane="default", slot=0)
    assert respawned["pid"] != pid
    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert effects(effects_db, job_id, "end")[0]["pid"] == respawned["pid"]


def test_a_stopped_supervisor_does_not_take_its_own_pause_for_its_workers_silence(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # SIGSTOP of the supervisor (or a paused VM) for longer than worker_timeout: on resume it
    # found every worker silent for that long and aborted them all, charging their running
    # jobs as a crash's, though the workers had kept reporting into their pipes.
    daemon = daemons(make_config({"default": {"workers": 2}},
                                 supervisor={"worker_timeout": "2s"}))
    pids = daemon.wait_workers_started("default", 2)
    mark = daemon.mark()
    daemon.signal(signal.SIGSTOP)
    try:
        time.sleep(4)  # the pause itself: twice worker_timeout
    finally:
        daemon.signal(signal.SIGCONT)
    # The first liveness check after the pause logs this where it would otherwise have
    # aborted every worker: from then on, an abort would already be in the log.
    daemon.wait_for_log("the supervisor did not run for a while; its workers' silence is "
                        "counted from now", since=mark)
    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert daemon.events("worker hung; aborting it", since=mark) == []
    assert daemon.worker_pids("default") == pids


def test_a_claim_held_up_by_a_lock_is_not_a_step_of_the_database_clock(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """A claim's now() is read as its transaction starts. A claim that then waits two
    seconds for a lock (an operator's LOCK TABLE, a migration) is answered two seconds later
    than that: no step of the database's clock, so the worker logs none and keeps its
    floors (jobd.clock_watch)."""
    daemon = daemons(make_config({"default": {"workers": 1}}))
    daemon.wait_workers_started("default", 1)
    warm = jobd.enqueue(effects_db, "ok")  # the claim the next one is compared with
    wait_state(effects_db, warm, "done", 15, daemon)
    mark = daemon.mark()
    with effects_db.transaction():
        effects_db.execute("LOCK TABLE jobd.lane_pauses IN ACCESS EXCLUSIVE MODE")
        with connect(daemon.db_url) as other:
            job_id = jobd.enqueue(other, "ok")
            # The worker's claim began its transaction and has waited two seconds for the
            # lock: its answer comes at least that long after its now().
            wait_until(lambda: longest_claim_lock_wait(other) >= 2.0, 15,
                       message=lambda: f"the claim to wait for the lock\n{daemon.tail()}")
    wait_state(effects_db, job_id, "done", 15, daemon)
    steps = daemon.events("the database's clock stepped; claims scan from the head of the lane",
                          process=None, since=mark)
    assert steps == [], steps


def longest_claim_lock_wait(conn: psycopg.Connection) -> float:
    """Seconds the longest claim waiting for a lock has waited (0 without one), by the
    database clock: since its transaction began, which is what its now() reads."""
    row = conn.execute(
        "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)::float8"
        " FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%%Claims up to%%'").fetchone()
    assert row is not None
    return float(row[0])


# --- 5. reload -----------------------------------------------------------------------------


def test_reload_adds_a_worker_and_a_lane_without_touching_running_workers(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 2}}))
    before = daemon.wait_workers_started("default", 2)

    mark = daemon.reload(make_config({"default": {"workers": 3}, "extra": {"workers": 1}}))
    reloaded = daemon.wait_for_log("config reloaded", since=mark)
    assert reloaded["lanes"] == {"default": 3, "extra": 1}
    third = daemon.wait_for_log("worker spawned", since=mark, lane="default", slot=2)
    extra = daemon.wait_for_log("worker spawned", since=mark, lane="extra", slot=0)
    daemon.wait_workers_started("extra", 1, since=mark)

    assert daemon.worker_pids("default") == {**before, 2: third["pid"]}
    assert not daemon.events("worker retiring", since=mark)
    assert not daemon.events("worker exited", since=mark)
    assert all(alive(pid) for pid in before.values())

    job_id = jobd.enqueue(effects_db, "ok", lane="extra")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert effects(effects_db, job_id, "end")[0]["pid"] == extra["pid"]


def test_a_sighup_to_the_whole_process_group_reloads_and_leaves_the_workers_running(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # A terminal that closes, `kill -HUP -PGID` or `systemctl kill -s HUP jobd` (whose
    # default is every process of the unit) sends SIGHUP to the workers too. Before, its
    # default action killed each of them: their running jobs failed an attempt as if they
    # had crashed their workers ("killed by SIGHUP", logged as errors).
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 2}}))
    [pid] = daemon.wait_workers_started("default", 1).values()
    job_id = jobd.enqueue(effects_db, "slow", {"seconds": 2})
    wait_until(lambda: effects(effects_db, job_id, "start"), 10, message="the job to start")

    mark = daemon.mark()
    os.killpg(daemon.pid, signal.SIGHUP)  # the daemon leads its own process group
    daemon.wait_for_log("config reloaded", since=mark)
    wait_state(effects_db, job_id, "done", 15, daemon)
    row = job_row(effects_db, job_id)
    assert (row["attempts"], row["errors"]) == (1, [])
    assert [e["pid"] for e in effects(effects_db, job_id, "end")] == [pid]
    assert alive(pid)
    assert not daemon.events("worker exited", since=mark), daemon.tail()


@pytest.mark.parametrize("bad_config", [
    "lanes: [this is not: valid yaml\n",
    "handlers: {ok: 'testhandlers:ok'}\nlanes:\n  default:\n    wrokers: 3\n",
    "",  # a file truncated mid-deploy
    "# lanes moved to another file\n",
    "handlers: {ok: 'testhandlers:ok'}\nlanes:\n  default: {workers: 2}\nschedules:\n"
    "  - {id: r, cron: '0 3 * * *', handler: ok, payload: {since: 2026-01-01}}\n",
], ids=["invalid-yaml", "unknown-key", "empty", "comments-only", "schedule-payload-a-date"])
def test_reload_refuses_an_invalid_config_and_keeps_running(
    daemons: Daemons, effects_db: psycopg.Connection, bad_config: str
) -> None:
    daemon = daemons(make_config({"default": {"workers": 2}}))
    before = daemon.wait_workers_started("default", 2)

    mark = daemon.reload(bad_config)
    refused = daemon.wait_for_log("reload refused; still running the previous config",
                                  since=mark)
    assert str(daemon.config_path) in refused["error"]
    assert daemon.running()
    assert not daemon.events("config reloaded", since=mark)

    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert daemon.worker_pids("default") == before
    assert not daemon.events("worker exited", since=mark)


def test_reload_replaces_a_changed_lane_while_its_in_flight_job_finishes_once(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 2}}))
    [old_pid] = daemon.wait_workers_started("default", 1).values()
    job_id = jobd.enqueue(effects_db, "slow", {"seconds": 6})
    wait_until(lambda: effects(effects_db, job_id, "start"), 10, message="the job to start")

    mark = daemon.reload(make_config({"default": {"workers": 1, "concurrency": 3}}))
    daemon.wait_for_log("config reloaded", since=mark)
    daemon.wait_for_log("worker retiring", since=mark, pid=old_pid)
    new = daemon.wait_for_log("worker spawned", since=mark, lane="default", slot=0)
    assert new["pid"] != old_pid
    assert new["generation"] > daemon.events("worker spawned", pid=old_pid)[0]["generation"]
    daemon.wait_workers_started("default", 1, since=mark)
    titles = {old_pid: "jobd: worker default#0 busy 1/2 retiring",
              new["pid"]: "jobd: worker default#0 busy 0/3"}
    wait_until(lambda: daemon.child_processes() == titles, 5,
               message=lambda: f"titles {titles}, got {daemon.child_processes()}")

    # The old worker finishes the job it holds, then exits cleanly.
    exited = daemon.wait_for_log("worker exited", since=mark, pid=old_pid, timeout=15)
    assert exited["cause"] == "exit code 0"
    wait_state(effects_db, job_id, "done", 5, daemon)
    assert [e["pid"] for e in effects(effects_db, job_id, "start")] == [old_pid]
    assert [e["pid"] for e in effects(effects_db, job_id, "end")] == [old_pid]
    row = job_row(effects_db, job_id)
    assert (row["attempts"], row["errors"]) == (1, [])
    # Work goes to the new generation.
    after = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, after, "done", 15, daemon)
    assert effects(effects_db, after, "end")[0]["pid"] == new["pid"]


# Makes every worker's interpreter start take long (sitecustomize runs before any of jobd's
# code), so a test can signal a worker that is still starting, as a reload or a stop right
# after a crash-restart does in production.
SLOW_WORKER_START = """\
import sys
import time

if sys.orig_argv[-2:] == ["-m", "jobd.worker"]:
    time.sleep(2)
"""


@pytest.mark.parametrize("how", ["reload", "stop"])
def test_a_worker_signalled_while_its_interpreter_starts_retires_or_drains_cleanly(
    daemons: Daemons, effects_db: psycopg.Connection, how: str
) -> None:
    daemon = daemons()
    (daemon.dir / "sitecustomize.py").write_text(SLOW_WORKER_START)
    daemon.start(make_config({"default": {"workers": 1, "concurrency": 2}}))
    spawned = daemon.wait_for_log("worker spawned", lane="default")
    if how == "reload":
        mark = daemon.reload(make_config({"default": {"workers": 1, "concurrency": 3}}))
        daemon.wait_for_log("worker retiring", since=mark, pid=spawned["pid"])
    else:
        daemon.signal(signal.SIGTERM)
    # The signal reached the worker before it could handle one: it must wait for the
    # worker's handlers, not end the process (a crash, logged as an error).
    exited = daemon.wait_for_log("worker exited", pid=spawned["pid"], timeout=20)
    assert (exited["cause"], exited["level"]) == ("exit code 0", "info"), daemon.tail()
    if how == "stop":
        assert daemon.wait_exit(20) == 0
    else:
        job_id = jobd.enqueue(effects_db, "ok")
        wait_state(effects_db, job_id, "done", 20, daemon)
    assert not [e for e in daemon.events("worker exited") if e["level"] != "info"], \
        daemon.tail()


# --- 6. drain on SIGTERM -------------------------------------------------------------------


def test_sigterm_drains_finishes_short_jobs_and_releases_long_ones(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 4}},
                                 supervisor={"shutdown_timeout": "3s"}))
    [pid] = daemon.wait_workers_started("default", 1).values()
    short = jobd.enqueue(effects_db, "slow", {"seconds": 1})
    long = jobd.enqueue(effects_db, "slow", {"seconds": 60})
    for job_id in (short, long):
        wait_until(lambda job_id=job_id: effects(effects_db, job_id, "start"), 10,
                   message=f"job {job_id} to start")
    assert job_row(effects_db, long)["state"] == "claimed"

    stopping_at = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(3 + 4) == 0
    assert time.monotonic() - stopping_at < 3 + 3

    assert job_state(effects_db, short) == "done"
    row = job_row(effects_db, long)
    assert (row["state"], row["attempts"], row["claimed_by"], row["errors"]) == (
        "pending", 0, None, [])
    assert not effects(effects_db, long, "end")
    assert daemon.events("draining")
    assert daemon.events("stopped")
    assert not group_members(daemon.pid)
    assert not alive(pid)


def test_a_sigterm_to_the_whole_process_group_drains_as_one_to_the_supervisor(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # `systemctl kill jobd` (every process of the unit), `kill -TERM -PGID`, or an init
    # that forwards to the process group (dumb-init by default, tini -g) reach the workers
    # directly and through the supervisor. Before, a worker took the second SIGTERM for an
    # operator's "stop fast": it released a job that had a second left to run.
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 2}},
                                 supervisor={"shutdown_timeout": "20s"}))
    daemon.wait_workers_started("default", 1)
    job_id = jobd.enqueue(effects_db, "slow", {"seconds": 1})
    wait_until(lambda: effects(effects_db, job_id, "start"), 10, message="the job to start")

    os.killpg(daemon.pid, signal.SIGTERM)  # the daemon leads its own process group
    assert daemon.wait_exit(20) == 0
    row = job_row(effects_db, job_id)
    assert (row["state"], row["attempts"]) == ("done", 1), daemon.tail()
    assert not daemon.events("stopping at once", process=None)
    assert not daemon.events("second stop signal: stopping fast")


def test_a_second_sigterm_stops_fast(daemons: Daemons, effects_db: psycopg.Connection
                                     ) -> None:
    daemon = daemons(make_config({"default": {"workers": 1}},
                                 supervisor={"shutdown_timeout": "30s"}))
    daemon.wait_workers_started("default", 1)
    long = jobd.enqueue(effects_db, "slow", {"seconds": 60})
    wait_until(lambda: effects(effects_db, long, "start"), 10, message="the job to start")

    daemon.signal(signal.SIGTERM)
    daemon.wait_for_log("draining")
    stopping_at = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(5) == 0
    assert time.monotonic() - stopping_at < 3
    assert daemon.events("second stop signal: stopping fast")
    row = job_row(effects_db, long)
    assert (row["state"], row["attempts"], row["claimed_by"]) == ("pending", 0, None)
    assert not group_members(daemon.pid)


# --- 7. handlers that cannot be imported ---------------------------------------------------


BROKEN_HANDLERS = {"ok": "testhandlers:ok", "broken": "no_such_module_for_jobd_tests:run"}


def test_a_handler_that_cannot_be_imported_fails_the_boot_with_exit_code_3(
    daemons: Daemons,
) -> None:
    daemon = daemons(make_config({"default": {}}, handlers=BROKEN_HANDLERS))
    started = time.monotonic()
    assert daemon.wait_exit(20) == 3
    assert time.monotonic() - started < 15
    [failure] = daemon.events("boot failure")
    assert "'broken'" in failure["error"]
    assert "no_such_module_for_jobd_tests" in failure["error"]
    assert not daemon.events("worker spawned")


def test_reload_refuses_a_handler_that_cannot_be_imported(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1}}))
    before = daemon.wait_workers_started("default", 1)

    mark = daemon.reload(make_config({"default": {"workers": 1}}, handlers=BROKEN_HANDLERS))
    refused = daemon.wait_for_log("reload refused; still running the previous config",
                                  since=mark)
    assert "'broken'" in refused["error"]
    assert daemon.running()

    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert daemon.worker_pids("default") == before
    assert not daemon.events("worker exited", since=mark)


def test_a_handler_whose_import_kills_the_check_is_named_in_the_boot_failure(
    daemons: Daemons,
) -> None:
    # As an extension module's segfault or the OOM killer would: the check leaves no
    # verdict. Before, the error was "the handler check failed (exit code -9)" followed by
    # the last line of the check's stderr (a RuntimeWarning of runpy), naming no handler.
    daemon = daemons()
    (daemon.dir / "killedatimport.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    daemon.start(make_config({"default": {}},
                             handlers={"ok": "testhandlers:ok", "heavy": "killedatimport:run"}))
    assert daemon.wait_exit(20) == 3
    [failure] = daemon.events("boot failure")
    assert failure["error"] == ("handler 'heavy' (killedatimport:run) ended the handler "
                                "check at import (killed by SIGKILL)")
    assert not daemon.events("worker spawned")


@pytest.mark.parametrize(("source", "error"), [
    ("import jobd\n\nsettings = SETTINGS\n",
     "NameError: name 'SETTINGS' is not defined (at {file}, line 3)"),
    ("import no_such_dependency_for_jobd_tests\n",
     "ModuleNotFoundError: No module named 'no_such_dependency_for_jobd_tests' "
     "(at {file}, line 1)"),
])
def test_a_handler_module_that_fails_at_import_is_named_with_the_line_that_failed(
    daemons: Daemons, source: str, error: str
) -> None:
    # Before, the boot failure said only "NameError: name 'SETTINGS' is not defined": where,
    # in an application of many modules importing each other, was for its author to find.
    daemon = daemons()
    module = daemon.dir / "failsatimport.py"
    module.write_text(source + "def run(job):\n    pass\n")
    daemon.start(make_config({"default": {}},
                             handlers={"ok": "testhandlers:ok", "app": "failsatimport:run"}))
    assert daemon.wait_exit(20) == 3
    [failure] = daemon.events("boot failure")
    assert failure["error"] == ("handler 'app' (failsatimport:run) cannot be imported: "
                                + error.format(file=module))


def test_an_import_check_that_times_out_names_the_import_it_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hangsatimport.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p))
    check = HandlerCheck([ImportPath("handler", "ok", "jobd.examples:echo"),
                          ImportPath("outbox sender", "mail", "hangsatimport:send")],
                         timeout=1.0)
    assert check.wait() == ["importing the handlers took longer than 1s (still importing "
                            "outbox sender 'mail' (hangsatimport:send))"]


def with_sender_named_like_a_handler(config: dict[str, Any]) -> dict[str, Any]:
    """The config with an outbox sender that shares its name, "broken", with a handler:
    the sender imports, the handler does not."""
    return {**config, "outbox": {"lane": "default", "senders": {"broken": "testhandlers:ok"}}}


def test_a_handler_named_like_an_outbox_sender_is_import_checked_at_boot(
    daemons: Daemons,
) -> None:
    daemon = daemons(with_sender_named_like_a_handler(
        make_config({"default": {}}, handlers=BROKEN_HANDLERS)))
    assert daemon.wait_exit(20) == 3
    [failure] = daemon.events("boot failure")
    assert "handler 'broken'" in failure["error"]
    assert "no_such_module_for_jobd_tests" in failure["error"]
    assert not daemon.events("worker spawned")


def test_reload_refuses_a_broken_handler_named_like_an_outbox_sender(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1}}))
    before = daemon.wait_workers_started("default", 1)

    mark = daemon.reload(with_sender_named_like_a_handler(
        make_config({"default": {"workers": 1}}, handlers=BROKEN_HANDLERS)))
    refused = daemon.wait_for_log("reload refused; still running the previous config",
                                  since=mark)
    assert "handler 'broken'" in refused["error"]
    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert daemon.worker_pids("default") == before
    assert not daemon.events("worker exited", since=mark)


# --- 8. the LISTEN connection --------------------------------------------------------------


def listener_backends(conn: psycopg.Connection) -> list[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'jobd listener%%'"
        " AND datname = current_database()").fetchall()
    return [row[0] for row in rows]


def test_wakeups_resume_after_the_listen_connection_is_terminated(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1, "poll_interval": "60s"}}))
    daemon.wait_workers_started("default", 1)
    [backend] = wait_until(lambda: listener_backends(effects_db), 10,
                           message="the listener's backend")

    mark = daemon.mark()
    effects_db.execute("SELECT pg_terminate_backend(%s)", (backend,))
    daemon.wait_for_log("listen connection restored", since=mark, timeout=10)
    [new_backend] = wait_until(lambda: listener_backends(effects_db), 10,
                               message="a new listener backend")
    assert new_backend != backend

    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 10, daemon)
    [start] = effects(effects_db, job_id, "start")
    created = job_row(effects_db, job_id)["created_at"]
    assert start["at"] - created < timedelta(seconds=2)


# --- 9. long-poll, not busy-poll -----------------------------------------------------------


def idle_daemon(daemons: Daemons, effects_db: psycopg.Connection) -> Daemon:
    """One worker, warmed up, its fallback poll a minute away: work arrives through
    wake-ups alone."""
    daemon = daemons(make_config({"default": {"workers": 1, "poll_interval": "60s"}}))
    daemon.wait_workers_started("default", 1)
    warmup = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, warmup, "done", 15, daemon)
    return daemon


def test_notifications_and_scheduled_instants_wake_an_idle_lane(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = idle_daemon(daemons, effects_db)

    now_job = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, now_job, "done", 5, daemon)
    [start] = effects(effects_db, now_job, "start")
    assert start["at"] - job_row(effects_db, now_job)["created_at"] < timedelta(seconds=1)

    later = jobd.enqueue(effects_db, "ok", delay=3)
    run_at = job_row(effects_db, later)["run_at"]
    wait_state(effects_db, later, "done", 10, daemon)
    [start] = effects(effects_db, later, "start")
    assert run_at <= start["at"] <= run_at + timedelta(seconds=2)


def test_jobs_for_later_enqueued_beside_due_ones_start_at_their_instant(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # One enqueue_many of a job due now and one due in 3 s: the first wakes the lane, the
    # second sets the node's timer (before migration 0047 it waited for the fallback poll, a
    # minute away here).
    daemon = idle_daemon(daemons, effects_db)
    now = db_now(effects_db)
    now_job, later = jobd.enqueue_many(effects_db, [
        jobd.JobSpec("ok"), jobd.JobSpec("ok", run_at=now + timedelta(seconds=3))])
    wait_state(effects_db, now_job, "done", 5, daemon)
    wait_state(effects_db, later, "done", 10, daemon)
    [start] = effects(effects_db, later, "start")
    run_at = job_row(effects_db, later)["run_at"]
    assert run_at <= start["at"] <= run_at + timedelta(seconds=2)


def test_a_job_due_below_an_idle_workers_claim_floors_still_starts_within_seconds(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # The fallback poll is a minute away: only the worker's own look from the head of the
    # lane (jobd/claim_floors.py) can find a job that became due below its floors.
    daemon = idle_daemon(daemons, effects_db)
    # Out of work, it arms itself with floors past the warm-up job.
    wait_until(lambda: effects_db.execute("SELECT count(*) FROM lane_waiters").fetchone()
               == (1,), 10, message=lambda: f"the worker to arm\n{daemon.tail()}")
    # What an enqueue looks like whose transaction began long before it committed.
    straggler = jobd.enqueue(effects_db, "ok", run_at=db_now(effects_db) - timedelta(seconds=30))
    wait_state(effects_db, straggler, "done", 5, daemon)


def test_an_idle_lanes_wake_ups_go_to_the_worker_that_just_ran_out_of_work(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # One job at a time into a lane of three idle workers: each wake-up goes to the least
    # loaded worker, and a worker that has just run out of work says so at once, so the
    # same worker (warm) takes them, rather than each in turn at a third of the rate.
    daemon = daemons(make_config({"default": {"workers": 3, "poll_interval": "60s"}}))
    daemon.wait_workers_started("default", 3)
    claimers = []
    for _ in range(20):
        job = jobd.enqueue(effects_db, "ok")
        wait_state(effects_db, job, "done", 5, daemon)
        claimers.append(job_row(effects_db, job)["claimed_by"])
    # A wake-up the supervisor routes before it reads the previous job's report may go to
    # another worker; without the report on the way to idle they took turns (7/7/6).
    most = max(claimers.count(worker) for worker in set(claimers))
    assert most >= 16, claimers


def test_the_loop_relays_wake_ups_and_takes_signals_while_a_duty_statement_runs_long(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # The duties' statements (lease sweep, heartbeat, schedules, polls) run off the
    # supervisor's loop: one that takes long (a slow scan under a held horizon, a lock, a
    # pooler's queue) must not hold up the wake-ups the loop relays or the signals it takes.
    # They waited for it, up to the statement timeout (10 s) of each. Here the node heartbeat
    # takes 8 s.
    daemon = daemons(make_config({"default": {}}, supervisor={"log_level": "debug"}))
    daemon.wait_workers_started("default", 1)
    wait_until(lambda: effects_db.execute("SELECT count(*) FROM lane_waiters").fetchone()
               == (1,), 10, message=lambda: "the worker to sleep armed")
    effects_db.execute("""
        CREATE FUNCTION public.slow_heartbeat() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_sleep(8); RETURN NEW; END $$;
        CREATE TRIGGER slow_heartbeat BEFORE INSERT ON jobd.nodes
            FOR EACH ROW EXECUTE FUNCTION public.slow_heartbeat()""")
    sleeping_sql = ("SELECT pid, query_start FROM pg_stat_activity"
                    " WHERE datname = current_database()"
                    " AND application_name LIKE 'jobd supervisor%'"
                    " AND wait_event = 'PgSleep'")
    sleeping = wait_until(lambda: effects_db.execute(sleeping_sql).fetchone(), 10,
                          message=lambda: "the heartbeat to take its time")
    mark = daemon.mark()
    job = jobd.enqueue(effects_db, "ok")
    daemon.wait_for_log("woken", process="worker default#0", since=mark)
    wait_state(effects_db, job, "done", 5, daemon)
    daemon.signal(signal.SIGTERM)
    daemon.wait_for_log("draining", since=mark)
    # All while that very statement still ran.
    assert effects_db.execute(sleeping_sql).fetchone() == sleeping
    assert daemon.wait_exit(30) == 0
    effects_db.execute("DROP TRIGGER slow_heartbeat ON jobd.nodes")


def test_the_loop_takes_signals_while_the_listen_connection_waits_for_a_silent_host(
    daemons: Daemons, db_url: str
) -> None:
    # The LISTEN connection's attempts (each up to the 5 s connect timeout) and its probes
    # (up to the 30 s of tcp_user_timeout) run on a thread of their own: with a listen host
    # behind a partition, each attempt held the supervisor's loop, its signals, reaping and
    # relays, until it timed out.
    with silent_server(db_url) as (silent, silent_url):
        config = make_config({"default": {}}, supervisor={"log_level": "debug"})
        config["database"] = {"listen_url": silent_url}
        daemon = daemons(config)
        daemon.wait_for_log("LISTEN unavailable; waking workers on the fallback poll")
        daemon.wait_workers_started("default", 1)
        tried = len(silent.accepted)
        # A fresh attempt, which waits for the silent host for the next 5 s; the one before
        # it has said that it failed.
        wait_until(lambda: len(silent.accepted) > tried, 30,
                   message=lambda: f"another LISTEN attempt\n{daemon.tail()}")
        mark = daemon.mark()
        daemon.signal(signal.SIGTERM)
        draining = daemon.wait_for_log("draining", since=mark)
        before_draining = daemon.entries()[mark:daemon.entries().index(draining)]
        # The signal did not wait for the attempt to fail.
        assert [e for e in before_draining if e.get("event") == "LISTEN still unavailable"] == []
        assert daemon.wait_exit(30) == 0


# --- 10. command-line errors ---------------------------------------------------------------


def run_cli(*args: str, cwd: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBD_")}
    return subprocess.run([sys.executable, "-m", "jobd", *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=cwd)


def test_run_without_a_config_file_is_a_usage_error(db_url: str, tmp_path) -> None:
    result = run_cli("run", "--database-url", db_url, cwd=str(tmp_path))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "-c FILE" in line


def test_run_refuses_a_worker_timeout_shorter_than_two_liveness_reports(
    db_url: str, tmp_path
) -> None:
    # Workers report once a second: with 500ms every healthy worker was aborted as hung
    # and replaced, over and over, while the daemon ran as if configured fine.
    daemon = Daemon(tmp_path, db_url)
    daemon.write_config(make_config({"default": {}}, supervisor={"worker_timeout": "500ms"}))
    result = run_cli(*daemon.command()[3:], cwd=str(tmp_path))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "supervisor.worker_timeout: must be at least 2s" in line


def test_run_against_a_database_without_jobd_schema_says_to_migrate(
    databases, tmp_path
) -> None:
    empty_url = databases.empty()
    daemon = Daemon(tmp_path, empty_url)
    daemon.write_config(make_config({"default": {}}))
    result = run_cli("run", "-c", str(daemon.config_path), "--database-url", empty_url,
                     cwd=str(tmp_path))
    # A runtime failure, as every other command against it says (test_cli.py).
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "jobd migrate" in line


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the given processes, from /proc/PID/stat."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_a_database_outage_neither_spins_nor_loses_work(
    daemons: Daemons, effects_db: psycopg.Connection, pg_server: Any, db_url: str
) -> None:
    daemon = daemons(make_config({"default": {"workers": 2, "concurrency": 2,
                                              "poll_interval": "1s"}},
                                 supervisor={"duty_interval": "1s"}))
    daemon.wait_workers_started("default", 2)
    first = jobd.enqueue(effects_db, "ok", {"n": 1})
    wait_state(effects_db, first, "done", 15, daemon)

    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(pg_server.admin_url, autocommit=True) as admin:
        admin.execute(psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
            psycopg.sql.Identifier(dbname)))
        try:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND application_name LIKE 'jobd _%%'", (dbname,))
            wait_until(lambda: "database unavailable" in " ".join(
                daemon.child_processes().values()) or daemon.events("database unavailable"),
                15, message=lambda: f"the daemon to notice the outage\n{daemon.tail()}")
            # Down for a while: the supervisor and its workers wait, they do not spin.
            processes = [daemon.pid, *daemon.child_processes()]
            before, started = _cpu_seconds(processes), time.monotonic()
            window_deadline = started + 3.0
            while time.monotonic() < window_deadline:  # a measurement window, until deadline
                time.sleep(0.1)
            used = _cpu_seconds(processes) - before
            assert used < 0.3 * (time.monotonic() - started), (
                f"{used:.2f}s of CPU in a 3s outage\n{daemon.tail()}")
        finally:
            admin.execute(psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                psycopg.sql.Identifier(dbname)))
    # Back: work enqueued after the outage runs.
    with connect(db_url) as conn:
        second = jobd.enqueue(conn, "ok", {"n": 2})
        wait_state(conn, second, "done", 30, daemon)
    assert daemon.running()


def test_a_drain_without_the_database_says_which_jobs_stay_claimed_until_their_leases_expire(
    daemons: Daemons, effects_db: psycopg.Connection, pg_server: Any, db_url: str
) -> None:
    # A stop while the database is away (a host going down with its server, say): the
    # worker can neither record what finished nor give back what did not. Those jobs stay
    # claimed until their leases expire and then run again. Before, the log said "released
    # unfinished jobs" at info level (with released: 0) and nothing of the finished one.
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 2}},
                                 supervisor={"shutdown_timeout": "3s"}))
    daemon.wait_workers_started("default", 1)
    short = jobd.enqueue(effects_db, "slow", {"seconds": 1})
    long = jobd.enqueue(effects_db, "slow", {"seconds": 60})
    for job_id in (short, long):
        wait_until(lambda job_id=job_id: effects(effects_db, job_id, "start"), 10,
                   message=f"job {job_id} to start")

    dbname = psycopg.conninfo.conninfo_to_dict(db_url)["dbname"]
    with psycopg.connect(pg_server.admin_url, autocommit=True) as admin:
        admin.execute(psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
            psycopg.sql.Identifier(dbname)))
        try:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND application_name LIKE 'jobd _%%'", (dbname,))
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit(15) == 0
        finally:
            admin.execute(psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                psycopg.sql.Identifier(dbname)))
    # The short job's run ended (its handler fails to leave its trace: the database is
    # away); the long one's did not.
    unrecorded = daemon.events("exiting without recording finished jobs: the write to "
                               "the database failed; they stay claimed until their leases expire, "
                               "then run again", process=None)
    assert [e["job_ids"] for e in unrecorded] == [[short]], daemon.tail()
    assert unrecorded[0]["level"] == "warning"
    kept = daemon.events("exiting without giving back unfinished jobs: the write to "
                         "the database failed; they stay claimed until their leases expire, then "
                         "are retried", process=None)
    assert [e["job_ids"] for e in kept] == [[long]], daemon.tail()
    assert kept[0]["level"] == "warning"
    assert not daemon.events("released unfinished jobs", process=None)
    for job_id in (short, long):
        assert job_row(effects_db, job_id)["state"] == "claimed"


def test_reload_applies_a_new_log_level_to_the_supervisor_and_its_workers(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = daemons(make_config({"default": {"workers": 1}}))
    daemon.wait_workers_started("default", 1)
    job_id = jobd.enqueue(effects_db, "ok")
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert not daemon.events(process=None, level="debug")

    mark = daemon.reload(make_config({"default": {"workers": 1}},
                                     supervisor={"log_level": "debug"}))
    daemon.wait_for_log("config reloaded", since=mark)
    daemon.wait_workers_started("default", 1, since=mark)

    def relayed() -> bool:
        # A job enqueued while the new worker sleeps armed: the supervisor relays its
        # wake-up (a worker that is still claiming takes it without one).
        job_id = jobd.enqueue(effects_db, "ok")
        wait_state(effects_db, job_id, "done", 15, daemon)
        return bool(daemon.events("waking workers", since=mark))

    wait_until(relayed, 30, interval=0.2, message="a wake-up the supervisor logs at debug")
    daemon.wait_for_log("claimed", process=None, since=mark)  # the new worker's


RESTART_NEEDED = "database settings (url, schema, listen_url, pooler, timeouts) change on restart"


def test_reload_does_not_take_the_schema_given_on_the_command_line_for_an_edit(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # `jobd run --schema S` overrides the file's database.schema. A reload compared the
    # file's schema with S and warned, on every reload, that the database settings change on
    # restart, though nothing in the file had changed and a restart changes nothing.
    daemon = daemons()
    daemon.command = partial(Daemon.command, daemon, "--schema", "jobd")  # type: ignore[method-assign]
    config = {**make_config({"default": {"workers": 1}}), "database": {"schema": "elsewhere"}}
    daemon.start(config)
    daemon.wait_workers_started("default", 1)

    mark = daemon.reload({**config, "lanes": {"default": {**config["lanes"]["default"],
                                                           "concurrency": 3}}})
    daemon.wait_for_log("config reloaded", since=mark)
    daemon.wait_workers_started("default", 1, since=mark)
    job_id = jobd.enqueue(effects_db, "ok")  # the new worker runs on the schema it was given
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert not daemon.events(RESTART_NEEDED, since=mark), daemon.tail()

    mark = daemon.reload({**config, "database": {"schema": "moved"}})  # an edit: said so
    daemon.wait_for_log(RESTART_NEEDED, since=mark)


ARITY_MODULE = '''\
import jobd


def takes_nothing():
    pass


@jobd.transactional
def transactional_without_conn(job):
    pass
'''


def test_a_handler_that_cannot_take_its_arguments_fails_the_boot_with_exit_code_3(
    daemons: Daemons,
) -> None:
    # A handler pointed at the wrong function, or a transactional one that forgot `conn`,
    # was accepted and failed every attempt of every job with a TypeError until the jobs
    # reached the dead-letter queue.
    daemon = daemons()
    (daemon.dir / "arityhandlers.py").write_text(ARITY_MODULE)
    daemon.start(make_config({"default": {}}, handlers={
        "ok": "testhandlers:ok", "nothing": "arityhandlers:takes_nothing",
        "tx": "arityhandlers:transactional_without_conn"}))
    assert daemon.wait_exit(20) == 3
    errors = " ".join(failure["error"] for failure in daemon.events("boot failure"))
    assert "'nothing'" in errors and "handler(job)" in errors, errors
    assert "'tx'" in errors and "handler(job, conn)" in errors, errors
    assert not daemon.events("worker spawned")


def test_a_config_of_no_lanes_is_said_at_start_as_on_reload(daemons: Daemons) -> None:
    # A reload to such a file warned; a start with it came up silently, running nothing.
    daemon = daemons(make_config({}))
    daemon.wait_for_log("the config declares no lanes: this node runs no workers until a "
                        "reload adds one")
    assert not daemon.events("worker spawned")
