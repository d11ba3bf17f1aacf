"""Lane controls against a real PostgreSQL, without daemons: pauses and what the claim makes
of them, cancelling jobs in every state and every way a run can end, quarantine and replay
by handler. (With daemons: tests/test_controls_daemon.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from notify_support import sent_so_far
from psycopg.rows import dict_row

import jobd
from jobd import dlq, exactly_once, pauses, queue, recovery, views
from jobd.backoff import Backoff, RetryPolicy
from jobd.claim_floors import full_scan_params
from jobd.db import connect
from jobd.duties.crash_attribution import Attribution, CrashAttribution
from jobd.queries import query
from jobd.queue import Failure
from jobd.wake_routing import WakeRouter

LANE = "default"


def policy(max_attempts: int = 8) -> recovery.PolicyLookup:
    return lambda _lane: RetryPolicy(Backoff(1.0, 300.0), max_attempts)


def state_of(conn: psycopg.Connection, job_id: int) -> str:
    row = conn.execute("SELECT state FROM all_jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None, f"job {job_id} is nowhere"
    return str(row[0])


def claimed_handlers(conn: psycopg.Connection, lane: str = LANE, limit: int = 100) -> list[str]:
    return sorted(job.handler for job in queue.claim(conn, lane, "w1", limit, 30))


@pytest.fixture
def listener(db_url: str) -> Iterator[psycopg.Connection]:
    with connect(db_url) as conn:
        conn.execute("LISTEN jobd_wakeup")
        yield conn


# --- pauses --------------------------------------------------------------------------------


def test_a_paused_lane_claims_nothing_until_it_is_resumed(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    for handler in ("a", "b"):
        jobd.enqueue(conn, handler)
    jobd.enqueue(conn, "a", lane="other")
    assert pauses.pause(conn, LANE) is True
    assert sent_so_far(listener) == [f"{LANE}!pause"]
    assert pauses.pause(conn, LANE) is False  # already: nothing changes, nobody is told
    assert sent_so_far(listener) == []
    assert claimed_handlers(conn) == []
    assert claimed_handlers(conn, "other") == ["a"]  # other lanes are not affected
    assert pauses.resume(conn, LANE) is True
    assert sent_so_far(listener) == [f"{LANE}!pause"]
    assert pauses.resume(conn, LANE) is False
    assert claimed_handlers(conn) == ["a", "b"]


def test_a_paused_handler_is_stepped_over_and_the_rest_of_the_lane_runs(
    conn: psycopg.Connection,
) -> None:
    for handler in ("poison", "fine", "poison", "fine"):
        jobd.enqueue(conn, handler)
    pauses.pause(conn, LANE, "poison")
    assert claimed_handlers(conn) == ["fine", "fine"]
    # Resuming the lane's own pause does not end a handler's.
    assert pauses.resume(conn, LANE) is False
    assert claimed_handlers(conn) == []
    assert pauses.resume(conn, LANE, "poison") is True
    assert claimed_handlers(conn) == ["poison", "poison"]


def test_pauses_are_rows_anyone_can_write_from_sql(conn: psycopg.Connection) -> None:
    conn.execute("SELECT jobd.pause('default'), jobd.pause('default', handler => 'h')")
    [lane_pause, handler_pause] = pauses.pauses(conn)
    assert (lane_pause.lane, lane_pause.handler, handler_pause.handler) == (LANE, None, "h")
    assert lane_pause.paused_by == conn.info.user
    assert pauses.lane_controls(conn, LANE) == (True, frozenset({"h"}))
    assert pauses.lane_controls(conn, "other") == (False, frozenset())
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="invalid lane name"):
        conn.execute("SELECT jobd.pause('no spaces')")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="invalid handler name"):
        conn.execute("SELECT jobd.resume('default', '')")
    with pytest.raises(ValueError, match="invalid lane name"):
        pauses.pause(conn, "a/b")


def test_a_paused_lane_does_not_arm_and_a_paused_handler_is_not_work(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue(conn, "poison")
    pauses.pause(conn, LANE, "poison")
    # Its due job is no reason to stay awake: the worker arms.
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    pauses.pause(conn, LANE)
    assert queue.arm(conn, LANE, "w2", full_scan_params()) == "paused"
    armed = conn.execute("SELECT worker_id FROM lane_waiters ORDER BY 1").fetchall()
    assert armed == [("w1",)]


def test_a_paused_handlers_suspect_waits_too(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "poison")
    conn.execute("UPDATE jobs SET suspect = true WHERE id = %s", (job_id,))
    pauses.pause(conn, LANE, "poison")
    request = queue.ClaimRequest(LANE, "w1", 10, 30, suspect_first=True,
                                 floors=full_scan_params())
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], request)
    assert claimed.suspect is None and claimed.jobs == []
    pauses.resume(conn, LANE, "poison")
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], request)
    assert claimed.suspect is not None and claimed.suspect.id == job_id


def test_the_fallback_poll_sees_no_due_work_in_a_paused_lane_and_names_its_pauses(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue(conn, "h")

    def poll() -> dict[str, tuple[bool, str]]:
        rows = conn.execute(query("lane_heads"),
                            {"lanes": [LANE, "other"], "now": None,
                             "look_back": None}).fetchall()
        return {lane: (head is not None, names) for lane, head, _now, _s, names in rows}

    assert poll() == {LANE: (True, ""), "other": (False, "")}
    pauses.pause(conn, LANE, "h")
    assert poll() == {LANE: (True, "h"), "other": (False, "")}
    pauses.pause(conn, LANE)
    assert poll() == {LANE: (False, "*,h"), "other": (False, "")}


def test_the_fallback_poll_does_not_send_workers_after_a_paused_handlers_suspect(
    conn: psycopg.Connection,
) -> None:
    # Told of suspects, every worker of the lane gives back its buffer and empties its slots
    # to claim one alone; a paused handler's suspect it may not claim (claim_suspect), so the
    # lane ran in waves, told again at every poll.
    suspect = jobd.enqueue(conn, "poison")
    jobd.enqueue(conn, "h")
    conn.execute("UPDATE jobs SET suspect = true WHERE id = %s", (suspect,))

    def suspects_due() -> bool:
        [row] = conn.execute(query("lane_heads"), {"lanes": [LANE], "now": None,
                                                   "look_back": None}).fetchall()
        return bool(row[3])

    assert suspects_due()
    pauses.pause(conn, LANE, "poison")
    assert not suspects_due()
    pauses.resume(conn, LANE, "poison")
    assert suspects_due()


# --- cancel --------------------------------------------------------------------------------


def test_pending_and_failed_jobs_are_cancelled_at_once(conn: psycopg.Connection) -> None:
    later = jobd.enqueue(conn, "h", delay=3600)
    failing = jobd.enqueue(conn, "h", idempotency_key="k")
    [job] = queue.claim(conn, LANE, "w1", 10, 30)
    queue.fail(conn, [Failure(job.lease, "boom", 60.0, 8)])
    assert state_of(conn, failing) == "failed"
    result = jobd.cancel(conn, [later, failing, later])
    assert (result.cancelled, result.requested, result.unknown) == ([later, failing], [], [])
    assert (state_of(conn, later), state_of(conn, failing)) == ("cancelled", "cancelled")
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    row = conn.execute("SELECT last_error, errors->-1 ? 'cancelled_at', finished_at IS NOT NULL"
                       " FROM jobs_archive WHERE id = %s", (failing,)).fetchone()
    assert row == ("boom", True, True)
    # Its key still names it: enqueueing it again gives the cancelled job.
    assert jobd.enqueue(conn, "h", idempotency_key="k") == failing
    # Cancelling again changes nothing.
    assert jobd.cancel(conn, [failing, 999_999]).as_dict() == {
        "cancelled": [], "requested": [], "finished": {failing: "cancelled"},
        "unknown": [999_999]}


def test_finished_jobs_are_left_as_they_are(conn: psycopg.Connection) -> None:
    done, dead = jobd.enqueue(conn, "h"), jobd.enqueue(conn, "h", max_attempts=1)
    jobs = {job.id: job for job in queue.claim(conn, LANE, "w1", 10, 30)}
    queue.complete(conn, [jobs[done].lease])
    queue.fail(conn, [Failure(jobs[dead].lease, "boom", 1.0, 8)])
    assert jobd.cancel(conn, [done, dead]).finished == {done: "done", dead: "dead"}
    assert (state_of(conn, done), state_of(conn, dead)) == ("done", "dead")


def test_a_running_job_is_asked_to_stop_and_archived_cancelled_whatever_it_returns(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    ok_id, failing_id, swept_id = (jobd.enqueue(conn, "h") for _ in range(3))
    jobs = {job.id: job for job in queue.claim(conn, LANE, "w1", 10, 30)}
    result = jobd.cancel(conn, [ok_id, failing_id, swept_id])
    assert sorted(result.requested) == [ok_id, failing_id, swept_id]
    assert sent_so_far(listener) == [f"{LANE}!cancel"]  # its workers renew at once
    row = conn.execute("SELECT state, cancel_requested_at IS NOT NULL FROM all_jobs"
                       " WHERE id = %s", (ok_id,)).fetchone()
    assert row == ("claimed", True)
    # The worker learns it from its next renewal.
    renewed = queue.heartbeat(conn, [j.lease for j in jobs.values()], 30)
    assert sorted(renewed.cancelled) == [ok_id, failing_id, swept_id]
    # A release (a drain) does not put it back in the queue.
    assert queue.release(conn, [jobs[swept_id].lease]).applied == []
    # However the run ends, it is cancelled: a success...
    completed = queue.complete(conn, [jobs[ok_id].lease])
    assert completed.applied == completed.cancelled == [ok_id]
    # ... a failure with budget left, not retried ...
    failed = queue.fail(conn, [Failure(jobs[failing_id].lease, "CancelledError", 1.0, 8)])
    assert (failed.cancelled, failed.retried) == ([failing_id], [])
    # ... or a lease that expired.
    future = conn.execute("SELECT now() + interval '1 hour'").fetchone()
    assert future is not None
    swept = recovery.expire_leases(conn, policy(), now=future[0])
    assert swept.cancelled == [swept_id]
    archived = dict(conn.execute("SELECT id, last_error FROM jobs_archive"
                                 " WHERE state = 'cancelled'").fetchall())
    assert archived == {ok_id: None, failing_id: "CancelledError",
                        swept_id: "lease expired (held by w1)"}


def test_a_cancel_waits_for_a_completion_in_flight_and_finds_the_job_done(
    db_url: str, conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "h")
    [job] = queue.claim(conn, LANE, "w1", 10, 30)
    with connect(db_url, autocommit=False) as worker:
        queue.complete(worker, [job.lease])  # not committed yet: the row is locked
        with connect(db_url, autocommit=False) as operator:
            operator.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                jobd.cancel(operator, [job_id])
        worker.commit()
    assert jobd.cancel(conn, [job_id]).finished == {job_id: "done"}


def test_a_transactional_handler_that_commits_after_a_cancel_is_archived_cancelled(
    db_url: str, conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "h")
    [job] = queue.claim(conn, LANE, "w1", 1, 30)
    jobd.cancel(conn, [job_id])
    # Its effect commits with the completion, as always; the job is recorded cancelled.
    with psycopg.connect(db_url, autocommit=True) as handler_conn:
        result = exactly_once.run_transactional(
            handler_conn, job, lambda _job, c: c.execute("CREATE TABLE public.effect ()"))
        assert result == "cancelled"
    assert state_of(conn, job_id) == "cancelled"
    assert conn.execute("SELECT to_regclass('public.effect') IS NOT NULL").fetchone() == (
        True,)


def test_crash_attribution_cancels_what_was_asked_to_stop(conn: psycopg.Connection) -> None:
    stop_id, other_id = jobd.enqueue(conn, "h"), jobd.enqueue(conn, "h")
    queue.claim(conn, LANE, "w1", 10, 30)
    jobd.cancel(conn, [stop_id])
    outcome = recovery.settle_crashed_worker(conn, "w1", "worker died", policy())
    # Holding two, the worker gives its innocent job its attempt back as a suspect; the
    # cancelled one is not run again.
    assert (outcome.suspects, outcome.failed.cancelled) == ([other_id], [stop_id])
    assert (state_of(conn, stop_id), state_of(conn, other_id)) == ("cancelled", "pending")


def test_cancelled_jobs_are_visible_in_all_jobs_and_listings(conn: psycopg.Connection) -> None:
    job_id = jobd.enqueue(conn, "h", delay=60)
    jobd.cancel(conn, [job_id])
    listed = views.list_jobs(conn, state="cancelled")
    assert [row["id"] for row in listed] == [job_id]


def test_the_archive_refuses_states_other_than_done_and_cancelled(
    conn: psycopg.Connection,
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("INSERT INTO jobs_archive (id, lane, handler, payload, state, priority,"
                     " run_at, attempts, created_at, errors, finished_at) VALUES"
                     " (1, 'l', 'h', '{}', 'dead', 0, now(), 1, now(), '[]', now())")


# --- quarantine ----------------------------------------------------------------------------


def test_quarantine_moves_a_handlers_pending_and_failed_jobs_in_one_statement(
    conn: psycopg.Connection,
) -> None:
    bad = [jobd.enqueue(conn, "poison", {"customer": 7, "n": n}) for n in range(3)]
    later = jobd.enqueue(conn, "poison", {"customer": 7}, lane="bulk", delay=3600)
    good = jobd.enqueue(conn, "poison", {"customer": 8})
    other = jobd.enqueue(conn, "fine", {"customer": 7})
    running = jobd.enqueue(conn, "poison", {"customer": 7}, lane="slow")
    queue.claim(conn, "slow", "w1", 10, 30)
    [first] = [j for j in queue.claim(conn, LANE, "w1", 1, 30)]
    queue.fail(conn, [Failure(first.lease, "boom", 60.0, 8)])  # failed, waiting: moved too
    moved = dlq.quarantine(conn, "poison", payload_match={"customer": 7})
    assert moved == {LANE: 3, "bulk": 1}
    dead = dict(conn.execute("SELECT id, last_error FROM dead_letter").fetchall())
    assert sorted(dead) == sorted([*bad, later])
    assert all("quarantined" in error and "customer" in error for error in dead.values())
    assert {state_of(conn, good), state_of(conn, other), state_of(conn, running)} == {
        "pending", "claimed"}
    assert state_of(conn, running) == "claimed"  # left to finish
    # One lane only, no payload filter.
    assert dlq.quarantine(conn, "poison", LANE) == {LANE: 1}
    assert state_of(conn, good) == "dead"


def test_replay_by_handler_brings_them_back_due_at_their_own_time(
    conn: psycopg.Connection,
) -> None:
    now_id = jobd.enqueue(conn, "poison")
    later_id = jobd.enqueue(conn, "poison", delay=3600)
    other_lane = jobd.enqueue(conn, "poison", lane="bulk")
    dlq.quarantine(conn, "poison")
    assert dlq.replay_handler(conn, "poison", LANE) == [now_id, later_id]
    rows = dict(conn.execute("SELECT id, run_at > now() + interval '59 minutes' FROM jobs"
                             " WHERE attempts = 0").fetchall())
    assert rows == {now_id: False, later_id: True}
    assert state_of(conn, other_lane) == "dead"
    assert dlq.replay_handler(conn, "poison") == [other_lane]
    assert dlq.replay_handler(conn, "poison") == []
    history = conn.execute("SELECT errors FROM jobs WHERE id = %s", (now_id,)).fetchone()
    assert history is not None
    assert [sorted(entry) for entry in history[0]] == [["quarantined_at", "reason"],
                                                       ["replayed_at"]]


def test_quarantine_checks_its_arguments(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="handler must not be NULL"):
        conn.execute("SELECT * FROM jobd.quarantine(NULL)")
    with pytest.raises(ValueError, match="invalid handler name"):
        dlq.quarantine(conn, "bad name")
    assert conn.execute("SELECT * FROM jobd.quarantine('h', lane => 'x')").fetchall() == []


def test_the_claim_skips_paused_work_inside_one_statement_at_any_time(
    conn: psycopg.Connection,
) -> None:
    # A claim for a moment an hour ahead sees the same pauses (they are not time-bound).
    jobd.enqueue(conn, "poison", delay=60)
    pauses.pause(conn, LANE, "poison")
    later = conn.execute("SELECT now() + %s", (timedelta(hours=1),)).fetchone()
    assert later is not None
    assert queue.claim(conn, LANE, "w1", 10, 30, now=later[0]) == []


def test_a_stopped_workers_cancelled_job_is_ended_not_given_back(
    conn: psycopg.Connection,
) -> None:
    stop_id, other_id = jobd.enqueue(conn, "h"), jobd.enqueue(conn, "h")
    queue.claim(conn, LANE, "w1", 10, 30)
    jobd.cancel(conn, [stop_id])
    duty = CrashAttribution(policy(), WakeRouter(), lambda: [LANE])
    duty.add(Attribution("w1", LANE, "worker w1 exited", release=True))
    duty.run(conn, 0.0)
    assert (state_of(conn, stop_id), state_of(conn, other_id)) == ("cancelled", "pending")


def test_the_python_api_works_on_a_users_own_connection(db_url: str) -> None:
    """An application's connection: the default search_path (no jobd on it) and dict rows."""
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as app:
        job_id = jobd.enqueue(app, "h", {"n": 1})
        assert jobd.enqueue_many(app, [jobd.JobSpec("h", idempotency_key="k")])
        assert jobd.pause(app, "default", "h") is True
        assert jobd.resume(app, "default", "h") is True
        assert jobd.cancel(app, [job_id]).cancelled == [job_id]
