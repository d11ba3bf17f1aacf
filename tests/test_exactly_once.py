"""Transactional handlers against a real PostgreSQL: replays of a job have exactly one effect.

A transactional handler's writes, the record of its effect key in ``processed_keys`` and the
fenced completion of the job commit together or not at all. These tests drive one job through
the situations that cause a second execution — two workers (an expired lease and a re-claim),
two threads at once, a process killed between the effect and the commit, the same key
delivered as several jobs, a handler that raises — and count the effect rows afterwards.

Lease expiry is simulated with the queue functions' injectable ``now``: nothing sleeps for a
lease to run out. The effect table has no unique constraint, so a double effect would show as
two rows.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, job_row, make_config, wait_until
from netcut import cutting_proxy
from psycopg.rows import dict_row

import jobd
import jobd.testing
from jobd import exactly_once, handlers, protocol, queue, recovery
from jobd.backoff import Backoff, RetryPolicy
from jobd.config import LaneConfig
from jobd.db import connect
from jobd.exactly_once import LeaseLost, run_transactional
from jobd.handler_runner import HandlerRunner
from jobd.jobs import Job
from jobd.outcomes import Outcome
from jobd.queue import Failure

daemons = daemon_support.daemons

VISIBILITY = 30.0  # seconds of lease per claim in these tests
LANE = "default"


# --- helpers -------------------------------------------------------------------------------


@pytest.fixture
def tables(conn: psycopg.Connection) -> psycopg.Connection:
    """``public.effects`` (the handler's transactional write, no unique constraint) and
    ``public.executions`` (every call of the handler, written outside its transaction)."""
    conn.execute("CREATE TABLE public.effects (id bigserial PRIMARY KEY, key text NOT NULL,"
                 " job_id bigint NOT NULL, worker text NOT NULL)")
    conn.execute("CREATE TABLE public.executions (id bigserial PRIMARY KEY, key text NOT NULL,"
                 " job_id bigint NOT NULL, worker text NOT NULL)")
    return conn


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def policy(max_attempts: int = 8) -> recovery.PolicyLookup:
    return lambda _lane: RetryPolicy(Backoff(1.0, 1.0), max_attempts)


def state_of(conn: psycopg.Connection, job_id: int) -> str:
    row = conn.execute("SELECT state FROM all_jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None, f"job {job_id} is nowhere"
    return str(row[0])


def effect_rows(conn: psycopg.Connection) -> list[tuple[str, int, str]]:
    return [(r[0], r[1], r[2]) for r in conn.execute(
        "SELECT key, job_id, worker FROM public.effects ORDER BY id")]


def execution_count(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM public.executions").fetchone()
    assert row is not None
    return int(row[0])


def processed_keys(conn: psycopg.Connection) -> list[tuple[str, int]]:
    return [(r[0], r[1]) for r in conn.execute(
        "SELECT idempotency_key, job_id FROM processed_keys ORDER BY idempotency_key")]


def insert_effect(job: Job, conn: psycopg.Connection, worker: str) -> None:
    conn.execute("INSERT INTO public.effects (key, job_id, worker) VALUES (%s, %s, %s)",
                 (job.effect_key, job.id, worker))


def record_execution(db_url: str, job: Job, worker: str) -> None:
    """Outside the handler's transaction: survives its rollback."""
    with connect(db_url) as side:
        side.execute("INSERT INTO public.executions (key, job_id, worker) VALUES (%s, %s, %s)",
                     (job.effect_key, job.id, worker))


def effect_handler(worker: str, calls: list[str] | None = None, db_url: str | None = None,
                   entered: threading.Event | None = None,
                   release: threading.Event | None = None,
                   ) -> Callable[[Job, psycopg.Connection], None]:
    """A transactional handler that writes one effect row; optionally it records the call,
    then says it is inside (``entered``) and waits for ``release`` before returning."""

    @jobd.transactional
    def handler(job: Job, conn: psycopg.Connection) -> None:
        if calls is not None:
            calls.append(worker)
        if db_url is not None:
            record_execution(db_url, job, worker)
        insert_effect(job, conn, worker)
        if entered is not None:
            entered.set()
        if release is not None:
            assert release.wait(30), "the test never released the handler"

    return handler


def claim_one(conn: psycopg.Connection, worker: str, now: datetime) -> Job:
    jobs = queue.claim(conn, LANE, worker, 1, VISIBILITY, now=now)
    assert len(jobs) == 1, f"{worker} claimed {len(jobs)} jobs"
    return jobs[0]


def reclaim_after_expiry(conn: psycopg.Connection, stale: Job, worker: str) -> Job:
    """Let ``stale``'s lease run out (the sweep fails the attempt, backoff 1s) and claim the
    job again for ``worker``; returns the new claim."""
    after = stale.lease_until + timedelta(seconds=1)
    swept = recovery.expire_leases(conn, policy(), now=after)
    assert swept.retried == [stale.id]
    fresh = claim_one(conn, worker, after + timedelta(seconds=2))
    assert fresh.id == stale.id and fresh.lease_token != stale.lease_token
    assert fresh.effect_key == stale.effect_key
    return fresh


def backend_waits_on_lock(conn: psycopg.Connection, application_name: str) -> bool:
    row = conn.execute(
        "SELECT wait_event_type FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = %s",
        (application_name,)).fetchone()
    return row is not None and row[0] == "Lock"


# --- (a) the same job through two workers --------------------------------------------------


@pytest.mark.parametrize("stale_runs_first", [True, False],
                         ids=["stale-worker-first", "stale-worker-after-commit"])
def test_stale_worker_rolls_back_when_its_job_was_reclaimed(
    tables: psycopg.Connection, db_url: str, stale_runs_first: bool
) -> None:
    conn = tables
    job_id = jobd.enqueue(conn, "tx", {"order": 1}, idempotency_key="order-1")
    a = claim_one(conn, "worker-a", db_now(conn))
    b = reclaim_after_expiry(conn, a, "worker-b")
    calls: list[str] = []

    with connect(db_url) as a_conn, connect(db_url) as b_conn:
        if stale_runs_first:
            # A's handler runs (the key is free) and writes its effect; the fenced
            # completion finds B's token and everything of A's rolls back.
            with pytest.raises(LeaseLost):
                run_transactional(a_conn, a, effect_handler("worker-a", calls))
            assert calls == ["worker-a"]
            assert effect_rows(conn) == []
            assert processed_keys(conn) == []
            assert state_of(conn, job_id) == "claimed"
            assert run_transactional(b_conn, b, effect_handler("worker-b", calls)) == "done"
        else:
            assert run_transactional(b_conn, b, effect_handler("worker-b", calls)) == "done"
            # A finds the key (its handler is skipped) and then its lease gone.
            with pytest.raises(LeaseLost):
                run_transactional(a_conn, a, effect_handler("worker-a", calls))

    assert calls == (["worker-a", "worker-b"] if stale_runs_first else ["worker-b"])
    assert effect_rows(conn) == [("order-1", job_id, "worker-b")]
    assert processed_keys(conn) == [("order-1", job_id)]
    assert state_of(conn, job_id) == "done"
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_a_committed_job_cannot_be_claimed_or_committed_again(
    tables: psycopg.Connection, db_url: str
) -> None:
    conn = tables
    job_id = jobd.enqueue(conn, "tx")
    now = db_now(conn)
    a = claim_one(conn, "worker-a", now)
    calls: list[str] = []
    with connect(db_url) as a_conn:
        assert run_transactional(a_conn, a, effect_handler("worker-a", calls)) == "done"
        # Nothing is left to claim or to sweep, however late it gets.
        later = now + timedelta(hours=1)
        assert queue.claim(conn, LANE, "worker-b", 10, VISIBILITY, now=later) == []
        swept = recovery.expire_leases(conn, policy(), now=later)
        assert swept.retried == [] and swept.dead == []
        # The same claimed Job run again (a worker that did not learn of its commit).
        with pytest.raises(LeaseLost):
            run_transactional(a_conn, a, effect_handler("worker-a", calls))
    assert calls == ["worker-a"]
    assert effect_rows(conn) == [(f"jobd:job:{job_id}", job_id, "worker-a")]
    assert processed_keys(conn) == [(f"jobd:job:{job_id}", job_id)]
    assert state_of(conn, job_id) == "done"


@pytest.mark.parametrize("statement", ["ROLLBACK", "COMMIT"])
def test_a_handler_that_ends_the_transaction_itself_fails_its_job_and_the_effect_stays_once(
    tables: psycopg.Connection, db_url: str, statement: str
) -> None:
    # A ROLLBACK in the handler undid its write and the effect key, and the completion then
    # committed alone: the job done, its effect never made. A COMMIT made the effect apart
    # from the completion. Both now fail the attempt; after a COMMIT the retry finds the key.
    conn = tables
    job_id = jobd.enqueue(conn, "tx")

    @jobd.transactional
    def handler(job: Job, tx: psycopg.Connection) -> None:
        insert_effect(job, tx, "worker-a")
        tx.execute(statement)

    first = claim_one(conn, "worker-a", db_now(conn))
    with connect(db_url) as a_conn:
        with pytest.raises(exactly_once.TransactionEnded, match="ended the job's transaction"):
            run_transactional(a_conn, first, handler)
        assert a_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert state_of(conn, job_id) == "claimed"
    expected = [] if statement == "ROLLBACK" else [(f"jobd:job:{job_id}", job_id, "worker-a")]
    assert effect_rows(conn) == expected
    if statement == "COMMIT":
        queue.release(conn, [first.lease])
        with connect(db_url) as b_conn:
            retry = claim_one(conn, "worker-b", db_now(conn))
            assert run_transactional(b_conn, retry, handler) == "replayed"
        assert effect_rows(conn) == expected
        assert state_of(conn, job_id) == "done"


@pytest.mark.parametrize("statement", ["ROLLBACK", "ROLLBACK; BEGIN", "COMMIT; BEGIN"])
def test_what_a_handler_writes_after_ending_the_transaction_itself_is_never_committed(
    tables: psycopg.Connection, db_url: str, statement: str
) -> None:
    # After its own ROLLBACK the handler's next write committed on its own (the pool's
    # connections are autocommit), and the effect key was gone: every retry ran the handler
    # again and wrote it again. After "ROLLBACK; BEGIN" the completion committed in the new
    # transaction: the job done, its key never recorded. Now neither commits anything.
    conn = tables
    job_id = jobd.enqueue(conn, "tx")

    @jobd.transactional
    def handler(job: Job, tx: psycopg.Connection) -> None:
        tx.execute(statement)
        insert_effect(job, tx, "worker-a")

    committed = statement.startswith("COMMIT")
    for attempt in (1, 2):
        job = claim_one(conn, "worker-a", db_now(conn))
        with connect(db_url) as a_conn:
            if committed and attempt == 2:
                # The key committed with the COMMIT: the retry completes the job unrun.
                assert run_transactional(a_conn, job, handler) == "replayed"
            else:
                with pytest.raises(exactly_once.TransactionEnded,
                                   match="ended the job's transaction"):
                    run_transactional(a_conn, job, handler)
            assert a_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert a_conn.autocommit, "the connection goes back as it came"
        assert effect_rows(conn) == [], f"attempt {attempt}"
        if state_of(conn, job_id) == "claimed":
            queue.release(conn, [job.lease])
    assert state_of(conn, job_id) == ("done" if committed else "pending")
    assert processed_keys(conn) == ([(f"jobd:job:{job_id}", job_id)] if committed else [])


def test_a_handler_that_goes_on_after_a_failed_statement_is_told_so(
    tables: psycopg.Connection, db_url: str
) -> None:
    # It used to fail as "ended the job's transaction itself (a COMMIT or ROLLBACK)", which
    # it never sent: the usual case is an error caught without a savepoint.
    conn = tables
    job_id = jobd.enqueue(conn, "tx")

    @jobd.transactional
    def handler(job: Job, tx: psycopg.Connection) -> None:
        insert_effect(job, tx, "worker-a")
        try:
            tx.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass

    job = claim_one(conn, "worker-a", db_now(conn))
    with connect(db_url) as a_conn, pytest.raises(
            exactly_once.TransactionAborted, match=r"failed and the handler went on.*savepoint"):
        run_transactional(a_conn, job, handler)
    assert state_of(conn, job_id) == "claimed"
    assert effect_rows(conn) == [] and processed_keys(conn) == []


def test_a_handler_that_closes_its_connection_is_told_so(
    tables: psycopg.Connection, db_url: str
) -> None:
    # It failed as "ended the job's transaction itself (a COMMIT or ROLLBACK statement)",
    # which it never sent: its author was left to look for a COMMIT in the handler.
    conn = tables
    job_id = jobd.enqueue(conn, "tx")

    @jobd.transactional
    def handler(job: Job, tx: psycopg.Connection) -> None:
        insert_effect(job, tx, "worker-a")
        tx.close()

    job = claim_one(conn, "worker-a", db_now(conn))
    with connect(db_url) as a_conn, pytest.raises(
            exactly_once.TransactionEnded,
            match=r"^handler 'tx' closed the job's connection \(conn.close\(\)\), which "
                  r"ended the job's transaction; leave the connection open"):
        run_transactional(a_conn, job, handler)
    assert state_of(conn, job_id) == "claimed"
    assert effect_rows(conn) == [] and processed_keys(conn) == []


def test_a_handler_that_raises_psycopgs_rollback_fails_its_attempt_saying_so(
    tables: psycopg.Connection, db_url: str
) -> None:
    # psycopg.Rollback ends the innermost `with conn.transaction()` block and is swallowed
    # there: raised out of the handler, that block was jobd's own, which then went on as if
    # the handler had returned and failed the run with "UnboundLocalError: cannot access
    # local variable 'completed'".
    conn = tables
    job_id = jobd.enqueue(conn, "tx")

    @jobd.transactional
    def handler(job: Job, tx: psycopg.Connection) -> None:
        insert_effect(job, tx, "worker-a")
        raise psycopg.Rollback()

    job = claim_one(conn, "worker-a", db_now(conn))
    with connect(db_url) as a_conn:
        with pytest.raises(exactly_once.TransactionRolledBack,
                           match=r"'tx' raised psycopg.Rollback.*rolled back"):
            run_transactional(a_conn, job, handler)
        assert a_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert state_of(conn, job_id) == "claimed"
    assert effect_rows(conn) == [] and processed_keys(conn) == []


# --- (b) two threads at once ---------------------------------------------------------------


@pytest.mark.parametrize("first", ["stale", "current"])
def test_concurrent_runs_of_one_key_serialize_on_the_key(
    tables: psycopg.Connection, db_url: str, first: str
) -> None:
    """The first run holds the key (uncommitted) inside its handler; the second run's key
    insert waits for it. Whatever the order, one effect: the stale run's."""
    conn = tables
    job_id = jobd.enqueue(conn, "tx", idempotency_key="pay-7")
    stale = claim_one(conn, "worker-a", db_now(conn))
    current = reclaim_after_expiry(conn, stale, "worker-b")
    jobs = {"stale": (stale, "worker-a"), "current": (current, "worker-b")}
    second = "current" if first == "stale" else "stale"

    calls: list[str] = []
    entered, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def run(which: str, handler: Callable[[Job, psycopg.Connection], None]) -> None:
        job, worker = jobs[which]
        with connect(db_url, application_name=f"test {worker}") as tx_conn:
            try:
                results[which] = run_transactional(tx_conn, job, handler)
            except BaseException as exc:
                results[which] = exc

    first_worker, second_worker = jobs[first][1], jobs[second][1]
    first_thread = threading.Thread(target=run, args=(
        first, effect_handler(first_worker, calls, entered=entered, release=release)))
    second_thread = threading.Thread(target=run, args=(
        second, effect_handler(second_worker, calls)))
    first_thread.start()
    try:
        assert entered.wait(10), "the first handler never started"
        second_thread.start()
        # The second run is stuck on the first one's uncommitted key, before its handler.
        # While in the transaction, the backend carries the lease in its application_name.
        wait_until(lambda: backend_waits_on_lock(
                       conn, recovery.handler_application_name(jobs[second][0].lease)), 10, 0.02,
                   f"{second_worker}'s key insert to wait on a lock")
        assert calls == [first_worker]
        assert effect_rows(conn) == []  # nothing committed yet
    finally:
        release.set()
        first_thread.join(30)
        second_thread.join(30)
    assert not first_thread.is_alive() and not second_thread.is_alive()

    assert isinstance(results["stale"], LeaseLost), results
    assert results["current"] == "done", results
    if first == "stale":
        # The stale run rolled back, freeing the key: the current one ran its handler.
        assert calls == ["worker-a", "worker-b"]
    else:
        # The current run committed the key: the stale one skipped its handler.
        assert calls == ["worker-b"]
    assert effect_rows(conn) == [("pay-7", job_id, "worker-b")]
    assert processed_keys(conn) == [("pay-7", job_id)]
    assert state_of(conn, job_id) == "done"


# --- (c) a crash between the effect and the commit -----------------------------------------


def _run_and_die(db_url: str, job: Job) -> None:
    """In a child process: run the job's handler, which writes its effect and then kills
    the process before run_transactional can commit."""

    @jobd.transactional
    def handler(job: Job, conn: psycopg.Connection) -> None:
        record_execution(db_url, job, "crasher")
        insert_effect(job, conn, "crasher")
        os.kill(os.getpid(), signal.SIGKILL)

    with connect(db_url, application_name="test crasher") as conn:
        run_transactional(conn, job, handler)
    os._exit(0)  # not reached


def test_a_crash_between_effect_and_commit_leaves_no_trace_and_the_retry_runs_once(
    tables: psycopg.Connection, db_url: str
) -> None:
    conn = tables
    job_id = jobd.enqueue(conn, "tx", idempotency_key="mail-42")
    job = claim_one(conn, "worker-a", db_now(conn))

    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_run_and_die, args=(db_url, job))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    # The server notices the dead client and aborts its transaction.
    wait_until(lambda: conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'test crasher'"
    ).fetchone() == (0,), 30, 0.02, "the dead child's backend to go away")

    assert execution_count(conn) == 1  # the handler did run
    assert effect_rows(conn) == []
    assert processed_keys(conn) == []
    assert state_of(conn, job_id) == "claimed"

    retry = reclaim_after_expiry(conn, job, "worker-b")
    with connect(db_url) as b_conn:
        assert run_transactional(
            b_conn, retry, effect_handler("worker-b", db_url=db_url)) == "done"
    assert execution_count(conn) == 2
    assert effect_rows(conn) == [("mail-42", job_id, "worker-b")]
    assert processed_keys(conn) == [("mail-42", job_id)]
    assert state_of(conn, job_id) == "done"


# --- (d, e) the same key delivered again ---------------------------------------------------


def insert_job_bypassing_the_ledger(conn: psycopg.Connection, key: str) -> int:
    """A second job with a key already used: what a producer that skips jobd.enqueue, or a
    key ledger pruned before the dedup store, would deliver."""
    row = conn.execute(
        "INSERT INTO jobs (handler, idempotency_key) VALUES ('tx', %s) RETURNING id", (key,)
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("how", ["direct-insert", "ledger-pruned"])
def test_a_replayed_key_is_a_no_op_that_still_completes_the_job(
    tables: psycopg.Connection, db_url: str, how: str
) -> None:
    conn = tables
    first_id = jobd.enqueue(conn, "tx", idempotency_key="invoice-9")
    calls: list[str] = []
    with connect(db_url) as tx_conn:
        job = claim_one(conn, "worker-a", db_now(conn))
        assert run_transactional(tx_conn, job, effect_handler("worker-a", calls)) == "done"

        if how == "direct-insert":
            second_id = insert_job_bypassing_the_ledger(conn, "invoice-9")
        else:
            conn.execute("DELETE FROM job_keys WHERE idempotency_key = 'invoice-9'")
            second_id = jobd.enqueue(conn, "tx", idempotency_key="invoice-9")
        assert second_id != first_id

        replay = claim_one(conn, "worker-b", db_now(conn))
        assert replay.id == second_id and replay.effect_key == "invoice-9"
        assert run_transactional(tx_conn, replay, effect_handler("worker-b", calls)) \
            == "replayed"

    assert calls == ["worker-a"]
    assert effect_rows(conn) == [("invoice-9", first_id, "worker-a")]
    assert processed_keys(conn) == [("invoice-9", first_id)]
    assert state_of(conn, first_id) == "done"
    assert state_of(conn, second_id) == "done"
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_five_deliveries_of_one_key_have_one_effect(
    tables: psycopg.Connection, db_url: str
) -> None:
    conn = tables
    ids = [jobd.enqueue(conn, "tx", idempotency_key="ship-3")]
    ids += [insert_job_bypassing_the_ledger(conn, "ship-3") for _ in range(4)]
    calls: list[str] = []
    outcomes = []
    with connect(db_url) as tx_conn:
        for n in range(5):
            job = claim_one(conn, f"worker-{n}", db_now(conn))
            outcomes.append(run_transactional(tx_conn, job, effect_handler(f"worker-{n}", calls)))
    assert outcomes == ["done"] + ["replayed"] * 4
    assert calls == ["worker-0"]
    assert len(effect_rows(conn)) == 1
    assert [state_of(conn, job_id) for job_id in ids] == ["done"] * 5


def test_one_job_through_five_workers_has_one_effect(
    tables: psycopg.Connection, db_url: str
) -> None:
    """A key-less job (key ``job:<id>``) whose lease expires four times: every worker runs
    the handler, only the one holding the lease at the end commits."""
    conn = tables
    job_id = jobd.enqueue(conn, "tx")
    claims = [claim_one(conn, "worker-0", db_now(conn))]
    for n in range(1, 5):
        claims.append(reclaim_after_expiry(conn, claims[-1], f"worker-{n}"))
    outcomes: list[object] = []
    with connect(db_url) as tx_conn:
        for n, job in enumerate(claims):
            try:
                outcomes.append(run_transactional(
                    tx_conn, job, effect_handler(f"worker-{n}", db_url=db_url)))
            except LeaseLost as exc:
                outcomes.append(type(exc))
    assert outcomes == [LeaseLost] * 4 + ["done"]
    assert execution_count(conn) == 5
    assert effect_rows(conn) == [(f"jobd:job:{job_id}", job_id, "worker-4")]
    assert state_of(conn, job_id) == "done"
    row = conn.execute("SELECT attempts FROM all_jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == (5,)


# --- (f) a handler that raises -------------------------------------------------------------


def test_a_failing_handler_leaves_nothing_and_the_retry_has_one_effect(
    tables: psycopg.Connection, db_url: str
) -> None:
    conn = tables
    job_id = jobd.enqueue(conn, "tx", idempotency_key="refund-5")

    @jobd.transactional
    def flaky(job: Job, tx: psycopg.Connection) -> None:
        insert_effect(job, tx, "flaky")
        tx.execute("INSERT INTO public.effects (key, job_id, worker) VALUES ('other', 0, 'x')")
        raise RuntimeError("the payment provider said no")

    now = db_now(conn)
    job = claim_one(conn, "worker-a", now)
    with connect(db_url) as tx_conn:
        with pytest.raises(RuntimeError, match="provider said no"):
            run_transactional(tx_conn, job, flaky)
        assert effect_rows(conn) == []
        assert processed_keys(conn) == []
        assert state_of(conn, job_id) == "claimed"
        # The connection is usable again: the transaction was rolled back, not left open.
        assert tx_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

        failed = queue.fail(conn, [Failure(job.lease, "RuntimeError", 1.0, 8)], now=now)
        assert failed.retried == [job_id]
        retry = claim_one(conn, "worker-b", now + timedelta(seconds=2))
        assert retry.attempt == 2
        assert run_transactional(tx_conn, retry, effect_handler("worker-b")) == "done"
    assert effect_rows(conn) == [("refund-5", job_id, "worker-b")]
    assert processed_keys(conn) == [("refund-5", job_id)]
    assert state_of(conn, job_id) == "done"


# --- known problems ------------------------------------------------------------------------


def test_a_derived_key_does_not_collide_with_a_callers_key(
    tables: psycopg.Connection, db_url: str
) -> None:
    conn = tables
    keyless = jobd.enqueue(conn, "tx")
    keyed = jobd.enqueue(conn, "tx", idempotency_key=f"job:{keyless}")
    calls: list[str] = []
    summary = jobd.testing.run_jobs(db_url, LANE, handlers={"tx": effect_handler("w", calls)})
    assert [(run.id, run.outcome) for run in summary.runs] == [(keyless, "done"), (keyed, "done")]
    assert calls == ["w", "w"]  # neither run was taken for a replay of the other
    assert len(effect_rows(conn)) == 2


# --- the transaction's settings --------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_a_stricter_default_isolation_does_not_fail_a_run_the_heartbeat_renewed(
    tables: psycopg.Connection, db_url: str, isolation: str
) -> None:
    # The worker renews the job's lease (an UPDATE of its row) while the handler runs; at
    # the role's or database's stricter default the completion's DELETE of that row failed
    # every run that outlasted a heartbeat.
    conn = tables
    job_id = jobd.enqueue(conn, "tx", {"order": 1})
    job = claim_one(conn, "worker-a", db_now(conn))

    @jobd.transactional
    def renewed_midway(job: Job, handler_conn: psycopg.Connection) -> None:
        insert_effect(job, handler_conn, "worker-a")
        assert queue.heartbeat(conn, [job.lease], VISIBILITY).applied == [job.id]

    with connect(db_url) as handler_conn:
        handler_conn.execute(f"SET default_transaction_isolation = '{isolation}'")
        assert run_transactional(handler_conn, job, renewed_midway) == "done"
    assert state_of(conn, job_id) == "done"
    assert effect_rows(conn) == [(job.effect_key, job_id, "worker-a")]


@pytest.mark.parametrize(("role_timeout", "lane_timeout"), [
    ("200ms", None),  # the role's own bound stands without a lane timeout
    ("200ms", 5.0),  # and against a looser lane timeout
    ("0", 0.2),  # the lane's bounds a transaction the role leaves unbounded
], ids=["no-lane-timeout", "looser-lane", "lane-only"])
def test_the_tighter_of_the_roles_and_the_lanes_statement_timeout_bounds_the_transaction(
    tables: psycopg.Connection, db_url: str, role_timeout: str, lane_timeout: float | None
) -> None:
    conn = tables
    jobd.enqueue(conn, "tx", {"order": 1})
    job = claim_one(conn, "worker-a", db_now(conn))

    @jobd.transactional
    def slow(job: Job, handler_conn: psycopg.Connection) -> None:
        handler_conn.execute("SELECT pg_sleep(1)")

    with connect(db_url) as handler_conn:
        # As ALTER ROLE ... SET statement_timeout would set it.
        handler_conn.execute(f"SET statement_timeout = '{role_timeout}'")
        with pytest.raises(psycopg.errors.QueryCanceled):
            run_transactional(handler_conn, job, slow, timeout=lane_timeout)
        assert handler_conn.execute("SHOW statement_timeout").fetchone() == (role_timeout,)


@dataclass
class Started:
    """A job handed to a HandlerRunner (its Start)."""

    job: Job
    started: float | None = None
    taken_back: bool = False


# --- a transaction its worker lost --------------------------------------------------------------


def abandoned_after_completion(db_url: str, job: Job) -> psycopg.Connection:
    """A handler's transaction that got as far as its completion (the job's row deleted,
    its key recorded) and was never committed: what the server keeps of a frozen or
    disconnected handler. Returns its connection, left open."""
    abandoned = connect(db_url)
    abandoned.execute("BEGIN")
    abandoned.execute(
        "SELECT set_config('application_name', %s, true)",
        (recovery.handler_application_name(job.lease),))
    assert queue.complete(abandoned, [job.lease]).applied == [job.id]
    return abandoned


def test_the_sweep_takes_every_other_expired_lease_and_ends_an_abandoned_transaction(
    conn: psycopg.Connection, db_url: str
) -> None:
    # One expired lease whose row an abandoned handler transaction holds made the sweep wait
    # on it until lock_timeout, which rolled back the sweep of every other expired lease
    # (and the duties sharing its transaction), every turn, on every node.
    held, other = (jobd.enqueue(conn, "tx", {"n": n}) for n in (1, 2))
    now = db_now(conn)
    claimed = queue.claim(conn, LANE, "worker-a", 2, VISIBILITY, now=now)
    job = next(j for j in claimed if j.id == held)
    abandoned = abandoned_after_completion(db_url, job)
    after = now + timedelta(seconds=VISIBILITY + 1)
    try:
        with connect(db_url) as sweeper:
            sweeper.execute("SET lock_timeout = '200ms'")
            with sweeper.transaction():
                swept = recovery.sweep_expired_leases(sweeper, policy(), now=after)
        assert swept.failed.retried == [other]
        wait_until(lambda: abandoned.closed or abandoned.broken or not alive_backend(
            conn, recovery.handler_application_name(job.lease)), 10,
            message="the abandoned transaction is ended")
        # Its row is back as it was claimed: the next sweep takes it.
        def swept_again() -> bool:
            with connect(db_url) as sweeper, sweeper.transaction():
                return recovery.sweep_expired_leases(
                    sweeper, policy(), now=after).failed.retried == [held]
        wait_until(swept_again, 10, message="the next sweep takes the held job")
    finally:
        abandoned.close()


def alive_backend(conn: psycopg.Connection, application_name: str) -> bool:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                       (application_name,)).fetchone()
    return row is not None and row[0] > 0


def test_ending_an_abandoned_transaction_frees_its_job_for_the_failure(
    conn: psycopg.Connection, db_url: str
) -> None:
    # A worker whose handler connection was lost writes the failure at once; the server's
    # side of that connection, idle in its transaction, would make it wait on the row.
    job_id = jobd.enqueue(conn, "tx", {"n": 1})
    job = claim_one(conn, "worker-a", db_now(conn))
    abandoned = abandoned_after_completion(db_url, job)
    try:
        assert exactly_once.end_abandoned(conn, job) == 1
        with connect(db_url) as worker_conn:
            worker_conn.execute("SET lock_timeout = '5s'")
            failed = queue.fail(worker_conn, [Failure(job.lease, "connection lost", 1.0, 8)])
        assert failed.retried == [job_id]
    finally:
        abandoned.close()


def is_commit(message: bytes) -> bool:
    """A simple-protocol query message that is COMMIT and nothing else."""
    return message[:1] == b"Q" and message[5:] == b"COMMIT\x00"


def test_a_worker_whose_handler_connection_was_lost_before_commit_ends_its_transaction(
    tables: psycopg.Connection, db_url: str
) -> None:
    # The network loses the handler's connection as it sends COMMIT, after the completion:
    # the server's side stays idle in the transaction, holding the job's row. The worker
    # ends it before the failure is written, which would otherwise wait on the row.
    conn = tables
    job_id = jobd.enqueue(conn, "tx", {"order": 1})
    job = claim_one(conn, "worker-a", db_now(conn))
    name = recovery.handler_application_name(job.lease)
    with cutting_proxy(db_url) as (proxy, proxied_url):
        spec = protocol.WorkerSpec(
            worker_id="worker-a", lane=LaneConfig(LANE, concurrency=1), handlers={},
            database_url=proxied_url, schema="jobd", slot=0, generation=1, status_fd=-1,
            wake_fd=-1, shutdown_timeout=1.0)
        runner = HandlerRunner(spec, {"tx": handlers.resolved("tx", effect_handler("a"))})
        try:
            proxy.cut_before(is_commit)
            runner.start(Started(job))
            outcomes: list[Outcome] = []
            wait_until(lambda: outcomes.extend(runner.collect()) or outcomes, 10,
                       message="the run's outcome")
        finally:
            runner.close()
        assert proxy.cut.is_set()
        [outcome] = outcomes
        assert outcome.error is not None and "connection" in outcome.error
        wait_until(lambda: not alive_backend(conn, name), 10,
                   message="the server's side of the lost connection is ended")
        with connect(db_url) as worker_conn:
            worker_conn.execute("SET lock_timeout = '2s'")
            failed = queue.fail(worker_conn, [Failure(job.lease, outcome.error, 1.0, 8)])
        assert failed.retried == [job_id]
        assert effect_rows(conn) == []


# --- what one job leaves on the pooled handler connection -------------------------------------


def run_in_turn(db_url: str, funcs: dict[str, Callable[[Job, psycopg.Connection], None]],
                job_ids: list[int], conn: psycopg.Connection) -> list[Outcome]:
    """Run the jobs one after another on a runner of one slot: one pooled connection."""
    spec = protocol.WorkerSpec(
        worker_id="worker-a", lane=LaneConfig(LANE, concurrency=1), handlers={},
        database_url=db_url, schema="jobd", slot=0, generation=1, status_fd=-1,
        wake_fd=-1, shutdown_timeout=1.0)
    runner = HandlerRunner(spec, {name: handlers.resolved(name, jobd.transactional(func))
                                  for name, func in funcs.items()})
    outcomes: list[Outcome] = []
    try:
        for job_id in job_ids:
            [job] = queue.claim(conn, LANE, "worker-a", 1, VISIBILITY)
            assert job.id == job_id
            runner.start(Started(job))
            outcomes.append(runner.outcomes.get(timeout=10))
    finally:
        runner.close()
    return outcomes


def test_a_handlers_row_factory_reaches_neither_jobds_statements_nor_the_next_job(
    tables: psycopg.Connection, db_url: str
) -> None:
    # psycopg's usual idiom, conn.row_factory = dict_row, in one handler: jobd's completion
    # read its rows by position and failed the job, and the pooled connection kept the dict
    # rows for the next job of another handler, which failed the same way.
    conn = tables

    def as_dicts(job: Job, handler_conn: psycopg.Connection) -> None:
        handler_conn.row_factory = dict_row
        insert_effect(job, handler_conn, "dicts")

    def by_position(job: Job, handler_conn: psycopg.Connection) -> None:
        row = handler_conn.execute("SELECT 1").fetchone()
        assert row is not None and row[0] == 1
        insert_effect(job, handler_conn, "tuples")

    ids = [jobd.enqueue(conn, "as_dicts"), jobd.enqueue(conn, "by_position")]
    outcomes = run_in_turn(db_url, {"as_dicts": as_dicts, "by_position": by_position}, ids,
                           conn)
    assert [o.error for o in outcomes] == [None, None]
    assert [row[2] for row in effect_rows(conn)] == ["dicts", "tuples"]


def test_a_handlers_session_settings_do_not_reach_the_next_job(
    tables: psycopg.Connection, db_url: str
) -> None:
    # One handler's SET search_path sent the next job's unqualified INSERT INTO effects,
    # another handler's, to the other schema.
    conn = tables
    conn.execute("CREATE SCHEMA elsewhere")
    conn.execute("CREATE TABLE elsewhere.effects (LIKE public.effects INCLUDING ALL)")

    def moves(job: Job, handler_conn: psycopg.Connection) -> None:
        handler_conn.execute("SET search_path = elsewhere, public")
        handler_conn.execute("CREATE TEMPORARY TABLE scratch (n int)")

    def writes(job: Job, handler_conn: psycopg.Connection) -> None:
        handler_conn.execute("CREATE TEMPORARY TABLE scratch (n int)")  # gone with its job
        insert_effect(job, handler_conn, "writes")

    ids = [jobd.enqueue(conn, "moves"), jobd.enqueue(conn, "writes")]
    outcomes = run_in_turn(db_url, {"moves": moves, "writes": writes}, ids, conn)
    assert [o.error for o in outcomes] == [None, None]
    assert [row[2] for row in effect_rows(conn)] == ["writes"]  # in public.effects


def test_the_reset_between_jobs_keeps_the_connections_prepared_statements(
    tables: psycopg.Connection, db_url: str
) -> None:
    # psycopg prepares a statement run five times on a connection, and keeps its own record
    # of it. A DISCARD ALL between jobs dropped them on the server: from the sixth job on,
    # jobd's statements named prepared statements that were gone, and every job failed.
    conn = tables
    ids = [jobd.enqueue(conn, "writes") for _ in range(12)]
    outcomes = run_in_turn(db_url, {"writes": lambda job, c: insert_effect(job, c, "w")}, ids,
                           conn)
    assert [o.error for o in outcomes] == [None] * 12
    assert len(effect_rows(conn)) == 12


SLOW_FIRST_ATTEMPT = """\
import time

import jobd


@jobd.transactional
def batch(job, conn):
    # The first attempt meets a slow dependency: many short statements, each well within the
    # lane timeout (and the server's bounds on a statement and an idle spell), together far
    # past it. The retry is quick.
    for _ in range(40 if job.attempt == 1 else 1):
        conn.execute("INSERT INTO effects (key, job_id, worker) VALUES (%s, %s, %s)",
                     (job.effect_key, job.id, f"attempt {job.attempt}"))
        time.sleep(0.1)
"""


@pytest.mark.slow
def test_a_timed_out_transactional_run_ends_its_transaction_so_the_retry_is_not_blocked(
    tables: psycopg.Connection, tmp_path: Path, daemons: Callable[..., Daemon],
) -> None:
    # The timed-out run kept its transaction, and the job's effect key, for as long as its
    # handler went on issuing statements: each retry's record_effect_key waited on the key
    # until its own timeout, the job went dead after its attempts, and the worker exited
    # "wedged" by the waiting retries.
    (tmp_path / "slowfirst.py").write_text(SLOW_FIRST_ATTEMPT)
    config = make_config({LANE: {"workers": 1, "concurrency": 4, "timeout": "1s",
                                 "max_attempts": 3, "backoff": {"base": "50ms", "cap": "100ms"}}},
                         handlers={"batch": "slowfirst:batch"})
    daemon = daemons(config)
    job_id = jobd.enqueue(tables, "batch")
    wait_until(lambda: job_row(tables, job_id)["state"] in ("done", "dead"), 30, interval=0.1,
               message=lambda: f"job {job_id} to finish\n{daemon.tail()}")
    row = job_row(tables, job_id)
    assert (row["state"], row["attempts"]) == ("done", 2), row
    rows = tables.execute("SELECT worker, count(*) FROM public.effects GROUP BY worker").fetchall()
    assert rows == [("attempt 2", 1)]  # the timed-out run's writes rolled back
    daemon.wait_for_log("ended the transactions of timed-out jobs", process=f"worker {LANE}#0")


def test_a_plain_handler_that_takes_conn_is_told_it_lacks_its_decorator() -> None:
    def wants_conn(job: jobd.Job, conn: psycopg.Connection) -> None:
        """Written as a transactional handler, without @jobd.transactional."""

    def takes_nothing() -> None:
        """The wrong function named."""

    with pytest.raises(handlers.HandlerImportError,
                       match=r"needs @jobd\.transactional\)$"):
        handlers.resolved("charge", wants_conn)
    with pytest.raises(handlers.HandlerImportError) as refused:
        handlers.resolved("charge", takes_nothing)
    assert "transactional" not in str(refused.value)
