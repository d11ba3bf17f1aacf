"""Each background duty on its own: a real connection, an injected monotonic clock, no
processes (jobd.duties)."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from types import SimpleNamespace

import psycopg
import pytest
import structlog
from daemon_support import wait_until

import jobd
from jobd import archive, protocol, queue, recovery
from jobd.backoff import Backoff, RetryPolicy
from jobd.config import Config, LaneConfig, ScheduleConfig
from jobd.db import ManagedConnection, connect
from jobd.duties import Duty, Router
from jobd.duties.crash_attribution import Attribution, CrashAttribution
from jobd.duties.horizon_watch import HorizonWatch
from jobd.duties.lane_poll import LanePoll
from jobd.duties.lease_sweep import LeaseSweep
from jobd.duties.materializer import Materializer
from jobd.duties.node_heartbeat import NodeHeartbeat
from jobd.duties.retention import BACKLOG_INTERVAL, MAINTENANCE_INTERVAL, Retention
from jobd.duties.runner import DeferredRouter, DutyRunner, LoopCalls
from jobd.eventloop import SelectLoop
from jobd.wake_routing import WakeRouter

NOW = 1000.0  # the injected monotonic clock
INSTANCE = "node-1:100:abcdef"


def policy(_lane: str) -> RetryPolicy:
    return RetryPolicy(Backoff(1.0, 1.0), 8)


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def wakes(router: WakeRouter) -> dict[str, int | None]:
    return dict(router._now)


def test_the_lease_sweep_fails_expired_leases_and_wakes_their_lanes(
    conn: psycopg.Connection,
) -> None:
    then = db_now(conn) - timedelta(minutes=5)
    job_id = jobd.enqueue(conn, "h", run_at=then)
    queue.claim(conn, "default", "w-frozen", 1, 30, now=then)
    router = WakeRouter()
    sweep = LeaseSweep(lambda: 10.0, policy, router, lambda: ["default", "other"])
    assert sweep.due(NOW)
    with structlog.testing.capture_logs() as logged:
        sweep.run(conn, NOW)
    assert sweep.next_at == NOW + 10.0 and not sweep.due(NOW + 9.9)
    row = conn.execute("SELECT state, last_error FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("failed", "lease expired (held by w-frozen)")
    [swept] = [e for e in logged if e["event"] == "expired leases swept"]
    assert (swept["lanes"], swept["retried"], swept["holders"]) == (
        ["default"], [job_id], {"w-frozen": 1})
    assert wakes(router) == {"default": None, "other": None}
    assert router.next_moment() < math.inf  # and a timer for the retry


def test_while_reads_from_the_head_are_spaced_out_the_sweep_looks_back(
    conn: psycopg.Connection,
) -> None:
    now = db_now(conn)
    recent = jobd.enqueue(conn, "h", run_at=now - timedelta(seconds=35))
    old = jobd.enqueue(conn, "h", run_at=now - timedelta(minutes=5))
    queue.claim(conn, "default", "w-frozen", 1, 30, now=now - timedelta(minutes=5))
    queue.claim(conn, "default", "w-frozen", 1, 30, now=now - timedelta(seconds=35))
    sweep = LeaseSweep(lambda: 10.0, policy, WakeRouter(), lambda: ["default"])
    sweep.head_scans.ran(NOW - 10.0, None, 1.0)  # a slow read from the head, spaced to 60 s

    def failed() -> set[int]:
        return {row[0] for row in conn.execute("SELECT id FROM jobs WHERE state = 'failed'")}

    sweep.run(conn, NOW)
    assert failed() == {recent}  # ran out 5 s ago; the other 4.5 minutes ago
    sweep.run(conn, sweep.head_scans.next_from_head)
    assert failed() == {recent, old}


def test_a_sweep_cut_short_or_rolled_back_reads_from_the_head_next(
    conn: psycopg.Connection,
) -> None:
    then = db_now(conn) - timedelta(minutes=5)
    jobd.enqueue_many(conn, [jobd.JobSpec("h", run_at=then) for _ in range(2)])
    queue.claim(conn, "default", "w-frozen", 2, 30, now=then)
    cut_short = recovery.sweep_expired_leases(conn, policy, limit=1)
    assert len(cut_short.failed.retried) == 1 and not cut_short.complete
    last = recovery.sweep_expired_leases(conn, policy, limit=2)  # room to spare
    assert len(last.failed.retried) == 1 and last.complete

    sweep = LeaseSweep(lambda: 10.0, policy, WakeRouter(), lambda: ["default"])
    sweep.head_scans.ran(NOW - 10.0, None, 1.0)  # spaced out: the next turn would look back
    assert sweep.head_scans.look_back(NOW) is not None
    sweep.rolled_back()
    assert sweep.head_scans.look_back(NOW) is None


def test_the_node_heartbeat_reports_the_node_and_measures_the_clock(
    conn: psycopg.Connection,
) -> None:
    router = WakeRouter()
    router.db_clock_offset = 1e6
    heartbeat = NodeHeartbeat(lambda: 5.0, INSTANCE, lambda: "node-1",
                              lambda: ({"default": 2}, {"default": {"claimed": 7}}), router,
                              retention=lambda: 86400.0)
    heartbeat.prepare()  # on the loop: the pool's snapshot
    heartbeat.run(conn, NOW)
    assert heartbeat.next_at == NOW + 5.0
    assert abs(router.db_clock_offset) < 5  # the same machine: about zero
    row = conn.execute("SELECT node, workers, counters, archive_retention FROM nodes"
                       " WHERE instance = %s", (INSTANCE,)).fetchone()
    assert row == ("node-1", {"default": 2}, {"default": {"claimed": 7}}, 86400.0)
    heartbeat.stop(conn)
    assert conn.execute("SELECT count(*) FROM nodes").fetchone() == (0,)


def test_crash_attribution_settles_each_dead_worker_once(conn: psycopg.Connection) -> None:
    jobd.enqueue_many(conn, [jobd.JobSpec("h") for _ in range(3)])
    queue.claim(conn, "default", "w-crowded", 2, 30)
    [alone] = queue.claim(conn, "default", "w-alone", 1, 30)
    router = WakeRouter()
    crashes = CrashAttribution(policy, router, lambda: ["default"])
    assert not crashes.due(NOW)  # nothing to settle
    crashes.add(Attribution("w-crowded", "default", "died: killed by SIGKILL", release=False))
    crashes.add(Attribution("w-alone", "default", "died: killed by SIGSEGV", release=False))
    assert crashes.due(NOW)
    crashes.run(conn, NOW)
    assert crashes.pending == [] and not crashes.due(NOW + 1e6)
    rows = {row[0]: row[1:] for row in conn.execute(
        "SELECT id, state, suspect, attempts FROM jobs").fetchall()}
    assert rows.pop(alone.id) == ("failed", True, 1)  # it alone killed its worker
    assert sorted(rows.values()) == [("pending", True, 0)] * 2  # suspects, attempt given back
    assert router._suspects == {"default"}


def test_crash_attribution_counts_and_logs_a_job_it_dead_letters_as_an_error(
    conn: psycopg.Connection,
) -> None:
    """The job that killed its worker on its last attempt is dead: logged at error level,
    as every other dead-lettering, and counted for the node (the worker cannot)."""
    jobd.enqueue(conn, "h", max_attempts=1)
    [job] = queue.claim(conn, "default", "w-alone", 1, 30)
    counted: list[tuple[str, dict[str, dict[str, int]]]] = []
    crashes = CrashAttribution(policy, WakeRouter(), lambda: ["default"],
                               counted=lambda lane, counts: counted.append((lane, counts)))
    crashes.add(Attribution("w-alone", "default", "died: killed by SIGSEGV", release=False))
    with structlog.testing.capture_logs() as logged:
        crashes.run(conn, NOW)
    [entry] = [e for e in logged if e["event"] == "failed the job that killed its worker"]
    assert (entry["log_level"], entry["dead_job_ids"]) == ("error", [job.id])
    assert counted == [("default", {"h": {"dead": 1}})]


@pytest.mark.parametrize("running", [1, 3])
def test_a_crash_explained_by_its_jobs_is_forgiven_whether_one_or_several_ran(
    conn: psycopg.Connection, running: int,
) -> None:
    """Pinned on one job, or several made suspects: the slot is told to restart without
    backing off further. A crash among several grew the backoff, and a fair lane's poison,
    claimed beside other jobs each time, kept its slots waiting up to a minute."""
    jobd.enqueue_many(conn, [jobd.JobSpec("h") for _ in range(running)])
    queue.claim(conn, "default", "w-crashed", running, 30)
    forgiven: list[str] = []
    crashes = CrashAttribution(policy, WakeRouter(), lambda: ["default"],
                               pinned=forgiven.append)
    crashes.add(Attribution("w-crashed", "default", "died: killed by SIGSEGV", release=False))
    crashes.run(conn, NOW)
    assert forgiven == ["w-crashed"]


def test_crash_attribution_gives_back_the_jobs_of_a_worker_we_stopped(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue(conn, "h")
    queue.claim(conn, "default", "w-stopped", 1, 30)
    router = WakeRouter()
    crashes = CrashAttribution(policy, router, lambda: ["default"])
    crashes.add(Attribution("w-stopped", "default", "killed at the drain deadline", True))
    crashes.run(conn, NOW)
    assert conn.execute("SELECT state, attempts, suspect FROM jobs").fetchone() == (
        "pending", 0, False)
    assert wakes(router) == {"default": None}


def test_the_materializer_declares_fires_refreshes_and_withdraws(
    conn: psycopg.Connection,
) -> None:
    config = Config(duty_interval=10.0, lanes={"default": LaneConfig("default")},
                    schedules=(ScheduleConfig("every-minute", "* * * * *", "h"),))
    router = WakeRouter()
    materializer = Materializer(INSTANCE, lambda: config, router)
    assert materializer.due(NOW)
    materializer.run(conn, NOW)
    declared = conn.execute("SELECT schedule_id, instance FROM schedule_declarations"
                            ).fetchall()
    assert declared == [("every-minute", INSTANCE)]
    # The sync leaves the tick and the refresh to the next turn, in a transaction of its own.
    assert materializer.due(NOW)
    materializer.run(conn, NOW)
    # Next: the refresh after duty_interval, or the next fire, whichever is first.
    assert NOW < materializer.next_at <= NOW + 10.0
    materializer.resync()
    assert materializer.due(NOW)
    materializer.stop(conn)
    assert conn.execute("SELECT count(*) FROM schedule_declarations").fetchone() == (0,)


def test_a_reloaded_expression_starts_when_the_config_was_read_not_at_the_sync(
    conn: psycopg.Connection,
) -> None:
    # The sync follows the reload's import check, about a second later. A change saved and
    # signalled just before a minute's boundary missed that minute when the new expression
    # started at the sync.
    lanes = {"default": LaneConfig("default")}
    config = Config(duty_interval=60.0, lanes=lanes,
                    schedules=(ScheduleConfig("report", "0 0 1 1 *", "h"),))
    router = WakeRouter()
    materializer = Materializer(INSTANCE, lambda: config, router)
    materializer.run(conn, time.monotonic())
    # As if declared (and last fired) two minutes before.
    conn.execute("UPDATE schedules SET materialized_until = now() - interval '2 minutes'")
    # Read just before the last minute's boundary, by the database's clock.
    db_epoch = db_now(conn).timestamp()
    router.measured_db_clock(db_epoch)
    boundary = math.floor(db_epoch / 60) * 60
    read_at = time.monotonic() - (db_epoch - boundary) - 0.3
    config = Config(duty_interval=60.0, lanes=lanes,
                    schedules=(ScheduleConfig("report", "* * * * *", "h"),))
    materializer.resync(read_at)
    materializer.run(conn, time.monotonic())  # the sync
    materializer.run(conn, time.monotonic())  # the tick
    fired = conn.execute("SELECT run_at FROM jobs WHERE handler = 'h'").fetchall()
    assert [row[0].timestamp() for row in fired] == [boundary]


def _blocked_on_a_lock(conn: psycopg.Connection, pid: int) -> bool:
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                       (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def test_a_node_syncing_a_schedule_the_other_lacks_does_not_deadlock_with_its_tick(
    conn: psycopg.Connection, db_url: str,
) -> None:
    # Node 1's config has only b; a, due too, is another node's. Its sync locks b, and a
    # tick in the same duty transaction then locked a after b, out of the id order every
    # tick locks in: with node 2's tick holding a and waiting for b, a lock cycle, which
    # PostgreSQL broke by failing one of the two duty transactions.
    lanes = {"default": LaneConfig("default")}
    other = Config(duty_interval=10.0, lanes=lanes,
                   schedules=(ScheduleConfig("a", "* * * * *", "h"),
                              ScheduleConfig("b", "* * * * *", "h")))
    Materializer("node-0:1:000000", lambda: other, WakeRouter()).run(conn, NOW)
    conn.execute("UPDATE schedules SET materialized_until = now() - interval '2 minutes'")
    mine = Config(duty_interval=10.0, lanes=lanes,
                  schedules=(ScheduleConfig("b", "* * * * *", "h"),))
    node1 = Materializer(INSTANCE, lambda: mine, WakeRouter())
    with connect(db_url, autocommit=False) as duties, \
            connect(db_url, autocommit=False) as ticking:
        for each in (duties, ticking):  # a lock cycle shows up as a deadlock error
            each.execute("SET lock_timeout = '20s'")
            each.commit()

        def duty_pass() -> None:  # as DutyRunner runs the shared duties
            with duties.transaction():
                node1.run(duties, time.monotonic())

        with ThreadPoolExecutor(1) as pool:
            ticking.execute("SELECT fire_schedule('a', 'x', now() - interval '1 minute')")
            done = pool.submit(duty_pass)
            wait_until(lambda: done.done() or _blocked_on_a_lock(conn, duties.info.backend_pid),
                       timeout=10)
            try:
                ticking.execute("SELECT fire_schedule('b', 'x', now() - interval '1 minute')")
                ticking.commit()
            finally:
                error = done.exception(timeout=30)
        assert error is None, repr(error)
        # The tick it left for its next turn fires what is still due, in a transaction of
        # its own.
        assert node1.due(time.monotonic())
        duty_pass()
    fired = conn.execute("SELECT schedule_id, count(*) FROM schedule_fires"
                         " WHERE occurrence <> 'x' GROUP BY 1 ORDER BY 1").fetchall()
    assert [schedule_id for schedule_id, _ in fired] == ["a", "b"]


def test_the_materializer_warns_of_a_schedule_into_a_lane_the_node_does_not_serve(
    conn: psycopg.Connection,
) -> None:
    # A typo in a schedule's lane stranded its jobs in a lane nobody serves, without a word.
    config = Config(duty_interval=10.0, lanes={"default": LaneConfig("default")},
                    schedules=(ScheduleConfig("typo", "* * * * *", "h", lane="defualt"),
                               ScheduleConfig("fine", "* * * * *", "h")))
    materializer = Materializer(INSTANCE, lambda: config, WakeRouter())
    with structlog.testing.capture_logs() as logged:
        materializer.run(conn, NOW)
    warnings = [e for e in logged if e["log_level"] == "warning"]
    assert [(e["schedule"], e["lane"]) for e in warnings] == [("typo", "defualt")]


def test_the_lane_poll_finds_due_work_future_work_and_suspects(
    conn: psycopg.Connection,
) -> None:
    lanes = {name: LaneConfig(name, poll_interval=2.0) for name in ("now", "later", "idle")}
    config = Config(lanes=lanes)
    jobd.enqueue(conn, "h", lane="now")
    jobd.enqueue(conn, "h", lane="later", delay=3600)
    conn.execute("INSERT INTO jobs (handler, lane, suspect) VALUES ('h', 'idle', true)")
    router = WakeRouter()
    poll = LanePoll(lambda: config, router)
    poll.run(conn, NOW)
    assert NOW + 1.6 <= poll.next_at <= NOW + 2.4  # jittered
    assert wakes(router) == {"now": None, "idle": None}
    assert "later" in router._at
    assert router._suspects == {"idle"}


def test_while_reads_from_the_head_are_spaced_out_the_lane_poll_looks_back(
    conn: psycopg.Connection,
) -> None:
    config = Config(lanes={"old": LaneConfig("old", poll_interval=2.0)})
    jobd.enqueue(conn, "h", lane="old", run_at=db_now(conn) - timedelta(minutes=5))
    router = WakeRouter()
    poll = LanePoll(lambda: config, router)
    poll.head_scans.ran(NOW - 2.0, None, 1.0)  # a slow read from the head, spaced to 60 s
    poll.run(conn, NOW)
    assert wakes(router) == {}  # due only since before the look back
    poll.run(conn, poll.head_scans.next_from_head)
    assert wakes(router) == {"old": None}

    # After a reload or a LISTEN reconnect the poll reads from the head at once.
    router = WakeRouter()
    poll = LanePoll(lambda: config, router)
    poll.head_scans.ran(NOW - 2.0, None, 1.0)
    poll.poll_now()
    poll.run(conn, NOW)
    assert wakes(router) == {"old": None}


def test_retention_runs_hourly(conn: psycopg.Connection) -> None:
    retention = Retention(lambda: 7 * 86400.0)
    assert retention.due(NOW)
    retention.run(conn, NOW)
    assert retention.next_at == NOW + MAINTENANCE_INTERVAL


def test_retention_comes_back_soon_while_a_backlog_lasts(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn.execute("INSERT INTO job_keys (idempotency_key, job_id, created_at)"
                 " SELECT 'old-' || n, -n, now() - interval '30 days'"
                 "   FROM generate_series(1, 30) AS n")
    monkeypatch.setattr(archive, "PRUNE_BATCH", 10)
    monkeypatch.setattr(archive, "PRUNE_BUDGET", 0.0)
    retention = Retention(lambda: 7 * 86400.0)
    retention.run(conn, NOW)
    assert retention.next_at == NOW + BACKLOG_INTERVAL
    while retention.next_at == NOW + BACKLOG_INTERVAL:
        retention.run(conn, NOW)
    assert retention.next_at == NOW + MAINTENANCE_INTERVAL
    assert conn.execute("SELECT count(*) FROM job_keys").fetchone() == (0,)


class Recorder(Duty):
    """A duty that writes a row, or fails after writing it."""

    name = "recorder"

    def __init__(self, fail: bool = False, alone: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.alone = alone  # type: ignore[misc]
        self.rolled = False

    def run(self, conn: psycopg.Connection, now: float) -> None:
        self.next_at = now + 1.0
        conn.execute("INSERT INTO public.recorded (failing) VALUES (%s)", (self.fail,))
        if self.fail:
            conn.execute("SELECT 1/0")

    def rolled_back(self) -> None:
        self.rolled = True


@pytest.fixture
def link(db_url: str, conn: psycopg.Connection) -> ManagedConnection:
    conn.execute("CREATE TABLE public.recorded (failing boolean)")
    managed = ManagedConnection(db_url, "jobd", "jobd test")
    managed.ensure()
    yield managed
    managed.close()


def come_back(runner: DutyRunner, loop: SelectLoop, timeout: float = 10.0) -> None:
    """Sleep in the loop, as the supervisor does, until the batch on the thread comes back."""
    wait_until(lambda: (loop.wait(0.1), not runner.busy)[1], timeout,
               message=lambda: "the duties' batch to come back")


def test_duties_due_together_share_one_transaction(
    link: ManagedConnection, conn: psycopg.Connection,
) -> None:
    ok, failing, alone = Recorder(), Recorder(fail=True), Recorder(alone=True)
    loop = SelectLoop()
    runner = DutyRunner([ok, failing, alone], link, loop, LoopCalls())
    runner.dispatch(NOW)
    come_back(runner, loop)
    # The failing duty rolled back the one it shared a transaction with, not the one alone.
    assert conn.execute("SELECT count(*) FROM public.recorded").fetchone() == (1,)
    assert ok.rolled and failing.rolled and not alone.rolled
    assert link.conn is not None  # a failed statement is not a lost connection
    assert runner.next_at() == NOW + 1.0
    runner.dispatch(NOW + 0.5)  # nothing due yet
    assert not runner.busy
    runner.stop()


class Waiter(Duty):
    """A duty whose statement waits for a lock, then routes a wake-up."""

    name = "waiter"

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router
        self.polled = 0

    def poll_now(self) -> None:
        self.polled += 1
        self.next_at = 0.0

    def run(self, conn: psycopg.Connection, now: float) -> None:
        self.next_at = now + 60.0
        conn.execute("LOCK TABLE public.recorded IN SHARE MODE")
        self.router.due_now("default")


def test_the_loop_does_not_wait_for_a_duty_that_waits_for_a_lock(
    link: ManagedConnection, conn: psycopg.Connection, db_url: str,
) -> None:
    # The supervisor's loop relays wake-ups, reaps workers and takes signals: a duty's
    # statement that waits (a lock, a slow scan, a pooler's queue) must not hold it up.
    router = WakeRouter()
    worker = SimpleNamespace(lane="default", retiring=False, capacity=10, wake_load=0, busy=0)
    calls = LoopCalls()
    waiter = Waiter(DeferredRouter(router, calls))
    loop = SelectLoop()
    runner = DutyRunner([waiter], link, loop, calls)
    with connect(db_url, autocommit=False) as holder:
        holder.execute("LOCK TABLE public.recorded IN EXCLUSIVE MODE")
        runner.dispatch(NOW)
        wait_until(lambda: conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'jobd test' AND wait_event_type = 'Lock'"
        ).fetchone() == (1,), 10,
            message=lambda: "the duty's statement to wait for the lock")
        loop.wait(0.05)  # returns: nothing woke it but the timeout
        assert runner.busy and runner.next_at() == math.inf
        # What the loop asks of a duty on the thread waits for the batch to come back, and
        # what the duty routed reaches the router only then, on the loop.
        runner.when_idle(waiter.poll_now)
        assert waiter.polled == 0
        holder.rollback()
        wait_until(lambda: len(calls._calls) == 1, 10,
                   message=lambda: "the duty to route its wake-up")
        assert router.route([worker]) == []  # not before the batch comes back
    come_back(runner, loop)
    assert waiter.polled == 1 and waiter.next_at == 0.0
    assert router.route([worker]) == [(worker, protocol.WAKE)]
    runner.stop()


class Broken(Duty):
    name = "broken"

    def run(self, conn: psycopg.Connection, now: float) -> None:
        self.next_at = now + 60.0
        raise KeyError("a defect, not a database error")


def test_a_defect_in_a_duty_ends_the_loop_as_it_would_on_the_loop(
    link: ManagedConnection,
) -> None:
    loop = SelectLoop()
    runner = DutyRunner([Broken()], link, loop, LoopCalls())
    runner.dispatch(NOW)
    with pytest.raises(KeyError, match="a defect"):
        come_back(runner, loop)
    assert not runner.busy


def test_the_horizon_watch_names_the_transaction_that_holds_vacuum_back(
    db_url: str, conn: psycopg.Connection
) -> None:
    watch = HorizonWatch(lambda: 10.0, lambda: 0.5)
    with connect(db_url, autocommit=False) as holder:
        holder.execute("SET application_name = 'nightly report'")
        holder.execute("SELECT txid_current()")
        [[pid]] = holder.execute("SELECT pg_backend_pid()").fetchall()
        wait_until(lambda: conn.execute(  # older than the threshold
            "SELECT now() - xact_start >= interval '0.5 s' FROM pg_stat_activity"
            " WHERE pid = %s", (pid,)).fetchone() == (True,), 10, interval=0.05,
            message=lambda: "the holder to be half a second old")
        with structlog.testing.capture_logs() as logged:
            watch.run(conn, 0.0)
            watch.run(conn, 10.0)  # the same holder: not repeated every turn
        warnings = [e for e in logged if e["log_level"] == "warning" and "kind" in e]
        assert len(warnings) == 1
        [warning] = warnings
        assert (warning["kind"], warning["pid"], warning["name"]) == (
            "transaction", pid, "nightly report")
        assert warning["age_seconds"] >= 0.5
        assert warning["state"] == "idle in transaction"
        holder.rollback()
    with structlog.testing.capture_logs() as logged:
        watch.run(conn, 20.0)
    assert [e["event"] for e in logged if "reasons" not in e] == ["vacuum horizon released"]


def test_the_horizon_watch_is_quiet_below_its_threshold(
    db_url: str, conn: psycopg.Connection
) -> None:
    watch = HorizonWatch(lambda: 10.0, lambda: 300.0)
    with connect(db_url, autocommit=False) as holder:
        holder.execute("SELECT txid_current()")
        with structlog.testing.capture_logs() as logged:
            watch.run(conn, 0.0)
        holder.rollback()
    assert [e for e in logged if "reasons" not in e] == []


def autovacuum_reasons(logged: list[dict[str, object]]) -> list[object]:
    return [e["reasons"] for e in logged if e["log_level"] == "warning" and "reasons" in e]


def test_the_horizon_watch_warns_while_autovacuum_is_off_for_the_jobs_table(
    conn: psycopg.Connection,
) -> None:
    # Off, nothing removes the dead rows every job leaves: the table grows by tens of
    # thousands of them a minute under load, and nothing said so.
    [[server_off]] = conn.execute("SELECT NOT current_setting('autovacuum')::boolean"
                                  ).fetchall()
    server = ["the server setting autovacuum is off"] if server_off else []
    table = "the table option autovacuum_enabled of jobs is false"
    watch = HorizonWatch(lambda: 10.0, lambda: 300.0)
    conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")
    with structlog.testing.capture_logs() as logged:
        watch.run(conn, 0.0)
        watch.run(conn, 10.0)  # the same reasons: not repeated every turn
    assert autovacuum_reasons(logged) == [[*server, table]]
    with structlog.testing.capture_logs() as logged:
        watch.run(conn, 10.0 + 3600.0)  # but again an hour later
    assert autovacuum_reasons(logged) == [[*server, table]]
    conn.execute("ALTER TABLE jobs RESET (autovacuum_enabled)")
    with structlog.testing.capture_logs() as logged:
        watch.run(conn, 3620.0)
    assert autovacuum_reasons(logged) == ([[*server]] if server else [])
