"""The invariant checks themselves: quiet on a history the queue functions wrote, and each
one speaks up when its rule is broken by hand, so a fault test's clean bill means something."""

from __future__ import annotations

import psycopg
import pytest
from invariants import Effects, check

import jobd
from jobd import queue
from jobd.queue import Failure

EFFECTS = Effects(table="public.fuzz_effects", handler="effect")


@pytest.fixture
def history(conn: psycopg.Connection) -> list[int]:
    """Jobs that ran through the real queue functions: one done at once, one done after two
    failures, one dead after its budget of two, each done one with its effect."""
    conn.execute("CREATE TABLE public.fuzz_effects (key text NOT NULL)")
    ids = jobd.enqueue_many(conn, [
        jobd.JobSpec("effect", {}), jobd.JobSpec("effect", {}, idempotency_key="k"),
        jobd.JobSpec("other", {}, max_attempts=2)])
    for _round in range(3):
        for job in queue.claim(conn, "default", "w", 10, 30):
            if job.handler == "effect" and (job.id == ids[0] or job.attempt == 3):
                conn.execute("INSERT INTO public.fuzz_effects (key) VALUES (%s)",
                             (job.effect_key,))
                conn.execute("INSERT INTO jobd.processed_keys (idempotency_key, job_id)"
                             " VALUES (%s, %s)", (job.effect_key, job.id))
                queue.complete(conn, [job.lease])
            else:
                queue.fail(conn, [Failure(job.lease, f"boom {job.attempt}", 0, 8)])
    return ids


def problems(conn: psycopg.Connection, ids: list[int], **kwargs: object) -> str:
    return "\n".join(check(conn, ids, effects=EFFECTS, **kwargs))  # type: ignore[arg-type]


def test_a_history_written_by_the_queue_functions_passes(
    conn: psycopg.Connection, history: list[int]
) -> None:
    states = dict(conn.execute("SELECT id, state FROM jobd.all_jobs").fetchall())
    assert [states[i] for i in history] == ["done", "done", "dead"]
    assert problems(conn, history) == ""


def test_a_lost_or_unfinished_or_doubled_job_is_reported(
    conn: psycopg.Connection, history: list[int]
) -> None:
    assert "lost: 1 jobs" in problems(conn, [*history, 10**9])
    pending = jobd.enqueue(conn, "other", {})
    assert "unfinished: 1 jobs" in problems(conn, [*history, pending])
    assert problems(conn, [*history, pending], settled=False) == ""
    conn.execute("INSERT INTO jobd.dead_letter SELECT id, lane, handler, payload, priority,"
                 " run_at, attempts, max_attempts, claimed_by, idempotency_key, created_at,"
                 " last_error, errors, now() FROM jobd.jobs_archive WHERE id = %s",
                 (history[0],))
    assert "duplicated: 1 jobs" in problems(conn, history)


def test_a_job_stuck_in_claimed_past_its_lease_is_reported(
    conn: psycopg.Connection, history: list[int]
) -> None:
    job_id = jobd.enqueue(conn, "other", {})
    queue.claim(conn, "default", "w-gone", 1, 30)
    assert problems(conn, [*history, job_id], settled=False) == ""
    conn.execute("UPDATE jobd.jobs SET lease_until = now() - interval '1 hour'")
    assert "stuck in claimed" in problems(conn, [*history, job_id], settled=False)


def test_attempts_that_disagree_with_the_error_history_are_reported(
    conn: psycopg.Connection, history: list[int]
) -> None:
    conn.execute("UPDATE jobd.jobs_archive SET attempts = attempts + 1 WHERE id = %s",
                 (history[1],))
    assert f"job {history[1]} (done, 4 attempts)" in problems(conn, history)


def test_a_second_effect_or_a_missing_processed_key_is_reported(
    conn: psycopg.Connection, history: list[int]
) -> None:
    conn.execute("INSERT INTO public.fuzz_effects (key) VALUES ('k')")
    assert "2 effects, expected 1" in problems(conn, history)
    conn.execute("DELETE FROM public.fuzz_effects WHERE key = 'k'")
    conn.execute("DELETE FROM jobd.processed_keys WHERE idempotency_key = 'k'")
    report = problems(conn, history)
    assert "0 effects, expected 1" in report and "processed key recorded = False" in report


def test_an_inconsistent_schedule_ledger_is_reported(
    conn: psycopg.Connection, history: list[int]
) -> None:
    conn.execute("INSERT INTO jobd.schedules (id, cron, handler) VALUES ('s', '* * * * *',"
                 " 'effect')")
    conn.execute("INSERT INTO jobd.schedule_fires (schedule_id, occurrence, fire_at, outcome,"
                 " job_id) VALUES ('s', 'o1', now() - interval '1 minute', 'enqueued', %s)",
                 (history[0],))
    assert "fires whose job does not match" in problems(conn, history)
    conn.execute("DELETE FROM jobd.schedule_fires")
    conn.execute("SELECT jobd.enqueue('effect', '{}', idempotency_key => 'x')")
    conn.execute("UPDATE jobd.jobs SET idempotency_key = 'jobd:schedule:s:o2'")
    assert "schedule jobs without a fire" in problems(conn, history)
    conn.execute("DELETE FROM jobd.jobs")
    conn.execute("INSERT INTO jobd.schedule_fires (schedule_id, occurrence, fire_at, outcome)"
                 " VALUES ('s', 'o3', now() + interval '1 hour', 'skipped_overlap')")
    assert "fired before they were due" in problems(conn, history)
