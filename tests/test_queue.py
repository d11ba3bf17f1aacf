"""The queue operations against a real PostgreSQL: enqueue, claim, fencing, retry, DLQ."""

from __future__ import annotations

import multiprocessing
import os
import random
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.types.json import Jsonb

import jobd
from jobd import dlq, queue, recovery, run_board
from jobd.backoff import Backoff, RetryPolicy
from jobd.claim_floors import full_scan_params
from jobd.db import connect
from jobd.jobs import JobSpec, Lease
from jobd.queries import query
from jobd.queue import Failure
from jobd.run_board import RunBoard, Running

if TYPE_CHECKING:
    from conftest import Databases


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def state_of(conn: psycopg.Connection, job_id: int) -> str:
    row = conn.execute("SELECT state FROM all_jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None, f"job {job_id} is nowhere"
    return row[0]


def policy(max_attempts: int = 8) -> recovery.PolicyLookup:
    return lambda _lane: RetryPolicy(Backoff(1.0, 300.0), max_attempts)


# --- enqueue -------------------------------------------------------------------------------


def test_enqueue_is_visible_only_when_the_callers_transaction_commits(db_url: str) -> None:
    with connect(db_url, autocommit=False) as writer, connect(db_url) as reader:
        job_id = jobd.enqueue(writer, "send_email", {"to": "a@example.com"})
        assert reader.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        writer.commit()
        row = reader.execute(
            "SELECT handler, payload, state, lane, attempts FROM jobs WHERE id = %s", (job_id,)
        ).fetchone()
    assert row == ("send_email", {"to": "a@example.com"}, "pending", "default", 0)


def test_rolled_back_enqueue_leaves_nothing(db_url: str) -> None:
    with connect(db_url, autocommit=False) as writer:
        jobd.enqueue(writer, "h")
        jobd.enqueue_many(writer, [JobSpec("h", idempotency_key="k")])
        writer.rollback()
    with connect(db_url) as reader:
        assert reader.execute("SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM job_keys)"
                              ).fetchone() == (0, 0)


def test_enqueue_many_as_a_transactions_first_statement_rolls_back_with_it(db_url: str) -> None:
    """A plain psycopg connection, as a caller opens one: enqueue_many is its first statement
    (psycopg's transaction() would commit a block of its own there), then the caller's work
    fails and is rolled back."""
    with psycopg.connect(db_url) as conn:
        jobd.enqueue_many(conn, [JobSpec("h", {"n": n}) for n in range(3)])
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()
        jobd.enqueue_many(conn, [JobSpec("h", {"n": 3})])
        conn.commit()
    with connect(db_url) as reader:
        assert reader.execute("SELECT payload FROM jobs").fetchall() == [({"n": 3},)]


def test_sql_function_takes_named_arguments(conn: psycopg.Connection) -> None:
    row = conn.execute(
        "SELECT enqueue('send_email', '{\"a\": 1}', run_at => now() + interval '1 hour', "
        "priority => 5, lane => 'mail')"
    ).fetchone()
    assert row is not None
    job = conn.execute(
        "SELECT lane, priority, run_at > now() + interval '59 minutes' FROM jobs WHERE id = %s",
        (row[0],),
    ).fetchone()
    assert job == ("mail", 5, True)


def test_idempotency_key_returns_the_first_job_even_after_it_was_archived(
    conn: psycopg.Connection,
) -> None:
    first = jobd.enqueue(conn, "charge", {"order": 1}, idempotency_key="order-1")
    assert jobd.enqueue(conn, "charge", {"order": 1}, idempotency_key="order-1") == first
    [job] = queue.claim(conn, "default", "w", 10, 30)
    assert queue.complete(conn, [job.lease]).applied == [first]
    assert state_of(conn, first) == "done"
    assert jobd.enqueue(conn, "charge", {"order": 1}, idempotency_key="order-1") == first
    assert jobd.enqueue_many(conn, [JobSpec("charge", idempotency_key="order-1")]) == [first]
    assert conn.execute("SELECT count(*) FROM all_jobs").fetchone() == (1,)


def test_enqueue_many_keeps_order_and_resolves_keys(conn: psycopg.Connection) -> None:
    existing = jobd.enqueue(conn, "h", idempotency_key="old")
    specs = [
        JobSpec("h", {"i": 0}),
        JobSpec("h", {"i": 1}, idempotency_key="old"),
        JobSpec("h", {"i": 2}, idempotency_key="new"),
        JobSpec("h", {"i": 3}, idempotency_key="new"),
        JobSpec("h", {"i": 4}, lane="other", priority=3),
    ]
    ids = jobd.enqueue_many(conn, specs)
    assert len(ids) == 5
    assert ids[1] == existing
    assert ids[2] == ids[3]
    assert len({ids[0], ids[2], ids[4], existing}) == 4
    rows = dict(conn.execute("SELECT id, payload FROM jobs").fetchall())
    assert rows[ids[0]] == {"i": 0}
    assert rows[ids[2]] == {"i": 2}
    assert rows[ids[4]] == {"i": 4}
    assert len(rows) == 4


def test_enqueue_rejects_bad_arguments(conn: psycopg.Connection) -> None:
    with pytest.raises(ValueError, match="lane"):
        jobd.enqueue(conn, "h", lane="bad lane")
    with pytest.raises(ValueError, match="handler"):
        jobd.enqueue(conn, "")
    with pytest.raises(ValueError, match="timezone-aware"):
        jobd.enqueue(conn, "h", run_at=datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="max_attempts"):
        jobd.enqueue(conn, "h", max_attempts=0)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


MIGRATE_HINT = ("jobd's schema 'jobd' is missing or incomplete in this database; run "
                "`jobd migrate` on it first")


def test_enqueue_into_an_unmigrated_database_asks_for_migrate(databases: Databases) -> None:
    """The Python API said only psycopg's `schema "jobd" does not exist` where the CLI and
    jobd.testing say to run `jobd migrate`. It still raises psycopg's own error, so callers
    that catch it by its class (or psycopg.Error) still do, with the server's diagnostics."""
    with psycopg.connect(databases.empty(), autocommit=True) as conn:
        for attempt in (lambda: jobd.enqueue(conn, "h"),
                        lambda: jobd.enqueue(conn, "h", fairness_key="tenant-1"),
                        lambda: jobd.enqueue_many(conn, [JobSpec("h")]),
                        lambda: jobd.enqueue_many(conn, [JobSpec("h", idempotency_key="k")]),
                        lambda: jobd.cancel(conn, [1]),
                        lambda: jobd.pause(conn, "default"),
                        lambda: jobd.resume(conn, "default", "h")):
            with pytest.raises(psycopg.errors.InvalidSchemaName) as raised:
                attempt()
            first_line = str(raised.value).splitlines()[0]
            assert first_line == f'schema "jobd" does not exist: {MIGRATE_HINT} (or pass the ' \
                                 "schema it uses: schema=)"
            assert raised.value.diag.message_primary == 'schema "jobd" does not exist'
            assert raised.value.sqlstate == "3F000"
        # In the caller's own transaction too: enqueue_many's savepoint is rolled back, as
        # for any of its errors, and the caller's transaction goes on.
        conn.autocommit = False
        with pytest.raises(psycopg.errors.InvalidSchemaName, match="jobd migrate"):
            jobd.enqueue_many(conn, [JobSpec("h")])
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()


def test_enqueue_into_an_older_schema_asks_for_migrate(conn: psycopg.Connection) -> None:
    """A schema of a jobd older than the caller's (here, one without fairness keys, migration
    0013) raises UndefinedFunction or UndefinedColumn with the same hint; an error that is
    not the schema's (a payload over the limit) is left as the server said it."""
    conn.execute("DROP FUNCTION jobd.enqueue(text, jsonb, text, timestamptz, int, text, int,"
                 " text)")
    with pytest.raises(psycopg.errors.UndefinedFunction) as raised:
        jobd.enqueue(conn, "h", fairness_key="tenant-1")
    assert MIGRATE_HINT in str(raised.value).splitlines()[0]
    conn.execute("ALTER TABLE jobd.jobs DROP COLUMN fairness_key CASCADE")
    with pytest.raises(psycopg.errors.UndefinedColumn, match="run `jobd migrate`"):
        jobd.enqueue_many(conn, [JobSpec("h", fairness_key="tenant-1")])
    conn.execute("UPDATE settings SET value = '16' WHERE name = 'max_payload_bytes'")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as too_big:
        jobd.enqueue_many(conn, [JobSpec("h", {"to": "x" * 40})])
    assert "jobd migrate" not in str(too_big.value)


def test_bulk_enqueue_sends_one_notification_per_lane(db_url: str) -> None:
    with connect(db_url) as listener, connect(db_url) as writer:
        for lane in ("a", "b"):  # due work notifies only lanes with a worker waiting
            assert queue.arm(writer, lane, f"worker-{lane}", full_scan_params()) == "armed"
        writer.commit()
        listener.execute("LISTEN jobd_wakeup")
        jobd.enqueue_many(writer, [JobSpec("h", lane="a") for _ in range(500)]
                          + [JobSpec("h", lane="b") for _ in range(500)])
        future = db_now(writer) + timedelta(hours=1)
        jobd.enqueue(writer, "h", lane="later", run_at=future)
        received = sorted(n.payload for n in listener.notifies(timeout=1.0, stop_after=3))
    assert received[:2] == ["a#500", "b#500"]
    lane, _, epoch = received[2].partition("@")
    assert lane == "later"
    assert abs(float(epoch) - future.timestamp()) < 0.001


# --- claim ---------------------------------------------------------------------------------


def test_claim_orders_by_priority_then_run_at_and_skips_future_jobs(
    conn: psycopg.Connection,
) -> None:
    now = db_now(conn)
    low_old = jobd.enqueue(conn, "h", priority=0, run_at=now - timedelta(minutes=5))
    high_new = jobd.enqueue(conn, "h", priority=10, run_at=now - timedelta(minutes=1))
    high_old = jobd.enqueue(conn, "h", priority=10, run_at=now - timedelta(minutes=2))
    mid = jobd.enqueue(conn, "h", priority=5, run_at=now - timedelta(minutes=1))
    jobd.enqueue(conn, "h", priority=99, run_at=now + timedelta(hours=1))
    jobd.enqueue(conn, "h", lane="elsewhere", priority=50)

    one_by_one = [queue.claim(conn, "default", "w1", 1, 30) for _ in range(5)]
    assert [[job.id for job in jobs] for jobs in one_by_one] == [
        [high_old], [high_new], [mid], [low_old], []]


def test_claim_batch_takes_the_highest_priorities_first(conn: psycopg.Connection) -> None:
    now = db_now(conn)
    ids = {p: jobd.enqueue(conn, "h", priority=p, run_at=now - timedelta(minutes=10 - p))
           for p in range(10)}
    first = queue.claim(conn, "default", "w1", 3, 30)
    assert {job.id for job in first} == {ids[9], ids[8], ids[7]}


def test_claim_sets_lease_and_counts_the_attempt(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    now = db_now(conn) + timedelta(seconds=1)
    [job] = queue.claim(conn, "default", "node-a:1", 1, 45, now=now)
    assert job.attempt == 1
    assert job.lease_until == now + timedelta(seconds=45)
    row = conn.execute(
        "SELECT state, claimed_by, attempts, lease_token FROM jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert row == ("claimed", "node-a:1", 1, job.lease_token)


def _claim_until_empty(db_url: str, worker: str, batch: int, results: multiprocessing.Queue
                       ) -> None:
    claimed: list[int] = []
    with connect(db_url) as conn:
        while True:
            jobs = queue.claim(conn, "default", worker, batch, 60)
            if not jobs:
                # The backlog is finite and fully due: an empty claim while other workers
                # hold locks can still happen, so confirm with a count before stopping.
                remaining = conn.execute(
                    "SELECT count(*) FROM jobs WHERE state = 'pending'").fetchone()
                if remaining == (0,):
                    break
                continue
            claimed.extend(job.id for job in jobs)
            queue.complete(conn, [job.lease for job in jobs])
    results.put(claimed)


def test_eight_processes_claim_twenty_thousand_jobs_each_exactly_once(
    conn: psycopg.Connection, db_url: str
) -> None:
    ids = jobd.enqueue_many(conn, [JobSpec("h", {"n": n}) for n in range(20_000)])
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [
        context.Process(target=_claim_until_empty, args=(db_url, f"w{i}", 1 + i * 7, results))
        for i in range(8)
    ]
    for process in workers:
        process.start()
    claimed = [job_id for _ in workers for job_id in results.get(timeout=120)]
    for process in workers:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert len(claimed) == 20_000
    assert sorted(claimed) == sorted(ids)
    assert conn.execute("SELECT count(*), min(attempts), max(attempts) FROM jobs_archive"
                        ).fetchone() == (20_000, 1, 1)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


# --- fencing -------------------------------------------------------------------------------


def test_a_worker_whose_lease_was_lost_cannot_touch_the_job(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    start = db_now(conn)
    [stale] = queue.claim(conn, "default", "w1", 1, 30, now=start)

    # w1 stalls past its lease; the sweep makes the job claimable; w2 takes it.
    swept = recovery.expire_leases(conn, lambda _l: RetryPolicy(Backoff(0.001, 0.001), 8),
                                now=start + timedelta(seconds=31))
    assert swept.retried == [job_id]
    [fresh] = queue.claim(conn, "default", "w2", 1, 30, now=start + timedelta(seconds=32))
    assert fresh.id == job_id and fresh.attempt == 2

    later = start + timedelta(seconds=33)
    assert queue.heartbeat(conn, [stale.lease], 30, now=later).lease_lost == [job_id]
    assert queue.complete(conn, [stale.lease], now=later).lease_lost == [job_id]
    failed = queue.fail(conn, [Failure(stale.lease, "late", 0, 8)], now=later)
    assert failed.lease_lost == [job_id]
    assert queue.release(conn, [stale.lease]).lease_lost == [job_id]

    row = conn.execute(
        "SELECT state, claimed_by, attempts, lease_token FROM jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert row == ("claimed", "w2", 2, fresh.lease_token)
    assert queue.complete(conn, [fresh.lease], now=later).applied == [job_id]
    assert state_of(conn, job_id) == "done"


def test_sweep_spares_a_lease_renewed_in_time(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    start = db_now(conn)
    [job] = queue.claim(conn, "default", "w1", 1, 30, now=start)
    assert queue.heartbeat(conn, [job.lease], 30, now=start + timedelta(seconds=20)).applied == [
        job_id]
    swept = recovery.expire_leases(conn, policy(), now=start + timedelta(seconds=40))
    assert swept.retried == swept.dead == []
    assert state_of(conn, job_id) == "claimed"


def test_a_node_leaves_the_expired_leases_of_a_lane_it_lacks_to_a_live_node_that_has_it(
    conn: psycopg.Connection,
) -> None:
    # A mixed fleet: lane "render" (20 attempts on an hour's backoff) is configured on node A
    # only. Node B's sweep used its defaults for it: 8 attempts, so a job at its 9th was
    # dead-lettered, or retried on the wrong backoff, whichever node swept first.
    job_id = jobd.enqueue(conn, "h", lane="render")
    start = db_now(conn)
    [job] = queue.claim(conn, "render", "a-worker", 1, 30, now=start)
    conn.execute("UPDATE jobs SET attempts = 9 WHERE id = %s", (job_id,))
    conn.execute(query("node_heartbeat"), {
        "instance": "a:1:x", "node": "a", "pid": 1, "workers": Jsonb({"render": 1}),
        "counters": Jsonb({}), "interval": 1.0, "listening": True, "archive_retention": None,
        "lane_settings": None})
    after = db_now(conn) + timedelta(seconds=1)
    conn.execute("UPDATE jobs SET lease_until = %s WHERE id = %s",
                 (after - timedelta(seconds=1), job_id))
    swept = recovery.sweep_expired_leases(conn, policy(), now=after, lanes=["default"])
    assert swept.failed.retried == swept.failed.dead == []
    assert state_of(conn, job_id) == "claimed"
    # Node A, which has the lane, sweeps it with the lane's policy.
    render = RetryPolicy(Backoff(60.0, 3600.0), 20)
    swept = recovery.sweep_expired_leases(conn, lambda _lane: render, now=after,
                                          lanes=["render"])
    assert swept.failed.retried == [job.id]
    # Once no live node has the lane, any node sweeps it (with what it knows).
    conn.execute("UPDATE jobs SET state = 'claimed', lease_until = %s, lease_token = 7,"
                 " claimed_by = 'a-worker' WHERE id = %s", (after - timedelta(seconds=1), job_id))
    gone = after + timedelta(minutes=5)
    swept = recovery.sweep_expired_leases(conn, policy(), now=gone, lanes=["default"])
    assert swept.failed.dead == [job_id]


def test_expired_only_fail_does_not_touch_a_live_lease(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    start = db_now(conn)
    [job] = queue.claim(conn, "default", "w1", 1, 30, now=start)
    outcome = queue.fail(conn, [Failure(job.lease, "x", 0, 8)],
                         now=start + timedelta(seconds=10), expired_only=True)
    assert outcome.lease_lost == [job_id]
    assert state_of(conn, job_id) == "claimed"


# --- retry and dead letters ----------------------------------------------------------------


def test_failed_job_waits_for_its_backoff_then_is_claimable(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    start = db_now(conn)
    [job] = queue.claim(conn, "default", "w1", 1, 30, now=start)
    assert queue.fail(conn, [Failure(job.lease, "boom", 10.0, 8)], now=start).retried == [job_id]
    row = conn.execute("SELECT state, last_error, run_at, lease_until, claimed_by IS NOT NULL "
                       "FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("failed", "boom", start + timedelta(seconds=10), None, True)
    assert queue.claim(conn, "default", "w1", 1, 30, now=start + timedelta(seconds=9)) == []
    [again] = queue.claim(conn, "default", "w1", 1, 30, now=start + timedelta(seconds=10))
    assert again.id == job_id and again.attempt == 2


def test_job_dies_after_max_attempts_with_its_error_history(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h", {"x": 1}, max_attempts=3, idempotency_key="k")
    now = db_now(conn)
    for attempt in range(1, 4):
        [job] = queue.claim(conn, "default", "w1", 1, 30, now=now)
        assert job.attempt == attempt
        outcome = queue.fail(conn, [Failure(job.lease, f"error {attempt}", 0, 8)], now=now)
        assert (outcome.dead if attempt == 3 else outcome.retried) == [job_id]
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    dead = conn.execute(
        "SELECT attempts, last_error, errors, payload, idempotency_key FROM dead_letter "
        "WHERE id = %s", (job_id,)).fetchone()
    assert dead is not None
    attempts, last_error, errors, payload, key = dead
    assert (attempts, last_error, payload, key) == (3, "error 3", {"x": 1}, "k")
    assert [e["error"] for e in errors] == ["error 1", "error 2", "error 3"]
    assert [e["attempt"] for e in errors] == [1, 2, 3]
    assert state_of(conn, job_id) == "dead"


def test_lane_default_budget_applies_when_the_job_sets_none(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    now = db_now(conn)
    [job] = queue.claim(conn, "default", "w1", 1, 30, now=now)
    assert queue.fail(conn, [Failure(job.lease, "e", 0, 2)], now=now).retried == [job_id]
    [job] = queue.claim(conn, "default", "w1", 1, 30, now=now)
    assert queue.fail(conn, [Failure(job.lease, "e", 0, 2)], now=now).dead == [job_id]


def test_expired_lease_with_spent_budget_goes_to_the_dead_letter_queue(
    conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "h", max_attempts=1)
    start = db_now(conn)
    queue.claim(conn, "default", "crashed-worker", 1, 30, now=start)
    outcome = recovery.expire_leases(conn, policy(), now=start + timedelta(seconds=31))
    assert outcome.dead == [job_id]
    row = conn.execute("SELECT last_error FROM dead_letter WHERE id = %s", (job_id,)).fetchone()
    assert row == ("lease expired (held by crashed-worker)",)


def test_a_worker_that_died_holding_several_jobs_makes_them_suspects(
    conn: psycopg.Connection,
) -> None:
    ids = jobd.enqueue_many(conn, [JobSpec("h") for _ in range(3)])
    queue.claim(conn, "default", "w-dead", 2, 30)
    [alive] = queue.claim(conn, "default", "w-alive", 1, 30)
    outcome = recovery.settle_crashed_worker(conn, "w-dead", "worker killed by SIGKILL", policy())
    assert len(outcome.suspects) == 2 and set(outcome.suspects) < set(ids)
    assert outcome.failed.retried == outcome.failed.dead == []
    rows = conn.execute("SELECT id, state, attempts, suspect, claimed_by FROM jobs ORDER BY id"
                        ).fetchall()
    # Their attempts are given back: nothing says which of them killed the worker.
    assert sorted(rows) == sorted(
        [(job_id, "pending", 0, True, None) for job_id in outcome.suspects]
        + [(alive.id, "claimed", 1, False, "w-alive")])


def test_a_worker_that_died_holding_one_job_spends_that_jobs_attempt(
    conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "h")
    queue.claim(conn, "default", "w-dead", 5, 30)
    outcome = recovery.settle_crashed_worker(conn, "w-dead", "worker killed by SIGKILL", policy())
    assert outcome.suspects == [] and outcome.failed.retried == [job_id]
    row = conn.execute("SELECT state, attempts, suspect, last_error FROM jobs").fetchone()
    assert row == ("failed", 1, True, "worker killed by SIGKILL")


def crash_alone(conn: psycopg.Connection, worker: str, policy_for: recovery.PolicyLookup
                ) -> recovery.CrashOutcome:
    """The job due first, suspect or not, claimed alone by ``worker``, which then dies."""
    request = queue.ClaimRequest("default", worker, 1, 30, suspect_first=True)
    conn.execute("UPDATE jobs SET run_at = now() - interval '1 second'")
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], request)
    assert len(claimed.jobs) + (claimed.suspect is not None) == 1
    return recovery.settle_crashed_worker(conn, worker, f"worker {worker} died: SIGSEGV",
                                          policy_for)


def test_a_job_that_kills_its_worker_alone_max_crashes_times_is_dead_lettered(
    conn: psycopg.Connection,
) -> None:
    """Each retry of a job that kills its worker kills one more: with 8 attempts, a poison
    arriving every 2 s kept a lane's two slots restarting and the lane did nothing else.
    Attempts that failed otherwise do not count."""
    job_id = jobd.enqueue(conn, "h")
    queue.claim(conn, "default", "w0", 1, 30)
    queue.fail(conn, [queue.Failure(queue_lease(conn), "ValueError: bad", 0.0, 8)])
    three = lambda _lane: RetryPolicy(Backoff(1.0, 300.0), 8, max_crashes=3)  # noqa: E731
    for worker in ("w1", "w2"):
        outcome = crash_alone(conn, worker, three)
        assert (outcome.failed.retried, outcome.failed.dead) == ([job_id], [])
    outcome = crash_alone(conn, "w3", three)
    assert (outcome.failed.retried, outcome.failed.dead) == ([], [job_id])
    attempts, last_error, errors = conn.execute(
        "SELECT attempts, last_error, errors FROM dead_letter WHERE id = %s", (job_id,)
    ).fetchone() or (None, None, None)
    assert attempts == 4  # of 8
    assert last_error == ("worker w3 died: SIGSEGV; dead-lettered: it killed its worker 3 "
                          "times running alone (lanes.default.max_crashes: 3)")
    # The crash that dead-lettered it is marked too: the history shows each crash it caused.
    assert [e.get("killed_worker", False) for e in errors] == [False, True, True, True]


def test_by_default_a_job_that_kills_its_worker_alone_twice_is_dead_lettered(
    conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "h")
    assert crash_alone(conn, "w1", policy()).failed.retried == [job_id]
    assert crash_alone(conn, "w2", policy()).failed.dead == [job_id]
    # A suspect from a crash among several jobs has killed nothing yet: it counts from 0.
    ids = jobd.enqueue_many(conn, [JobSpec("h") for _ in range(2)])
    queue.claim(conn, "default", "w-many", 2, 30)
    assert sorted(recovery.settle_crashed_worker(conn, "w-many", "died", policy()).suspects
                  ) == ids
    assert crash_alone(conn, "w3", policy()).failed.retried == [ids[0]]



def test_a_replayed_job_counts_its_crashes_afresh(conn: psycopg.Connection) -> None:
    """A replay gives a dead job a fresh attempt budget, and its crashes start over as well:
    counted from its whole history, a job replayed after a fix (or more memory) was
    dead-lettered again by the first crash it caused, after one run instead of
    max_crashes."""
    job_id = jobd.enqueue(conn, "h")
    crash_alone(conn, "w1", policy())
    assert crash_alone(conn, "w2", policy()).failed.dead == [job_id]
    assert dlq.replay(conn, [job_id]) == [job_id]
    outcome = crash_alone(conn, "w3", policy())
    assert (outcome.failed.retried, outcome.failed.dead) == ([job_id], [])
    outcome = crash_alone(conn, "w4", policy())
    assert (outcome.failed.retried, outcome.failed.dead) == ([], [job_id])
    row = conn.execute("SELECT last_error FROM dead_letter WHERE id = %s", (job_id,)).fetchone()
    assert row is not None and row[0].endswith(
        "it killed its worker 2 times running alone (lanes.default.max_crashes: 2)")

def queue_lease(conn: psycopg.Connection) -> Lease:
    row = conn.execute("SELECT id, lease_token FROM jobs WHERE state = 'claimed'").fetchone()
    assert row is not None
    return Lease(row[0], row[1])


def crash_with_board(conn: psycopg.Connection, running: set[int] | None, complete: bool = True
                     ) -> tuple[recovery.CrashOutcome, list[int]]:
    """Five jobs held by a worker that died, settled with its run board saying that the
    positions ``running`` (of the five, in id order) were running."""
    ids = jobd.enqueue_many(conn, [JobSpec("h") for _ in range(5)])
    assert len(queue.claim(conn, "default", "w-dead", 5, 30)) == 5
    board = None if running is None else Running(frozenset(ids[i] for i in running), complete)
    return (recovery.settle_crashed_worker(conn, "w-dead", "worker killed by SIGKILL",
                                           policy(), running=board), ids)


def job_states(conn: psycopg.Connection) -> dict[int, tuple[str, int, bool]]:
    rows = conn.execute("SELECT id, state, attempts, suspect FROM jobs").fetchall()
    return {row[0]: (row[1], row[2], row[3]) for row in rows}


def test_a_dead_workers_unstarted_jobs_go_back_unharmed(conn: psycopg.Connection) -> None:
    outcome, ids = crash_with_board(conn, {1, 3})
    assert outcome.suspects == [ids[1], ids[3]]
    assert outcome.given_back == [ids[0], ids[2], ids[4]]
    assert job_states(conn) == {
        job_id: ("pending", 0, job_id in (ids[1], ids[3])) for job_id in ids}


def test_the_one_job_a_dead_worker_was_running_spends_its_attempt(
    conn: psycopg.Connection,
) -> None:
    outcome, ids = crash_with_board(conn, {2})
    assert (outcome.suspects, outcome.failed.retried) == ([], [ids[2]])
    assert outcome.given_back == [ids[0], ids[1], ids[3], ids[4]]
    states = job_states(conn)
    assert states.pop(ids[2]) == ("failed", 1, True)
    assert states == {job_id: ("pending", 0, False) for job_id in states}


@pytest.mark.parametrize(("running", "complete"), [(None, True), (set(), True), ({0}, False)])
def test_a_board_that_proves_nothing_makes_every_job_held_a_suspect(
    conn: psycopg.Connection, running: set[int] | None, complete: bool
) -> None:
    """No board (an older supervisor), nothing running (the worker died outside any
    handler, say decoding a claim) or a board that missed an async run: any of the jobs
    held may have killed the worker."""
    outcome, ids = crash_with_board(conn, running, complete)
    assert (outcome.suspects, outcome.given_back) == (ids, [])


def test_a_job_an_earlier_crash_gave_back_makes_the_board_prove_nothing(
    conn: psycopg.Connection,
) -> None:
    """A handler that signals its own process (os.kill(os.getpid(), SIGSEGV)) may return,
    and clear its slot, before the signal ends the process: the board cleared it once. Held
    again by a worker that died, it is suspected with every other job held."""
    ids = jobd.enqueue_many(conn, [JobSpec("h") for _ in range(3)])
    assert len(queue.claim(conn, "default", "w-dead", 3, 30)) == 3
    outcome = recovery.settle_crashed_worker(
        conn, "w-dead", "worker killed by SIGSEGV", policy(),
        running=Running(frozenset({ids[0], ids[1]}), True), given_back_before={ids[2], 999})
    assert (outcome.suspects, outcome.given_back) == (ids, [])


def test_suspects_are_claimed_one_at_a_time_and_alone(conn: psycopg.Connection) -> None:
    jobd.enqueue_many(conn, [JobSpec("h") for _ in range(4)])
    queue.claim(conn, "default", "w-dead", 2, 30)
    suspects = recovery.settle_crashed_worker(conn, "w-dead", "killed", policy()).suspects
    # An ordinary claim leaves suspects alone.
    normal = queue.claim(conn, "default", "w1", 10, 30)
    assert len(normal) == 2 and not {job.id for job in normal} & set(suspects)
    # An idle worker takes one suspect, and the claim beside it then takes nothing.
    request = queue.ClaimRequest("default", "w2", 10, 30, suspect_first=True)
    jobd.enqueue(conn, "h")
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], request)
    assert claimed.suspect is not None and claimed.suspect.id == min(suspects)
    assert claimed.jobs == []
    assert queue.claim(conn, "default", "w2", 10, 30) == []  # still holding its suspect
    assert len(queue.claim(conn, "default", "w3", 10, 30)) == 1  # others are not held up


def test_replay_makes_a_dead_job_pending_with_a_fresh_budget(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h", max_attempts=1)
    [job] = queue.claim(conn, "default", "w", 1, 30)
    queue.fail(conn, [Failure(job.lease, "boom", 0, 8)])
    replayed = conn.execute(queue.query("replay_dead"), {"ids": [job_id], "now": None}).fetchall()
    assert replayed == [(job_id,)]
    row = conn.execute("SELECT state, attempts, jsonb_array_length(errors) FROM jobs "
                       "WHERE id = %s", (job_id,)).fetchone()
    assert row == ("pending", 0, 2)
    [again] = queue.claim(conn, "default", "w", 1, 30)
    assert again.id == job_id and again.lease_token != job.lease_token
    assert queue.complete(conn, [job.lease]).lease_lost == [job_id]


def test_released_jobs_due_long_ago_tell_the_lane_to_claim_from_the_head(db_url: str) -> None:
    """A job given back (a drain, a dead worker's unstarted jobs) may sit below the floors
    the lane's workers have moved past: 'behind' sends their next claims to the head."""
    with connect(db_url) as listener, connect(db_url) as writer:
        now = db_now(writer)
        jobd.enqueue(writer, "h", lane="old", run_at=now - timedelta(seconds=30))
        jobd.enqueue(writer, "h", lane="new", run_at=now)
        leases = [job.lease for lane in ("old", "new")
                  for job in queue.claim(writer, lane, "w", 1, 30)]
        writer.commit()
        listener.execute("LISTEN jobd_wakeup")
        assert len(queue.release(writer, leases).applied) == 2
        writer.commit()
        received = sorted(n.payload for n in listener.notifies(timeout=1.0, stop_after=3))
    assert received == ["new#1", "old!behind", "old#1"]


def test_release_returns_jobs_without_spending_an_attempt(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    [job] = queue.claim(conn, "default", "w", 1, 30)
    assert queue.release(conn, [job.lease]).applied == [job_id]
    row = conn.execute("SELECT state, attempts, claimed_by FROM jobs").fetchone()
    assert row == ("pending", 0, None)


def test_a_thousand_simultaneous_failures_retry_spread_over_the_window(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue_many(conn, [JobSpec("h") for _ in range(1000)])
    now = db_now(conn)
    jobs = queue.claim(conn, "default", "w", 1000, 30, now=now)
    backoff = Backoff(base=1.0, cap=300.0)
    rng = random.Random(7)
    # Attempt 6: the window is min(300, 1 * 2**5) = 32 s.
    failures = [Failure(job.lease, "dependency down", backoff.delay(6, rng), 8) for job in jobs]
    assert len(queue.fail(conn, failures, now=now).retried) == 1000
    rows = conn.execute(
        "SELECT extract(epoch FROM run_at - %s) FROM jobs", (now,)).fetchall()
    delays = sorted(float(r[0]) for r in rows)
    assert delays[0] >= 0 and delays[-1] <= 32
    # Spread, not a herd: no single second holds more than 10 % of the retries, and the
    # retries cover most of the window.
    per_second = [sum(1 for d in delays if s <= d < s + 1) for s in range(32)]
    assert max(per_second) < 100
    assert delays[-1] - delays[0] > 25


def test_crash_attribution_first_ends_what_the_dead_worker_still_runs(
    conn: psycopg.Connection, db_url: str,
) -> None:
    """A claim the worker sent before it died may still run on its backend; it must not
    commit after the attribution looked, so the backend is ended first."""
    from jobd.protocol import backend_prefix

    survivor = psycopg.connect(db_url, autocommit=True,
                               application_name=backend_prefix("node:default#0:beef") + "default#0")
    other = psycopg.connect(db_url, autocommit=True,
                            application_name=backend_prefix("node:default#1:cafe") + "default#1")
    try:
        recovery.settle_crashed_worker(conn, "node:default#0:beef", "died", policy())
        with pytest.raises(psycopg.OperationalError):
            survivor.execute("SELECT 1")
        assert other.execute("SELECT 1").fetchone() == (1,)  # another worker's: untouched
    finally:
        survivor.close()
        other.close()


# --- the run board ----------------------------------------------------------------------------


def test_the_run_board_shows_the_runs_in_progress_to_another_mapping() -> None:
    """The worker writes through its mapping; the supervisor reads through its own, as
    after the worker died (the memory outlives the process)."""
    supervisor_side, fd = RunBoard.create(concurrency=2)
    worker_side = RunBoard(fd, concurrency=2)
    os.close(fd)
    worker_side.thread_started(0, 11)
    worker_side.thread_started(1, 12)
    worker_side.thread_ended(0, 11)
    worker_side.thread_started(0, 13)
    worker_side.thread_ended(0, 13)
    first = worker_side.async_started(21)
    second = worker_side.async_started(22)
    # Thread 0's last job stays on the board (13, not 11): a handler that signalled its own
    # process may have returned before the signal ended it.
    assert supervisor_side.running() == Running(frozenset({12, 13, 21, 22}), complete=True)
    worker_side.async_ended(first)
    assert worker_side.async_started(23) == first  # a freed slot is taken again
    assert worker_side.async_started(24) is None  # both async slots are taken
    assert supervisor_side.running() == Running(frozenset({12, 13, 22, 23}), complete=False)
    worker_side.async_ended(second)
    worker_side.close()
    supervisor_side.close()


def test_ending_lost_backends_spares_any_session_not_named_as_the_caller(db_url: str) -> None:
    """end_backends ends a worker's lost connections' backends by pid; a pid the server has
    since given to another session, or to the caller's own, must survive it."""
    with (psycopg.connect(db_url, autocommit=True, application_name="jobd worker x") as mine,
          psycopg.connect(db_url, autocommit=True, application_name="someone else") as other):
        pids = [other.info.backend_pid, mine.info.backend_pid]
        assert queue.end_backends(mine, pids, 100) == []
        assert other.execute("SELECT 1").fetchone() == (1,)
        assert mine.execute("SELECT 1").fetchone() == (1,)


def test_the_run_board_carries_the_workers_shutdown_mark() -> None:
    """The worker marks the end of its shutdown; the supervisor reads it after the exit. The
    mark is no job: it never shows among the runs in progress."""
    supervisor_side, fd = RunBoard.create(concurrency=2)
    worker_side = RunBoard(fd, concurrency=2)
    os.close(fd)
    worker_side.thread_started(1, 12)
    assert not supervisor_side.shut_down()
    worker_side.mark_shut_down()
    assert supervisor_side.shut_down()
    assert supervisor_side.running() == Running(frozenset({12}), complete=True)
    worker_side.close()
    supervisor_side.close()


def test_a_board_from_a_supervisor_older_than_the_shutdown_mark_still_maps() -> None:
    """A worker upgraded under a running supervisor gets a board one slot short: it maps
    what there is, runs its jobs on it and writes no mark (that supervisor reads none)."""
    fd = os.memfd_create("older-run-board")
    os.ftruncate(fd, (run_board.THREADS + 3 * 2) * 8)  # the older layout: no mark
    worker_side = RunBoard(fd, concurrency=2)
    os.close(fd)
    worker_side.thread_started(0, 11)
    worker_side.mark_shut_down()
    assert not worker_side.shut_down()
    assert worker_side.running() == Running(frozenset({11}), complete=True)
    worker_side.close()
