"""The fast path's prepared statements are prepared again once PLAN_LIFETIME old
(jobd/fastpath.py): a plan made while the jobs table was small does not outlive the table's
growth until autovacuum next passes; and a worker's own sessions price sequential scans out,
so its plans read by index even when made on a table of one page (docs/design/queue.md,
"Plans that age")."""

from __future__ import annotations

import psycopg
import pytest

import jobd
from jobd import fastpath, queue
from jobd.db import DEFAULT_SESSION, connect, worker_session
from jobd.queue import ClaimRequest

# Ids no job has: the completion finds nothing, and only its plan matters here.
COMPLETE = ("complete_jobs", {"ids": [-3, -2, -1], "tokens": [1, 1, 1], "now": None})


def complete_plan(conn: psycopg.Connection) -> str:
    """The plan the session's prepared completion runs with, after enough runs for
    PostgreSQL to settle on its generic plan."""
    for _ in range(8):
        assert fastpath.run(conn, [COMPLETE]) == [[]]
    plan = conn.execute("EXPLAIN EXECUTE jobd_complete_jobs('{-3,-2,-1}', '{1,1,1}', NULL)")
    return "\n".join(line for (line,) in plan.fetchall())


@pytest.fixture
def small_jobs_table(conn: psycopg.Connection) -> psycopg.Connection:
    # No autovacuum: nothing invalidates the plans while the table grows.
    conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = false)")
    jobd.enqueue(conn, "h")
    conn.execute("ANALYZE jobs")
    return conn


def test_a_plan_made_on_a_small_table_is_made_again_once_it_has_grown(
    small_jobs_table: psycopg.Connection,
) -> None:
    conn = small_jobs_table
    assert "Seq Scan on jobs" in complete_plan(conn)  # one row: its page beats the index
    jobd.enqueue_many(conn, [jobd.JobSpec("h")] * 20_000)
    # Nothing invalidated the plan: it reads the grown table whole.
    assert "Seq Scan on jobs" in complete_plan(conn)
    fastpath._sessions[conn.pgconn].since -= fastpath.PLAN_LIFETIME  # the lifetime is over
    plan = complete_plan(conn)
    assert "Seq Scan on jobs" not in plan and "jobs_pkey" in plan, plan


def test_statements_are_prepared_again_when_the_lifetime_is_over(
    conn: psycopg.Connection,
) -> None:
    fastpath.run(conn, [COMPLETE])
    prepared = "SELECT count(*) FROM pg_prepared_statements WHERE name = 'jobd_complete_jobs'"
    assert conn.execute(prepared).fetchone() == (1,)
    session = fastpath._sessions[conn.pgconn]
    since = session.since
    fastpath.run(conn, [COMPLETE])
    assert session.since == since  # still young: kept
    session.since -= fastpath.PLAN_LIFETIME
    fastpath.run(conn, [COMPLETE])  # deallocated, prepared again, run: one exchange
    assert session.since > since
    assert session.names == {b"jobd_complete_jobs"}
    assert conn.execute(prepared).fetchone() == (1,)


def test_an_exchange_that_fails_after_the_renewal_leaves_the_session_usable(
    conn: psycopg.Connection, db_url: str,
) -> None:
    jobd.enqueue(conn, "h")
    [job] = queue.settle_and_claim(conn, [], [], ClaimRequest("default", "w1", 1, 30.0))[2].jobs
    fastpath.run(conn, [COMPLETE])
    session = fastpath._sessions[conn.pgconn]
    session.since -= fastpath.PLAN_LIFETIME
    conn.execute("SET lock_timeout = '50ms'")
    complete = ("complete_jobs", {"ids": [job.id], "tokens": [job.lease.token], "now": None})
    with connect(db_url, autocommit=False) as holder:
        holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (job.id,))
        # The statements were deallocated; the completion waits for the row and fails.
        with pytest.raises(psycopg.errors.LockNotAvailable):
            fastpath.run(conn, [complete])
    conn.execute("RESET lock_timeout")
    # Prepared again in the next exchange, whatever the failed one left prepared.
    assert fastpath.run(conn, [complete]) == [[(job.id, "done")]]
    assert conn.execute("SELECT count(*) FROM pg_prepared_statements"
                        " WHERE name = 'jobd_complete_jobs'").fetchone() == (1,)


def test_a_workers_session_reads_a_batch_by_id_even_on_a_table_of_one_page(
    small_jobs_table: psycopg.Connection, db_url: str,
) -> None:
    with connect(db_url, "jobd", session=worker_session(DEFAULT_SESSION)) as worker_conn:
        plan = complete_plan(worker_conn)  # prepared while the table holds one row
        assert "Seq Scan on jobs" not in plan and "jobs_pkey" in plan, plan
        jobd.enqueue_many(small_jobs_table, [jobd.JobSpec("h")] * 20_000)
        plan = complete_plan(worker_conn)
        assert "Seq Scan on jobs" not in plan and "jobs_pkey" in plan, plan
        assert worker_conn.execute("SHOW enable_seqscan").fetchone() == ("off",)
