"""jobd.testing as an application's own test suite uses it: the application's tables live in
the public schema (tests/testing_app.py), its code enqueues on the test's connection inside
the test's open transaction, and its handlers write unqualified table names.

``user_conn`` is the connection such a suite's conftest hands out: the database's default
search_path, not autocommit, rolled back when the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import readme_support
import testing_app
import yaml
from psycopg.rows import dict_row

import jobd
from jobd.config import Config, ScheduleConfig
from jobd.db import connect
from jobd.errors import ConfigError, JobdError
from jobd.migrate import migrate
from jobd.testing import (
    Clock,
    Fired,
    HandlerBrokeTransaction,
    JobFailed,
    RunSummary,
    assert_enqueued,
    enqueued_jobs,
    materialize_schedules,
    refute_enqueued,
    run_jobs,
)

HANDLERS = {"send_receipt": testing_app.send_receipt, "charge": testing_app.charge,
            "review_order": testing_app.review_order,
            "nightly_report": testing_app.nightly_report,
            "notify_async": testing_app.notify_async}


@pytest.fixture
def app_url(db_url: str) -> str:
    """The test database with the application's tables (committed, as its migrations would)."""
    with psycopg.connect(db_url, autocommit=True) as setup:
        testing_app.create_tables(setup)
    return db_url


@pytest.fixture
def user_conn(app_url: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(app_url) as conn:
        yield conn
        conn.rollback()


@pytest.fixture
def dict_conn(app_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A suite's connection that reads rows as dicts (``row_factory=dict_row``)."""
    with psycopg.connect(app_url, row_factory=dict_row) as conn:
        yield conn
        conn.rollback()


@pytest.fixture
def observer(app_url: str) -> Iterator[psycopg.Connection]:
    """Another connection: it sees only what committed."""
    with connect(app_url, "jobd", autocommit=True) as conn:
        yield conn


def one(conn: psycopg.Connection, statement: str, params: Any = None) -> Any:
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row[0] if len(row) == 1 else row


def db_now(conn: psycopg.Connection) -> datetime:
    return one(conn, "SELECT now()")


def session_settings(conn: psycopg.Connection) -> tuple[str, str, str]:
    return one(conn, "SELECT current_setting('search_path'), current_setting('application_name'),"
                     " current_setting('statement_timeout')")


# --- asserting what was enqueued -----------------------------------------------------------


def test_assert_enqueued_sees_the_tests_uncommitted_job_and_matches_a_payload_subset(
    user_conn: psycopg.Connection, observer: psycopg.Connection
) -> None:
    order_id = testing_app.place_order(user_conn, "a@example.com", 42)
    [job] = assert_enqueued(user_conn, "send_receipt", payload={"order": order_id})
    assert (job.payload, job.lane, job.state, job.idempotency_key) == (
        {"order": order_id, "email": "a@example.com"}, "default", "pending",
        f"receipt-{order_id}")
    assert enqueued_jobs(observer) == []  # not committed: only the test's transaction sees it
    assert_enqueued(user_conn, "send_receipt", lane="default", count=1)
    refute_enqueued(user_conn, "review_order")

    with pytest.raises(AssertionError) as missing:
        assert_enqueued(user_conn, "send_receipt", payload={"order": order_id + 1})
    # The message shows what the code did enqueue.
    assert f'"order": {order_id}' in str(missing.value)
    assert "send_receipt" in str(missing.value)
    with pytest.raises(AssertionError, match="lane 'fraud'"):
        assert_enqueued(user_conn, "send_receipt", lane="fraud")
    with pytest.raises(AssertionError, match="expected 2 job"):
        assert_enqueued(user_conn, "send_receipt", count=2)
    with pytest.raises(AssertionError, match=f"job {job.id} 'send_receipt'"):
        refute_enqueued(user_conn, "send_receipt", payload={"email": "a@example.com"})


# --- running jobs --------------------------------------------------------------------------


def test_run_jobs_runs_a_transactional_handler_inside_the_tests_transaction(
    user_conn: psycopg.Connection, observer: psycopg.Connection
) -> None:
    order_id = testing_app.place_order(user_conn, "a@example.com", 42)
    settings = session_settings(user_conn)
    summary = run_jobs(user_conn, handlers=HANDLERS)
    assert (summary.ran, summary.done, summary.errors) == (1, 1, [])
    assert one(user_conn, "SELECT receipt_sent FROM orders WHERE id = %s", (order_id,)) is True
    job_id = summary.runs[0].id
    assert one(user_conn, "SELECT state FROM jobd.all_jobs WHERE id = %s", (job_id,)) == "done"
    assert one(user_conn, "SELECT job_id FROM jobd.processed_keys WHERE idempotency_key = %s",
               (f"receipt-{order_id}",)) == job_id
    refute_enqueued(user_conn, "send_receipt")
    # The test's connection is as it was: its search_path, its name, its timeout.
    assert session_settings(user_conn) == settings

    user_conn.rollback()  # the test's end: the order, the job and its run are gone
    assert one(observer, "SELECT count(*) FROM public.orders") == 0
    assert one(observer, "SELECT count(*) FROM all_jobs") == 0


@pytest.mark.parametrize(("settings", "after_commit"), [
    # A local search_path ends with the transaction, as it would without run_jobs.
    (["SET LOCAL search_path = elsewhere, public"], None),
    # A session-level one set in the transaction stays, under a local one set after it.
    (["SET search_path = elsewhere, public"], "elsewhere, public"),
    (["SET search_path = elsewhere, public", "SET LOCAL search_path = other, public"],
     "elsewhere, public"),
])
def test_run_jobs_leaves_a_local_search_path_local_and_a_session_one_in_the_session(
    user_conn: psycopg.Connection, settings: list[str], after_commit: str | None
) -> None:
    role_default = one(user_conn, "SHOW search_path")
    for setting in settings:
        user_conn.execute(setting)
    path = one(user_conn, "SHOW search_path")
    order_id = testing_app.place_order(user_conn, "g@example.com", 1)
    assert run_jobs(user_conn, handlers=HANDLERS).done == 1
    assert one(user_conn, "SELECT receipt_sent FROM orders WHERE id = %s", (order_id,)) is True
    assert one(user_conn, "SHOW search_path") == path
    user_conn.commit()
    assert one(user_conn, "SHOW search_path") == (after_commit or role_default)


def test_run_jobs_in_a_transaction_block_of_an_autocommit_connection_keeps_set_local_local(
    app_url: str,
) -> None:
    with psycopg.connect(app_url, autocommit=True) as app:
        role_default = one(app, "SHOW search_path")
        with app.transaction():
            app.execute("SET LOCAL search_path = elsewhere, public")
            testing_app.place_order(app, "h@example.com", 1)
            assert run_jobs(app, handlers=HANDLERS).done == 1
            assert one(app, "SHOW search_path") == "elsewhere, public"
        assert one(app, "SHOW search_path") == role_default


def test_a_failing_handler_is_retried_after_its_backoff_and_dead_when_spent(
    user_conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(user_conn, "charge", {"order": 7, "declined": True}, max_attempts=2)
    clock = Clock()
    first = run_jobs(user_conn, handlers=HANDLERS, clock=clock)
    assert (first.ran, first.done, first.failed, first.dead) == (1, 0, 1, 0)
    [run] = first.runs
    assert run.error is not None and run.retry_at is not None
    assert run.error.startswith("PaymentDeclined: card of order 7 declined\n")
    assert "Traceback (most recent call last)" in run.error and "in charge" in run.error
    state, last_error, run_at = one(
        user_conn, "SELECT state, last_error, run_at FROM jobd.jobs WHERE id = %s", (job_id,))
    assert (state, last_error, run_at) == ("failed", run.error, run.retry_at)
    # The failed transactional run wrote nothing: its savepoint was rolled back.
    assert one(user_conn, "SELECT count(*) FROM calls") == 0

    # The retry is not due yet; at its run_at it is.
    assert run_jobs(user_conn, handlers=HANDLERS, clock=clock).ran == 0
    clock.advance(run.retry_at - db_now(user_conn))
    second = run_jobs(user_conn, handlers=HANDLERS, clock=clock)
    assert (second.ran, second.failed, second.dead) == (1, 0, 1)
    attempts, errors = one(user_conn, "SELECT attempts, jsonb_array_length(errors) "
                                      "FROM jobd.dead_letter WHERE id = %s", (job_id,))
    assert (attempts, errors) == (2, 2)
    refute_enqueued(user_conn, "charge")


def test_raise_errors_fails_the_test_with_the_handlers_exception_once_recorded(
    user_conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(user_conn, "charge", {"order": 8, "declined": True})
    jobd.enqueue(user_conn, "charge", {"order": 9})
    with pytest.raises(JobFailed) as raised:
        run_jobs(user_conn, handlers=HANDLERS, raise_errors=True)
    assert isinstance(raised.value.__cause__, testing_app.PaymentDeclined)
    assert "card of order 8 declined" in str(raised.value)
    assert f"job {job_id} ('charge', attempt 1) failed and will be retried:" in str(raised.value)
    assert "Traceback (most recent call last)" in str(raised.value)
    assert raised.value.run.id == job_id and raised.value.summary.ran == 1
    [job] = assert_enqueued(user_conn, "charge", payload={"order": 8})
    assert (job.state, job.attempts) == ("failed", 1)
    assert_enqueued(user_conn, "charge", payload={"order": 9})  # not run: the raise stopped it


def test_a_delayed_job_runs_once_the_clock_is_advanced_past_it(
    user_conn: psycopg.Connection,
) -> None:
    testing_app.place_order(user_conn, "big@example.com", 5000)
    [review] = assert_enqueued(user_conn, "review_order", lane="fraud")
    assert run_jobs(user_conn, "fraud", handlers=HANDLERS).ran == 0
    just_before = review.run_at - db_now(user_conn) - timedelta(seconds=1)
    clock = Clock().advance(just_before)
    assert run_jobs(user_conn, "fraud", handlers=HANDLERS, clock=clock).ran == 0
    summary = run_jobs(user_conn, "fraud", handlers=HANDLERS, clock=clock.advance(1))
    assert (summary.ran, summary.done, [r.id for r in summary.runs]) == (1, 1, [review.id])
    assert_enqueued(user_conn, "send_receipt")  # another lane: run_jobs left it alone


def test_a_handler_gets_the_jobs_times_in_utc_as_on_a_worker(
    user_conn: psycopg.Connection,
) -> None:
    user_conn.execute("SET TIME ZONE 'Pacific/Kiritimati'")  # UTC+14: even the date differs
    jobd.enqueue(user_conn, "review_order", {})
    [enqueued] = assert_enqueued(user_conn, "review_order")
    got: list[jobd.Job] = []
    assert run_jobs(user_conn, handlers={"review_order": got.append}).done == 1
    [job] = got
    times = (job.run_at, job.created_at, job.lease_until)
    assert [at.utcoffset() for at in times] == [timedelta(0)] * 3
    assert (job.run_at, job.created_at) == (enqueued.run_at, enqueued.created_at)
    assert one(user_conn, "SHOW TimeZone") == "Pacific/Kiritimati"  # the test's, untouched


def test_limit_runs_due_jobs_one_at_a_time_in_queue_order(
    user_conn: psycopg.Connection,
) -> None:
    ids = [jobd.enqueue(user_conn, "charge", {"order": n}) for n in range(3)]
    assert [r.id for r in run_jobs(user_conn, handlers=HANDLERS, limit=1).runs] == ids[:1]
    assert [r.id for r in run_jobs(user_conn, handlers=HANDLERS).runs] == ids[1:]
    assert one(user_conn, "SELECT array_agg(job_id ORDER BY id) FROM calls") == ids


def test_a_paused_lane_runs_nothing_as_on_a_worker(
    user_conn: psycopg.Connection, observer: psycopg.Connection
) -> None:
    jobd.enqueue(user_conn, "charge", {"order": 1})
    jobd.pause(observer, "default")  # an operator's pause, committed
    assert run_jobs(user_conn, handlers=HANDLERS).ran == 0
    jobd.resume(observer, "default")
    assert run_jobs(user_conn, handlers=HANDLERS).done == 1


def test_an_unknown_handler_fails_its_job_as_a_worker_would(
    user_conn: psycopg.Connection,
) -> None:
    jobd.enqueue(user_conn, "refund", {"order": 3})
    summary = run_jobs(user_conn, handlers=HANDLERS)
    assert summary.failed == 1
    assert summary.errors[0].startswith("LookupError: no handler named 'refund'")


def test_async_handlers_run_to_success_and_failure(user_conn: psycopg.Connection) -> None:
    ok = jobd.enqueue(user_conn, "notify_async", {})
    failing = jobd.enqueue(user_conn, "notify_async", {"fail": True})
    summary = run_jobs(user_conn, handlers=HANDLERS)
    assert [(r.id, r.outcome) for r in summary.runs] == [(ok, "done"), (failing, "failed")]
    assert summary.errors[0].startswith("RuntimeError: async handler failed")
    # The traceback is the handler's, as a worker stores it: nothing of how it was run.
    assert "no running event loop" not in summary.errors[0]


def test_a_cancelled_error_of_the_handlers_own_fails_its_job_as_on_a_worker(
    user_conn: psycopg.Connection,
) -> None:
    async def gives_up(job: jobd.Job) -> None:
        raise asyncio.CancelledError("the upstream call was cancelled")

    jobd.enqueue(user_conn, "gives_up", {})
    summary = run_jobs(user_conn, handlers={"gives_up": gives_up})
    assert summary.failed == 1
    assert summary.errors[0].startswith("CancelledError: the upstream call was cancelled\n")


def test_an_async_transactional_handler_is_refused(user_conn: psycopg.Connection) -> None:
    @jobd.transactional
    async def charge(job: jobd.Job, conn: psycopg.Connection) -> None:
        pass

    jobd.enqueue(user_conn, "charge", {})
    with pytest.raises(jobd.handlers.HandlerImportError, match=r"async and @jobd\.transactional"):
        run_jobs(user_conn, handlers={"charge": charge})


def test_run_jobs_works_when_called_from_async_code(user_conn: psycopg.Connection) -> None:
    jobd.enqueue(user_conn, "notify_async", {})

    async def an_async_test() -> int:
        return run_jobs(user_conn, handlers=HANDLERS).done

    assert asyncio.run(an_async_test()) == 1


def test_a_replayed_effect_key_skips_the_handler_and_says_so(
    user_conn: psycopg.Connection,
) -> None:
    first = jobd.enqueue(user_conn, "charge", {"order": 4}, idempotency_key="charge-4")
    # A second delivery of the same effect (the key ledger bypassed, as a replay would).
    user_conn.execute("DELETE FROM jobd.job_keys WHERE idempotency_key = 'charge-4'")
    second = jobd.enqueue(user_conn, "charge", {"order": 4}, idempotency_key="charge-4")
    summary = run_jobs(user_conn, handlers=HANDLERS)
    assert [(r.id, r.outcome, r.replayed) for r in summary.runs] == [
        (first, "done", False), (second, "done", True)]
    assert one(user_conn, "SELECT count(*) FROM calls") == 1


# --- a plain handler writing through the test's connection ---------------------------------
# An application's plain handler writes through the application's connection, which in its
# test suite is the test's own: a statement of the handler's that fails there aborts the
# test's transaction, the one run_jobs records the job's outcome in.

DUPLICATE = "INSERT INTO orders (id, email, total) VALUES (%s, 'i@example.com', 1)"


def importer(conn: psycopg.Connection, kind: str) -> Any:
    """``import_order``: a note in ``calls``, then the order, by the id in its payload (a
    unique violation when the order is there already)."""

    def import_order(job: jobd.Job) -> None:
        conn.execute("INSERT INTO calls (handler, job_id) VALUES ('import_order', %s)",
                     (job.id,))
        conn.execute(DUPLICATE, (job.payload["order"],))

    async def import_order_async(job: jobd.Job) -> None:
        import_order(job)

    @jobd.transactional
    def import_order_transactional(job: jobd.Job, tx: psycopg.Connection) -> None:
        import_order(job)

    return {"sync": import_order, "async": import_order_async,
            "async, from async code": import_order_async,
            "transactional": import_order_transactional}[kind]


@pytest.mark.parametrize("kind", ["sync", "async", "async, from async code", "transactional"])
def test_a_handlers_statement_that_aborts_the_tests_transaction_fails_its_job_as_on_a_worker(
    user_conn: psycopg.Connection, kind: str
) -> None:
    user_conn.execute(DUPLICATE, (1,))
    failing = jobd.enqueue(user_conn, "import_order", {"order": 1})
    later = jobd.enqueue(user_conn, "import_order", {"order": 2})
    handlers = {"import_order": importer(user_conn, kind)}

    async def an_async_test() -> RunSummary:
        return run_jobs(user_conn, handlers=handlers)

    if kind == "async, from async code":
        summary = asyncio.run(an_async_test())
    else:
        summary = run_jobs(user_conn, handlers=handlers)
    assert [(r.id, r.outcome) for r in summary.runs] == [(failing, "failed"), (later, "done")]
    run = summary.runs[0]
    # The handler's own error, as a worker records it: headline, then its traceback.
    assert isinstance(run.exception, psycopg.errors.UniqueViolation)
    assert run.error is not None and run.error.startswith(
        'UniqueViolation: duplicate key value violates unique constraint "orders_pkey"\n')
    assert "Traceback (most recent call last)" in run.error and "in import_order" in run.error
    assert one(user_conn, "SELECT state, last_error FROM jobd.jobs WHERE id = %s",
               (failing,)) == ("failed", run.error)
    # The failed run's writes are rolled back, its note too; the test's order and the next
    # job's writes stay, in the test's transaction.
    assert one(user_conn, "SELECT array_agg(job_id) FROM calls") == [later]
    assert one(user_conn, "SELECT array_agg(id ORDER BY id) FROM orders") == [1, 2]
    # A transactional handler's failure always rolls its writes back (its own savepoint);
    # a plain handler's only when its statement left no other way to record the failure.
    assert run.rolled_back == (kind != "transactional")
    assert ("its writes were rolled back" in str(summary)) == (kind != "transactional")


def test_raise_errors_raises_the_handlers_own_error_when_its_statement_aborted_the_test(
    user_conn: psycopg.Connection,
) -> None:
    user_conn.execute(DUPLICATE, (1,))
    job_id = jobd.enqueue(user_conn, "import_order", {"order": 1})
    with pytest.raises(JobFailed) as raised:
        run_jobs(user_conn, handlers={"import_order": importer(user_conn, "sync")},
                 raise_errors=True)
    assert isinstance(raised.value.__cause__, psycopg.errors.UniqueViolation)
    message = str(raised.value)
    assert message.startswith(f"job {job_id} ('import_order', attempt 1) failed and will be "
                              f"retried:\nUniqueViolation: duplicate key value violates")
    assert "Traceback (most recent call last)" in message and "in import_order" in message
    assert "aborted the test's transaction: run_jobs rolled the transaction back" in message
    # Recorded, and the test goes on in its transaction.
    [job] = assert_enqueued(user_conn, "import_order")
    assert (job.state, job.attempts) == ("failed", 1)


def test_a_plain_handler_that_fails_without_aborting_the_transaction_keeps_its_writes(
    user_conn: psycopg.Connection,
) -> None:
    # As before savepoints: on a worker the application decides what its failed handler's
    # writes become; run_jobs undoes them only when an aborted transaction leaves no choice.
    def notes_then_fails(job: jobd.Job) -> None:
        user_conn.execute("INSERT INTO calls (handler, job_id) VALUES ('notes', %s)", (job.id,))
        raise ValueError("upstream refused")

    job_id = jobd.enqueue(user_conn, "notes_then_fails", {})
    [run] = run_jobs(user_conn, handlers={"notes_then_fails": notes_then_fails}).runs
    assert (run.outcome, run.rolled_back) == ("failed", False)
    assert one(user_conn, "SELECT array_agg(job_id) FROM calls") == [job_id]


def test_a_handler_that_hides_its_aborting_statements_error_fails_the_run_not_the_job(
    user_conn: psycopg.Connection,
) -> None:
    user_conn.execute(DUPLICATE, (1,))

    def import_order(job: jobd.Job) -> None:
        with contextlib.suppress(psycopg.errors.UniqueViolation):
            importer(user_conn, "sync")(job)

    job_id = jobd.enqueue(user_conn, "import_order", {"order": 1})
    with pytest.raises(HandlerBrokeTransaction, match=(
            r"handler 'import_order' \(job \d+\) returned, but left the test's transaction "
            r"aborted: .* the job stays claimed")) as raised:
        run_jobs(user_conn, handlers={"import_order": import_order})
    assert raised.value.job.id == job_id
    # Back to before the handler's call: the test's transaction goes on, the job claimed.
    assert one(user_conn, "SELECT count(*) FROM calls") == 0
    assert one(user_conn, "SELECT state FROM jobd.jobs WHERE id = %s", (job_id,)) == "claimed"


@pytest.mark.parametrize("ending", ["rollback, then raise", "rollback, then write",
                                    "commit, then write"])
def test_a_handler_that_ends_the_tests_transaction_fails_the_run_saying_so(
    user_conn: psycopg.Connection, ending: str
) -> None:
    user_conn.execute(DUPLICATE, (1,))

    def import_order(job: jobd.Job) -> None:
        if ending == "rollback, then raise":  # an application's own error handling
            try:
                importer(user_conn, "sync")(job)
            except psycopg.Error:
                user_conn.rollback()
                raise
        (user_conn.rollback if ending.startswith("rollback") else user_conn.commit)()
        user_conn.execute("INSERT INTO calls (handler, job_id) VALUES ('ends', %s)", (job.id,))

    jobd.enqueue(user_conn, "import_order", {"order": 1})
    with pytest.raises(HandlerBrokeTransaction, match=(
            r"handler 'import_order' \(job \d+\) ended the test's transaction itself \(a "
            r"COMMIT or ROLLBACK on the test's connection\)")) as raised:
        run_jobs(user_conn, handlers={"import_order": import_order})
    if ending == "rollback, then raise":
        assert isinstance(raised.value.__cause__, psycopg.errors.UniqueViolation)
        assert "then raised UniqueViolation" in str(raised.value)


@pytest.mark.parametrize("ending", ["ROLLBACK", "COMMIT", "ROLLBACK, then write", "close"])
def test_a_transactional_handler_that_ends_the_tests_transaction_fails_the_run_saying_so(
    app_url: str, ending: str
) -> None:
    # On a worker the attempt fails (TransactionEnded). On the test's connection the
    # transaction it ended was the test's: a ROLLBACK showed as a quiet lease_lost with the
    # test's work gone, a COMMIT as a quiet failed attempt with the test's work committed,
    # and a close as "OperationalError: the connection is closed".
    @jobd.transactional
    def settle(job: jobd.Job, conn: psycopg.Connection) -> None:
        conn.execute("INSERT INTO calls (handler, job_id) VALUES ('settle', %s)", (job.id,))
        if ending == "close":
            conn.close()
        else:
            conn.execute(ending.split(",")[0])
        if ending.endswith("write"):
            conn.execute("INSERT INTO calls (handler, job_id) VALUES ('after', %s)", (job.id,))

    with psycopg.connect(app_url) as test_conn:
        test_conn.execute("INSERT INTO reports (day) VALUES ('the test''s own work')")
        job_id = jobd.enqueue(test_conn, "settle", {})
        with pytest.raises(HandlerBrokeTransaction, match=(
                rf"^transactional handler 'settle' \(job {job_id}\) "
                + (r"closed its connection \(conn.close\(\)\)" if ending == "close"
                   else r"ended its transaction itself \(a COMMIT or ROLLBACK\)")
                + r"; its connection is the test's")) as raised:
            run_jobs(test_conn, handlers={"settle": settle})
        assert raised.value.job.id == job_id
        # The worker's own verdict is the cause.
        assert isinstance(raised.value.__cause__, jobd.exactly_once.TransactionEnded)
        if not test_conn.closed:
            test_conn.rollback()


def test_a_handler_that_closes_the_tests_connection_fails_the_run_saying_so(
    app_url: str,
) -> None:
    # As application code does with `with conn:` around its work: it commits and closes.
    # Before, run_jobs went on to record the outcome and failed with psycopg's
    # "OperationalError: the connection is closed".
    with psycopg.connect(app_url) as test_conn:
        def archive(job: jobd.Job) -> None:
            with test_conn:
                test_conn.execute("INSERT INTO calls (handler, job_id) VALUES ('a', %s)",
                                  (job.id,))

        job_id = jobd.enqueue(test_conn, "archive", {})
        with pytest.raises(HandlerBrokeTransaction, match=(
                rf"^handler 'archive' \(job {job_id}\) closed the test's connection")):
            run_jobs(test_conn, handlers={"archive": archive})


class Abandon(BaseException):
    """A BaseException of an application's own, not an Exception."""


async def _abandons_async(job: jobd.Job) -> None:
    raise Abandon("given up, async")


async def _generator_exit_async(job: jobd.Job) -> None:
    raise GeneratorExit("closed by hand")


def _abandons(job: jobd.Job) -> None:
    raise Abandon("given up")


@jobd.transactional
def _abandons_transactional(job: jobd.Job, conn: psycopg.Connection) -> None:
    conn.execute("INSERT INTO calls (handler, job_id) VALUES ('abandons', %s)", (job.id,))
    raise Abandon("given up in the transaction")


@pytest.mark.parametrize(("handler", "error"), [
    (_abandons, "Abandon: given up\n"),
    (_abandons_async, "Abandon: given up, async\n"),
    (_generator_exit_async, "GeneratorExit: closed by hand\n"),
    (_abandons_transactional, "Abandon: given up in the transaction\n"),
])
def test_a_handler_that_raises_a_base_exception_fails_its_job_as_on_a_worker(
    user_conn: psycopg.Connection, handler: Any, error: str
) -> None:
    # A worker fails the job of a handler that raises any BaseException (README). run_jobs
    # let it out, the job left claimed, and the test aborted.
    job_id = jobd.enqueue(user_conn, "abandons", {})
    summary = run_jobs(user_conn, handlers={"abandons": handler})
    assert [(r.id, r.outcome) for r in summary.runs] == [(job_id, "failed")]
    assert summary.errors[0].startswith(error)
    assert one(user_conn, "SELECT state FROM jobd.jobs WHERE id = %s", (job_id,)) == "failed"
    assert one(user_conn, "SELECT count(*) FROM calls") == 0  # the transactional one's


def test_a_handlers_keyboard_interrupt_is_recorded_then_stops_the_run(
    user_conn: psycopg.Connection,
) -> None:
    # It fails the job as on a worker; then it goes on, as Ctrl-C, which it cannot be told
    # from, must still stop the test run. Before, the job was left claimed.
    def interrupted(job: jobd.Job) -> None:
        raise KeyboardInterrupt("stop")

    job_id = jobd.enqueue(user_conn, "interrupted", {})
    jobd.enqueue(user_conn, "interrupted", {})
    with pytest.raises(KeyboardInterrupt, match="stop"):
        run_jobs(user_conn, handlers={"interrupted": interrupted})
    state, last_error = one(user_conn, "SELECT state, last_error FROM jobd.jobs WHERE id = %s",
                            (job_id,))
    assert state == "failed" and last_error.startswith("KeyboardInterrupt: stop\n")
    assert len(enqueued_jobs(user_conn, "interrupted")) == 2  # the second did not run


def test_a_handler_that_commits_as_its_last_statement_still_completes_its_job(
    user_conn: psycopg.Connection, observer: psycopg.Connection
) -> None:
    # The job's claim is committed with the test's work; its completion follows in the next
    # transaction, as before run_jobs took savepoints.
    def commits(job: jobd.Job) -> None:
        user_conn.execute("INSERT INTO calls (handler, job_id) VALUES ('commits', %s)",
                          (job.id,))
        user_conn.commit()

    job_id = jobd.enqueue(user_conn, "commits", {})
    assert run_jobs(user_conn, handlers={"commits": commits}).done == 1
    user_conn.commit()
    assert one(observer, "SELECT state FROM all_jobs WHERE id = %s", (job_id,)) == "done"
    assert one(observer, "SELECT count(*) FROM public.calls") == 1


def test_run_jobs_on_a_database_url_commits_as_a_worker_does(
    app_url: str, observer: psycopg.Connection
) -> None:
    with psycopg.connect(app_url, autocommit=True) as app:
        order_id = testing_app.place_order(app, "c@example.com", 10)
    # Handlers by import path, as a config's allow-list names them.
    summary = run_jobs(app_url, handlers={"send_receipt": "testing_app:send_receipt"})
    assert (summary.ran, summary.done) == (1, 1)
    assert one(observer, "SELECT receipt_sent FROM public.orders WHERE id = %s",
               (order_id,)) is True
    state, claimed_by = one(observer, "SELECT state, claimed_by FROM all_jobs WHERE id = %s",
                            (summary.runs[0].id,))
    assert state == "done" and claimed_by.startswith("jobd.testing:")


def test_on_a_database_url_a_handlers_session_settings_end_with_its_job(
    app_url: str, observer: psycopg.Connection
) -> None:
    # As on a worker (whose handler pool resets each connection), one transactional
    # handler's SET search_path must not reach the next job on the session's connection.
    observer.execute("CREATE SCHEMA elsewhere")
    observer.execute("CREATE TABLE elsewhere.seen (path text)")
    observer.execute("CREATE TABLE public.seen (path text)")

    @jobd.transactional
    def moves(job: jobd.Job, conn: psycopg.Connection) -> None:
        conn.execute("SET search_path = elsewhere, public")

    @jobd.transactional
    def records(job: jobd.Job, conn: psycopg.Connection) -> None:
        conn.execute("INSERT INTO seen VALUES (current_setting('search_path'))")

    with psycopg.connect(app_url, autocommit=True) as app:
        jobd.enqueue(app, "moves")
        jobd.enqueue(app, "records")
    assert run_jobs(app_url, handlers={"moves": moves, "records": records}).done == 2
    assert one(observer, "SELECT path FROM public.seen") == '"$user", public'
    assert one(observer, "SELECT count(*) FROM elsewhere.seen") == 0


def test_on_an_autocommit_connection_every_run_commits(
    app_url: str, observer: psycopg.Connection
) -> None:
    with psycopg.connect(app_url, autocommit=True) as app:
        order_id = testing_app.place_order(app, "d@example.com", 10)
        settings = session_settings(app)
        assert run_jobs(app, handlers=HANDLERS).done == 1
        assert session_settings(app) == settings
    assert one(observer, "SELECT receipt_sent FROM public.orders WHERE id = %s",
               (order_id,)) is True


def test_run_jobs_takes_handlers_and_the_lanes_retry_policy_from_a_config_file(
    user_conn: psycopg.Connection, tmp_path: Path
) -> None:
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump({
        "handlers": {"charge": "testing_app:charge"},
        "lanes": {"default": {"max_attempts": 1}}}))
    job_id = jobd.enqueue(user_conn, "charge", {"order": 5, "declined": True})
    summary = run_jobs(user_conn, config=config)
    assert (summary.dead, summary.failed) == (1, 0)
    assert one(user_conn, "SELECT count(*) FROM jobd.dead_letter WHERE id = %s", (job_id,)) == 1


def test_an_async_handler_past_the_lanes_timeout_fails_as_on_a_worker(
    user_conn: psycopg.Connection, tmp_path: Path
) -> None:
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump({
        "handlers": {"sleep_async": "testing_app:sleep_async"},
        "lanes": {"default": {"timeout": "100ms"}}}))
    jobd.enqueue(user_conn, "sleep_async", {"seconds": 60})
    summary = run_jobs(user_conn, config=config)
    assert summary.errors == ["timed out after 0.1s"]


def test_an_outbox_entry_is_delivered_by_running_the_configured_outbox_lane(
    user_conn: psycopg.Connection, tmp_path: Path
) -> None:
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump({
        "handlers": {"confirm_order": "testing_app:confirm_order"},
        "lanes": {"default": {}, "mail": {}},
        "outbox": {"lane": "mail", "senders": {"mail": "testing_app:send_mail"}}}))
    sent = testing_app.SENT
    sent.clear()
    order_id = one(user_conn, "INSERT INTO orders (email, total) VALUES ('e@example.com', 10)"
                              " RETURNING id")
    job_id = jobd.enqueue(user_conn, "confirm_order", {"order": order_id})
    assert run_jobs(user_conn, config=config, raise_errors=True).done == 1
    [delivery] = assert_enqueued(user_conn, "jobd.outbox", lane="mail")
    assert sent == []  # delivered only when the outbox lane runs
    summary = run_jobs(user_conn, "mail", config=config, raise_errors=True)
    assert [run.id for run in summary.runs] == [delivery.id]
    assert sent == [(f"jobd:job:{job_id}:mail", {"order": order_id})]
    assert one(user_conn, "SELECT state FROM jobd.outbox") == "delivered"
    # The config's outbox settings were the runs' only: without it, the default lane.
    jobd.enqueue(user_conn, "confirm_order", {"order": order_id})
    run_jobs(user_conn, handlers={"confirm_order": testing_app.confirm_order})
    assert_enqueued(user_conn, "jobd.outbox", lane="outbox", count=1)


def test_an_outbox_entry_goes_to_the_schema_the_run_uses_without_a_config(
    app_url: str
) -> None:
    # Without a config, run_jobs(schema=...) ran the job in that schema but outbox.add
    # recorded the entry (and its delivery job) in the default one.
    with psycopg.connect(app_url, autocommit=True) as setup:
        migrate(setup, "shop_jobs")
    with psycopg.connect(app_url) as user_conn:
        order_id = one(user_conn, "INSERT INTO orders (email, total) VALUES"
                                  " ('e@example.com', 10) RETURNING id")
        jobd.enqueue(user_conn, "confirm_order", {"order": order_id}, schema="shop_jobs")
        summary = run_jobs(user_conn, handlers={"confirm_order": testing_app.confirm_order},
                           schema="shop_jobs", raise_errors=True)
        assert summary.done == 1
        assert one(user_conn, "SELECT count(*) FROM shop_jobs.outbox") == 1
        assert one(user_conn, "SELECT count(*) FROM jobd.outbox") == 0
        assert one(user_conn, "SELECT lane FROM shop_jobs.jobs WHERE handler = 'jobd.outbox:mail'"
                   ) == "outbox"
        user_conn.rollback()


def test_run_jobs_refuses_to_run_without_handlers(user_conn: psycopg.Connection) -> None:
    with pytest.raises(ValueError, match="needs handlers"):
        run_jobs(user_conn)


def test_run_jobs_refuses_a_lane_the_config_does_not_declare(
    user_conn: psycopg.Connection, tmp_path: Path
) -> None:
    # A typo, or a lane no node with this config serves: run with the default lane
    # settings, the job passed the test and never ran under the daemon.
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump({
        "handlers": {"charge": "testing_app:charge"},
        "lanes": {"default": {}, "payments": {"max_attempts": 1}}}))
    jobd.enqueue(user_conn, "charge", {"order": 1}, lane="payment")
    with pytest.raises(ValueError, match=r"unknown lane 'payment'; the config has: default, "
                                         r"payments"):
        run_jobs(user_conn, "payment", config=config)
    assert_enqueued(user_conn, "charge", lane="payment")  # nothing ran
    # Without a config, or with one that declares no lanes, any lane runs with the defaults.
    assert run_jobs(user_conn, "payment", handlers=HANDLERS).done == 1


@pytest.mark.parametrize("helper", ["run_jobs", "assert_enqueued", "materialize_schedules"])
def test_the_helpers_say_when_the_schema_is_not_migrated(
    user_conn: psycopg.Connection, helper: str
) -> None:
    hourly = ScheduleConfig("hourly", "0 * * * *", "nightly_report")
    calls = {
        "run_jobs": lambda: run_jobs(user_conn, handlers=HANDLERS, schema="shop_jobs"),
        "assert_enqueued": lambda: assert_enqueued(user_conn, schema="shop_jobs"),
        "materialize_schedules": lambda: materialize_schedules(user_conn, [hourly],
                                                               schema="shop_jobs"),
    }
    with pytest.raises(JobdError,
                       match=r"jobd's schema 'shop_jobs' is missing or incomplete in this "
                             r"database \(relation .* does not exist\): run `jobd migrate`"):
        calls[helper]()


# --- the clock and schedules ---------------------------------------------------------------


def test_a_schedule_fires_at_the_frozen_clock_and_its_job_runs(
    user_conn: psycopg.Connection,
) -> None:
    nightly = ScheduleConfig("nightly", "30 2 * * *", "nightly_report",
                             timezone="Europe/Berlin")
    clock = Clock(datetime(2027, 3, 1, 0, 0, tzinfo=UTC))
    assert materialize_schedules(user_conn, [nightly], clock=clock) == []
    clock.advance(timedelta(hours=1))  # 02:00 in Berlin
    assert materialize_schedules(user_conn, [nightly], clock=clock) == []
    clock.advance(timedelta(hours=1))  # 03:00 in Berlin: 02:30 has passed
    [fired] = materialize_schedules(user_conn, [nightly], clock=clock)
    assert isinstance(fired, Fired) and fired.schedule_id == "nightly"
    [job] = assert_enqueued(user_conn, "nightly_report")
    assert (job.id, job.run_at) == (fired.job_id, datetime(2027, 3, 1, 1, 30, tzinfo=UTC))
    assert materialize_schedules(user_conn, [nightly], clock=clock) == []  # once only
    assert run_jobs(user_conn, handlers=HANDLERS, clock=clock).done == 1
    assert one(user_conn, "SELECT array_agg(day) FROM reports") == ["2027-03-01"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # Stored unchecked, a schedule the tick cannot evaluate would only log an error there.
        ({"cron": "0 22-2 * * *"}, r"^schedule 'nightly': cron: invalid cron expression "
         r"'0 22-2 \* \* \*': hour range 22-2 is reversed; write 22-23,0-2$"),
        ({"cron": "every night"}, r"^schedule 'nightly': cron: invalid cron expression "),
        ({"timezone": "Mars/Olympus"},
         r"^schedule 'nightly': timezone: unknown time zone 'Mars/Olympus'"),
        ({"timezone": "localtime"}, r"^schedule 'nightly': timezone: time zone 'localtime'"),
        ({"id": "nightly report"}, r"^schedule 'nightly report': id: invalid schedule name"),
        ({"handler": "send report"}, r"^schedule 'nightly': handler: invalid handler name"),
        ({"handler": "jobd.outbox:mail"},
         r"^schedule 'nightly': handler: handler 'jobd.outbox:mail' is reserved"),
        ({"lane": ""}, r"^schedule 'nightly': lane: invalid lane name ''"),
        ({"lane": None}, r"^schedule 'nightly': lane: invalid lane name None"),
        ({"catchup": "some"}, r"^schedule 'nightly': catchup: must be one of latest, all, "
         r"none, not 'some'$"),
        ({"overlap": "queue"}, r"^schedule 'nightly': overlap: must be one of allow, skip, "
         r"not 'queue'$"),
        ({"priority": 2**31}, r"^schedule 'nightly': priority: must be an integer from"),
        ({"payload": {"ratio": float("nan")}},
         r"^schedule 'nightly': payload cannot be stored as JSON"),
        ({"payload": {"big": "x" * 2**20}}, r"^schedule 'nightly': payload is 1,048,5.. "
         r"bytes, over the limit of 1,048,576"),
        ({"catchup": "all", "overlap": "skip"},
         r"^schedule 'nightly': catchup: all and overlap: skip cannot both hold"),
    ],
)
def test_a_schedule_built_in_python_is_checked_like_one_from_a_config_file(
    user_conn: psycopg.Connection, options: dict[str, Any], message: str
) -> None:
    nightly = ScheduleConfig(**{"id": "nightly", "cron": "30 2 * * *",
                                "handler": "nightly_report", **options})
    with pytest.raises(ConfigError, match=message):
        materialize_schedules(user_conn, [nightly])
    assert one(user_conn, "SELECT count(*) FROM jobd.schedules") == 0


def test_schedules_built_in_python_keep_the_config_files_other_rules(
    user_conn: psycopg.Connection,
) -> None:
    hourly = ScheduleConfig("hourly", "0 * * * *", "nightly_report")
    with pytest.raises(ConfigError, match=r"^schedule 'hourly': id: duplicate schedule id"):
        materialize_schedules(user_conn, [hourly, hourly])
    # A Config's handlers are its schedules' allow-list, as in a file.
    config = Config(handlers={"other": "testing_app:nightly_report"}, schedules=(hourly,))
    with pytest.raises(ConfigError, match=r"^schedule 'hourly': handler: handler "
                                          r"'nightly_report' is not in handlers$"):
        materialize_schedules(user_conn, config)
    # One value rather than a list of them: said so, not "not iterable".
    with pytest.raises(TypeError, match=r"^schedules must be a list of "
                                        r"jobd.config.ScheduleConfig values, not ScheduleConfig$"):
        materialize_schedules(user_conn, hourly)  # type: ignore[arg-type]
    # Stored as a file's would be: an equal range as its one value.
    fifth = ScheduleConfig("fifth", "0 5-5 * * *", "nightly_report")
    assert materialize_schedules(user_conn, [fifth]) == []
    assert one(user_conn, "SELECT cron FROM jobd.schedules WHERE id = 'fifth'") == "0 5 * * *"


def test_catching_up_with_overlap_skip_runs_the_newest_missed_occurrence(
    user_conn: psycopg.Connection,
) -> None:
    hourly = ScheduleConfig("hourly", "0 * * * *", "nightly_report", overlap="skip")
    clock = Clock(datetime(2027, 6, 1, 8, 30, tzinfo=UTC))
    assert materialize_schedules(user_conn, [hourly], clock=clock) == []
    [fired] = materialize_schedules(user_conn, [hourly], clock=clock.advance(timedelta(hours=4)))
    assert fired.occurrence == "2027-06-01T12:00Z"
    # catchup: all would have to drop every missed occurrence but one: refused.
    every = replace(hourly, catchup="all")
    with pytest.raises(ConfigError, match=r"catchup: all with overlap: allow .* or catchup: "
                                          r"latest with overlap: skip"):
        materialize_schedules(user_conn, [every], clock=clock.advance(timedelta(hours=4)))
    assert [job.run_at for job in enqueued_jobs(user_conn, "nightly_report")] == [
        datetime(2027, 6, 1, 12, tzinfo=UTC)]


def test_schedules_from_a_config_file_fire_through_a_database_url(
    app_url: str, observer: psycopg.Connection, tmp_path: Path
) -> None:
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump({
        "handlers": {"nightly_report": "testing_app:nightly_report"},
        "schedules": [{"id": "hourly", "cron": "0 * * * *", "handler": "nightly_report"}]}))
    clock = Clock(datetime(2027, 6, 1, 9, 59, tzinfo=UTC))
    assert materialize_schedules(app_url, config, clock=clock) == []
    [fired] = materialize_schedules(app_url, config, clock=clock.advance(timedelta(hours=3)))
    # Three occurrences passed; the default catch-up (latest) fires the newest only.
    assert fired.occurrence.startswith("2027-06-01T12:00")
    assert one(observer, "SELECT run_at FROM jobs WHERE id = %s", (fired.job_id,)) == datetime(
        2027, 6, 1, 12, 0, tzinfo=UTC)
    assert run_jobs(app_url, config=config, clock=clock).done == 1
    assert one(observer, "SELECT array_agg(day) FROM public.reports") == ["2027-06-01"]


def test_the_clock_follows_the_database_until_moved_or_frozen(
    user_conn: psycopg.Connection,
) -> None:
    clock = Clock()
    assert clock.parameter(user_conn) is None  # jobd's statements read now() themselves
    assert clock.now(user_conn) == db_now(user_conn)  # one transaction: one now()
    clock.advance(timedelta(minutes=5))
    assert clock.now(user_conn) == db_now(user_conn) + timedelta(minutes=5)
    at = datetime(2030, 1, 1, tzinfo=UTC)
    assert clock.freeze(at).advance(90).now(user_conn) == at + timedelta(seconds=90)
    assert clock.reset().parameter(user_conn) is None
    with pytest.raises(ValueError, match="aware"):
        Clock(datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)


# --- a connection that reads rows as dicts ------------------------------------------------


def test_the_assertions_the_clock_and_schedules_work_on_a_connection_reading_dicts(
    dict_conn: psycopg.Connection[dict[str, Any]],
) -> None:
    job_id = jobd.enqueue(dict_conn, "send_receipt", {"order": 1})
    [job] = assert_enqueued(dict_conn, "send_receipt")
    assert (job.id, job.handler, job.payload) == (job_id, "send_receipt", {"order": 1})
    row = dict_conn.execute("SELECT now() AS now").fetchone()
    assert row is not None
    assert Clock().advance(1).now(dict_conn) == row["now"] + timedelta(seconds=1)
    clock = Clock(datetime(2027, 3, 1, 0, 0, tzinfo=UTC))
    hourly = ScheduleConfig("hourly", "0 * * * *", "nightly_report")
    assert materialize_schedules(dict_conn, [hourly], clock=clock) == []
    [fired] = materialize_schedules(dict_conn, [hourly], clock=clock.advance(3600))
    assert fired.occurrence.startswith("2027-03-01T01:00")


def test_run_jobs_works_on_a_connection_reading_dicts_and_hands_it_on_as_it_is(
    dict_conn: psycopg.Connection[dict[str, Any]], tmp_path: Path
) -> None:
    seen: list[Any] = []

    @jobd.transactional
    def count_orders(job: jobd.Job, conn: psycopg.Connection) -> None:
        seen.append(conn.execute("SELECT count(*) AS orders FROM orders").fetchone())

    def declines(job: jobd.Job) -> None:
        raise testing_app.PaymentDeclined("declined")

    jobd.enqueue(dict_conn, "count_orders", {})
    jobd.enqueue(dict_conn, "declines", {})
    summary = run_jobs(dict_conn, handlers={"count_orders": count_orders, "declines": declines})
    assert [run.outcome for run in summary.runs] == ["done", "failed"]
    assert seen == [{"orders": 0}]  # the handler's connection reads dicts, as the test's does

    # The outbox: an entry added on the connection, delivered through it.
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump({
        "handlers": {"confirm_order": "testing_app:confirm_order"},
        "lanes": {"default": {}, "mail": {}},
        "outbox": {"lane": "mail", "senders": {"mail": "testing_app:send_mail"}}}))
    testing_app.SENT.clear()
    order = dict_conn.execute("INSERT INTO orders (email, total) VALUES ('f@example.com', 1)"
                              " RETURNING id").fetchone()
    assert order is not None
    jobd.enqueue(dict_conn, "confirm_order", {"order": order["id"]})
    assert run_jobs(dict_conn, config=config, raise_errors=True).done == 1
    assert run_jobs(dict_conn, "mail", config=config, raise_errors=True).done == 1
    assert [payload for _, payload in testing_app.SENT] == [{"order": order["id"]}]


# --- the README's example ------------------------------------------------------------------


def test_the_readme_example_suite_passes(db_url: str, tmp_path: Path) -> None:
    """The README's testing section as a user's files (the application module, its conftest
    and its test module), run with pytest against a database that jobd migrated."""
    blocks = readme_support.python_blocks(readme_support.section("Testing your handlers"))
    files = {block.splitlines()[0].removeprefix("# ").split()[0]: block for block in blocks}
    assert set(files) == {"myshop.py", "conftest.py", "test_orders.py"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DATABASE_URL": db_url, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
