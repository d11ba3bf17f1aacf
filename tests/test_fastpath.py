"""The worker's hot path over libpq (``jobd.fastpath`` through ``queue.settle_and_claim``):
what it returns, its transaction boundaries, and how it leaves the connection on errors."""

from __future__ import annotations

import copy as copy_module
import os
import pickle
from datetime import timedelta

import psycopg
import pytest
from psycopg import errors

import jobd
from jobd import fastpath, jobs, queue
from jobd.db import connect
from jobd.queue import ClaimRequest, Failure

LANE = "default"


def request(limit: int = 10, worker: str = "w1") -> ClaimRequest:
    return ClaimRequest(LANE, worker, limit, 30.0)


def states(conn: psycopg.Connection) -> dict[int, str]:
    return dict(conn.execute("SELECT id, state FROM all_jobs").fetchall())


def explode_on_archive(conn: psycopg.Connection, handler: str) -> None:
    """A trigger that makes completing jobs of ``handler`` fail."""
    conn.execute(f"""
        CREATE FUNCTION explode() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.handler = '{handler}' THEN RAISE EXCEPTION 'archive refused'; END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER explode BEFORE INSERT ON jobs_archive
            FOR EACH ROW EXECUTE FUNCTION explode();
    """)


def test_claimed_jobs_carry_the_rows_values(conn: psycopg.Connection) -> None:
    key = "order-17"
    job_id = jobd.enqueue(conn, "h", {"n": 1, "s": "é"}, priority=3, idempotency_key=key,
                          max_attempts=4)
    _, _, claimed = queue.settle_and_claim(conn, [], [], request())
    (job,) = claimed.jobs
    row = conn.execute(
        "SELECT id, lease_token, lane, handler, payload::text, priority, run_at, attempts,"
        " max_attempts, idempotency_key, created_at, lease_until FROM jobs WHERE id = %s",
        (job_id,)).fetchone()
    assert row is not None
    assert (job.id, job.lease_token, job.lane, job.handler, job.payload_json, job.priority,
            job.run_at, job.attempt, job.max_attempts, job.idempotency_key, job.created_at,
            job.lease_until) == row
    assert job.payload == {"n": 1, "s": "é"}
    assert job.effect_key == key
    assert job.lease_until - job.run_at > timedelta(seconds=29)


def test_settles_and_claims_in_one_call(conn: psycopg.Connection) -> None:
    ids = [jobd.enqueue(conn, "h", {"i": i}) for i in range(6)]
    done, failing, lost = queue.claim(conn, LANE, "w1", 3, 30.0)
    stale = jobs.Lease(lost.id, lost.lease_token + 1000)
    completed, failed, claimed = queue.settle_and_claim(
        conn, [done.lease, stale], [Failure(failing.lease, "boom", 60.0, 8)], request(limit=2))
    assert completed.applied == [done.id] and completed.lease_lost == [lost.id]
    assert failed.retried == [failing.id] and failing.id in failed.retry_at
    assert [job.id for job in claimed.jobs] == ids[3:5]
    assert states(conn) == {done.id: "done", failing.id: "failed", lost.id: "claimed",
                            ids[3]: "claimed", ids[4]: "claimed", ids[5]: "pending"}


def test_nothing_to_do_sends_nothing(conn: psycopg.Connection) -> None:
    assert queue.settle_and_claim(conn, [], [], None) == (
        queue.WriteOutcome([], []), queue.FailOutcome(), queue.Claimed([]))


def test_a_failing_outcome_skips_the_claim_and_leaves_the_connection_idle(
        conn: psycopg.Connection) -> None:
    explode_on_archive(conn, "bad")
    bad = jobd.enqueue(conn, "bad")
    good = jobd.enqueue(conn, "good")
    (job,) = queue.claim(conn, LANE, "w1", 1, 30.0)
    assert job.id == bad
    other = jobd.enqueue(conn, "h")
    with pytest.raises(errors.RaiseException, match="archive refused"):
        queue.settle_and_claim(conn, [job.lease], [], request())
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert states(conn) == {bad: "claimed", good: "pending", other: "pending"}
    conn.execute("DROP TRIGGER explode ON jobs_archive")
    completed, _, claimed = queue.settle_and_claim(conn, [job.lease], [], request())
    assert completed.applied == [bad]
    assert sorted(j.id for j in claimed.jobs) == [good, other]


def test_outcomes_and_claim_commit_together_unless_asked_apart(
        conn: psycopg.Connection) -> None:
    """One transaction per cycle: a claim that fails takes the outcomes with it (their
    leases make the retry safe); asked apart, the outcomes commit first and survive it."""
    jobd.enqueue(conn, "h")
    (job,) = queue.claim(conn, LANE, "w1", 1, 30.0)
    later = jobd.enqueue(conn, "h")
    with pytest.raises(errors.InvalidRowCountInLimitClause):
        queue.settle_and_claim(conn, [job.lease], [], request(limit=-1))
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert states(conn) == {job.id: "claimed", later: "pending"}
    with pytest.raises(errors.InvalidRowCountInLimitClause):
        queue.settle_and_claim(conn, [job.lease], [], request(limit=-1), separate=True)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert states(conn) == {job.id: "done", later: "pending"}


def test_one_cycle_is_one_commit(conn: psycopg.Connection) -> None:
    """The finished job's archive row and the newly claimed job's row carry the same xmin:
    one transaction, one WAL flush. Apart, they carry two."""
    for separate in (False, True):
        jobd.enqueue(conn, "h")
        (job,) = queue.claim(conn, LANE, "w1", 1, 30.0)
        jobd.enqueue(conn, "h")
        claimed = queue.settle_and_claim(conn, [job.lease], [], request(), separate=separate)[2]
        (fresh,) = claimed.jobs
        row = conn.execute(
            "SELECT (SELECT xmin::text FROM jobs_archive WHERE id = %s),"
            " (SELECT xmin::text FROM jobs WHERE id = %s)", (job.id, fresh.id)).fetchone()
        assert row is not None
        assert (row[0] == row[1]) is not separate
        queue.complete(conn, [fresh.lease])


def test_a_claim_of_its_own_commits_asynchronously_outcomes_never(
        conn: psycopg.Connection) -> None:
    """The commit each transaction of a cycle asks for, as the server sees it while the rows
    change (a trigger notes the setting): a claim alone, or apart from outcomes, does not
    wait for its WAL flush; outcomes always do, alone, apart, or with a claim that then
    waits with them. The session's own setting is left as it was."""
    for _ in range(3):
        jobd.enqueue(conn, "h")
    held = [job.lease for job in queue.claim(conn, LANE, "w1", 3, 30.0)]
    conn.execute("""
        CREATE TABLE commit_modes (n serial, what text, mode text);
        CREATE FUNCTION note_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO commit_modes (what, mode)
                 VALUES (TG_ARGV[0], current_setting('synchronous_commit'));
            RETURN NULL;
        END $$;
        CREATE TRIGGER note_claim AFTER UPDATE ON jobs
            FOR EACH STATEMENT EXECUTE FUNCTION note_commit_mode('claim');
        CREATE TRIGGER note_outcome AFTER INSERT ON jobs_archive
            FOR EACH STATEMENT EXECUTE FUNCTION note_commit_mode('outcome');
    """)

    def modes(completions: list[jobs.Lease], claim: bool, separate: bool = False
              ) -> list[tuple[str, str]]:
        conn.execute("TRUNCATE commit_modes")
        jobd.enqueue(conn, "h")
        queue.settle_and_claim(conn, completions, [], request(limit=1) if claim else None,
                               separate=separate)
        return [(what, mode) for what, mode in conn.execute(
            "SELECT what, mode FROM commit_modes ORDER BY n").fetchall()]

    assert modes([], claim=True) == [("claim", "off")]
    assert modes([held[0]], claim=False) == [("outcome", "on")]
    assert modes([held[1]], claim=True) == [("outcome", "on"), ("claim", "on")]
    assert modes([held[2]], claim=True, separate=True) == [("outcome", "on"),
                                                           ("claim", "off")]
    row = conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None and row[0] == "on"


def test_outcomes_written_alone_run_their_generic_plans(conn: psycopg.Connection) -> None:
    """Left to choose, PostgreSQL plans complete_jobs afresh for most batches of one job
    (queries.sql, outcomes_plans_generic). Written alone, a small batch's statements run the
    generic plan every time, as the session's prepared statements count them; a claim in
    the same exchange, in a transaction of its own, the session and a large batch are left
    to choose."""

    def plans(name: str) -> tuple[int, int]:
        row = conn.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                           "WHERE name = %s", (f"jobd_{name}",)).fetchone()
        assert row is not None, name
        return int(row[0]), int(row[1])

    for _ in range(8):
        jobd.enqueue(conn, "h")
        (job,) = queue.claim(conn, LANE, "w1", 1, 30.0)
        queue.settle_and_claim(conn, [job.lease], [], None)
    assert plans("complete_jobs") == (8, 0)
    jobd.enqueue(conn, "h")
    (job,) = queue.claim(conn, LANE, "w1", 1, 30.0)
    queue.settle_and_claim(conn, [job.lease], [], request(limit=1), separate=True)
    assert plans("complete_jobs") == (9, 0) and plans("claim_jobs") == (0, 1)
    row = conn.execute("SHOW plan_cache_mode").fetchone()
    assert row is not None and row[0] == "auto"
    # A large batch pays for its planning: PostgreSQL chooses (its first choices are custom).
    big = queue.GENERIC_PLANS_BELOW
    jobd.enqueue_many(conn, [jobd.JobSpec("h", {}) for _ in range(big)])
    leases = [job.lease for job in queue.claim(conn, LANE, "w1", big, 30.0)]
    queue.settle_and_claim(conn, leases, [], None)
    assert plans("complete_jobs") == (9, 1)


def test_statements_lost_by_the_session_are_prepared_again(conn: psycopg.Connection) -> None:
    first, second = jobd.enqueue(conn, "h"), jobd.enqueue(conn, "h")
    claimed = queue.settle_and_claim(conn, [], [], request(limit=1))[2]
    assert [j.id for j in claimed.jobs] == [first]
    conn.execute("DEALLOCATE ALL")
    with pytest.raises(errors.InvalidSqlStatementName):
        queue.settle_and_claim(conn, [], [], request(limit=1))
    claimed = queue.settle_and_claim(conn, [], [], request(limit=1))[2]
    assert [j.id for j in claimed.jobs] == [second]


def test_needs_an_idle_autocommit_connection(db_url: str) -> None:
    with (connect(db_url, autocommit=False) as manual,
          pytest.raises(psycopg.ProgrammingError, match="autocommit")):
        queue.settle_and_claim(manual, [], [], request())
    with (connect(db_url) as auto, auto.transaction(),
          pytest.raises(psycopg.ProgrammingError, match="idle")):
        queue.settle_and_claim(auto, [], [], request())


def test_a_broken_connection_is_closed(db_url: str, conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h")
    with connect(db_url) as victim:
        pid = victim.info.backend_pid
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            queue.settle_and_claim(victim, [], [], request())
        assert victim.closed
    assert states(conn) != {} and set(states(conn).values()) == {"pending"}


def test_commands_and_queries_return_rows_in_order(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h")
    rows = fastpath.run(conn, [
        (fastpath.BEGIN, None),
        ("get_job", {"id": job_id}),
        (fastpath.COMMIT, None),
    ])
    assert len(rows) == 3 and rows[0] == [] and rows[2] == []
    assert rows[1][0][0] == job_id


def test_a_value_the_server_cannot_take_fails_before_anything_is_sent(
        conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h")
    (job,) = queue.claim(conn, LANE, "w1", 1, 30.0)
    other = jobd.enqueue(conn, "h")
    with pytest.raises(psycopg.DataError, match="NUL"):
        queue.settle_and_claim(conn, [], [Failure(job.lease, "bad \x00 byte", 1.0, 8)],
                               request())
    assert not conn.closed
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert states(conn) == {job.id: "claimed", other: "pending"}


def test_notifications_that_arrive_with_the_results_reach_psycopg(
        db_url: str, conn: psycopg.Connection) -> None:
    heard: list[str] = []
    with connect(db_url) as listener:
        listener.add_notify_handler(lambda n: heard.append(n.payload))
        listener.execute("LISTEN fastpath_test")
        conn.execute("NOTIFY fastpath_test, 'hello'")
        queue.settle_and_claim(listener, [], [], request())
    assert heard == ["hello"]


def test_a_claimed_job_pickles_and_copies_with_its_payload(conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h", {"n": 1})
    (job,) = queue.settle_and_claim(conn, [], [], request())[2].jobs
    for copy in (pickle.loads(pickle.dumps(job)), copy_module.deepcopy(job)):
        assert copy == job and hash(copy) == hash(job) and repr(copy) == repr(job)
        assert copy.payload == {"n": 1}


def test_while_the_server_answers_the_caller_does_its_other_work(
        db_url: str, conn: psycopg.Connection) -> None:
    first, second = jobd.enqueue(conn, "h"), jobd.enqueue(conn, "h")
    held = {job.id: job for job in queue.claim(conn, LANE, "w1", 2, 30.0)}
    ready_r, ready_w = os.pipe()
    os.set_blocking(ready_r, False)
    os.write(ready_w, b"!")  # other work is waiting before the exchange starts
    calls = []
    with connect(db_url) as blocker:
        # The completion waits on this row lock until the other work releases it: the
        # exchange can only end if that work runs while the server is answering.
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (first,))

        def other_work() -> None:
            calls.append(os.read(ready_r, 16))
            blocker.execute("COMMIT")

        conn.execute("SET lock_timeout = '5s'")  # a hang fails the test instead
        completed, _, _ = queue.settle_and_claim(
            conn, [held[first].lease, held[second].lease], [], None,
            while_waiting=fastpath.WhileWaiting(ready_r, other_work))
    os.close(ready_r)
    os.close(ready_w)
    assert calls == [b"!"]
    assert sorted(completed.applied) == [first, second]
    assert states(conn) == {first: "done", second: "done"}
