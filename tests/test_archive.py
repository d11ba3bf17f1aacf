"""Retention: finished jobs in daily archive partitions, dropped whole; the all_jobs view."""

from __future__ import annotations

import threading
import time
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

import jobd
from jobd import archive, queue
from jobd.db import connect
from jobd.queue import Failure

if TYPE_CHECKING:
    from conftest import Databases

TOP = 2**31 - 1


def utc_today(conn: psycopg.Connection) -> date:
    row = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
    assert row is not None
    return row[0]


def midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def partition_name(day: date) -> str:
    return f"jobs_archive_{day:%Y%m%d}"


def partitions(conn: psycopg.Connection) -> set[str]:
    rows = conn.execute("SELECT inhrelid::regclass::text FROM pg_inherits "
                        "WHERE inhparent = 'jobs_archive'::regclass").fetchall()
    return {row[0] for row in rows}


def partition_of(conn: psycopg.Connection, job_id: int) -> str:
    row = conn.execute("SELECT tableoid::regclass::text FROM jobs_archive WHERE id = %s",
                       (job_id,)).fetchone()
    assert row is not None, f"job {job_id} is not in the archive"
    return row[0]


def archive_row(conn: psycopg.Connection, finished_at: datetime) -> int:
    """A finished job written straight into the archive, as if it had finished then."""
    row = conn.execute(
        """INSERT INTO jobs_archive (id, lane, handler, payload, state, priority, run_at,
                                     attempts, claimed_by, created_at, errors, finished_at)
           VALUES (nextval('job_id_seq'), 'default', 'h', '{}', 'done', 0, %(at)s, 1, 'w',
                   %(at)s, '[]', %(at)s)
           RETURNING id""",
        {"at": finished_at},
    ).fetchone()
    assert row is not None
    return int(row[0])


def create_partition(conn: psycopg.Connection, day: date) -> None:
    conn.execute(sql.SQL(
        "CREATE TABLE {} PARTITION OF jobs_archive FOR VALUES FROM ({}) TO ({})").format(
        sql.Identifier(partition_name(day)), sql.Literal(midnight(day).isoformat()),
        sql.Literal(midnight(day + timedelta(days=1)).isoformat())))


def complete_one(conn: psycopg.Connection, key: str | None = None) -> int:
    job_id = jobd.enqueue(conn, "h", priority=TOP, idempotency_key=key)
    [job] = queue.claim(conn, "default", "w", 1, 30)
    assert job.id == job_id
    assert queue.complete(conn, [job.lease]).applied == [job_id]
    return job_id


def kill_one(conn: psycopg.Connection, key: str | None = None) -> int:
    job_id = jobd.enqueue(conn, "h", priority=TOP, max_attempts=1, idempotency_key=key)
    [job] = queue.claim(conn, "default", "w", 1, 30)
    assert queue.fail(conn, [Failure(job.lease, "boom", 0, 8)]).dead == [job_id]
    return job_id


def test_migration_creates_partitions_from_yesterday_to_a_week_ahead(
    conn: psycopg.Connection,
) -> None:
    archive.ensure_partitions(conn)  # in case the template was migrated before midnight UTC
    today = utc_today(conn)
    expected = {partition_name(today + timedelta(days=d)) for d in range(-1, 8)}
    assert expected | {"jobs_archive_default"} <= partitions(conn)
    assert archive.ensure_partitions(conn) == 0


def test_completed_jobs_land_in_todays_partition(conn: psycopg.Connection) -> None:
    ids = [complete_one(conn) for _ in range(3)]
    row = conn.execute("SELECT min(finished_at), max(finished_at) FROM jobs_archive").fetchone()
    assert row is not None
    day = row[0].astimezone(UTC).date()
    assert {partition_of(conn, job_id) for job_id in ids} == {partition_name(day)}
    assert conn.execute("SELECT count(*) FROM jobs_archive_default").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_drop_before_drops_whole_old_partitions(conn: psycopg.Connection) -> None:
    today = utc_today(conn)
    old_day = today - timedelta(days=20)
    create_partition(conn, old_day)
    in_old_partition = [archive_row(conn, midnight(old_day) + timedelta(hours=h))
                        for h in (1, 12, 23)]
    assert {partition_of(conn, i) for i in in_old_partition} == {partition_name(old_day)}
    in_default = archive_row(conn, midnight(today - timedelta(days=30)))
    assert partition_of(conn, in_default) == "jobs_archive_default"
    recent = complete_one(conn)

    assert archive.drop_before(conn, midnight(today - timedelta(days=10))) == 1
    assert partition_name(old_day) not in partitions(conn)
    assert conn.execute("SELECT to_regclass(%s)", (partition_name(old_day),)
                        ).fetchone() == (None,)
    remaining = [row[0] for row in conn.execute("SELECT id FROM jobs_archive")]
    assert remaining == [recent]
    assert partition_name(today - timedelta(days=1)) in partitions(conn)
    assert "jobs_archive_default" in partitions(conn)


def test_a_partition_is_dropped_once_its_whole_day_is_before_the_cutoff(
    conn: psycopg.Connection,
) -> None:
    archive.ensure_partitions(conn)
    today = utc_today(conn)
    yesterday = partition_name(today - timedelta(days=1))
    archive_row(conn, midnight(today) - timedelta(minutes=1))
    assert archive.drop_before(conn, midnight(today) - timedelta(microseconds=1)) == 0
    assert yesterday in partitions(conn)
    assert archive.drop_before(conn, midnight(today)) == 1
    assert yesterday not in partitions(conn)
    assert partition_name(today) in partitions(conn)
    assert conn.execute("SELECT count(*) FROM jobs_archive").fetchone() == (0,)


def test_retention_forgets_old_keys_of_finished_jobs_only(conn: psycopg.Connection) -> None:
    old_done = complete_one(conn, "old-done")
    old_dead = kill_one(conn, "old-dead")
    old_live = jobd.enqueue(conn, "h", idempotency_key="old-live")
    new_done = complete_one(conn, "new-done")
    conn.execute("UPDATE job_keys SET created_at = now() - interval '30 days' "
                 "WHERE idempotency_key LIKE 'old-%'")
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None

    pruned, more = archive.prune_before(conn, row[0] - timedelta(days=7))
    assert (pruned["idempotency_keys_pruned"], more) == (1, False)

    keys = {key for (key,) in conn.execute("SELECT idempotency_key FROM job_keys")}
    assert keys == {"old-dead", "old-live", "new-done"}
    assert jobd.enqueue(conn, "h", idempotency_key="old-live") == old_live
    assert jobd.enqueue(conn, "h", idempotency_key="old-dead") == old_dead
    assert jobd.enqueue(conn, "h", idempotency_key="new-done") == new_done
    assert jobd.enqueue(conn, "h", idempotency_key="old-done") != old_done


def test_retention_keeps_what_another_node_is_configured_to_keep(
    conn: psycopg.Connection,
) -> None:
    # A second node with a shorter archive.retention (its own config) dropped the history
    # the first node's config keeps: each pass now forgets only what every node with a row
    # would forget.
    today = utc_today(conn)
    for days in (20, 10):
        create_partition(conn, today - timedelta(days=days))
    conn.execute("INSERT INTO nodes (instance, node, pid, archive_retention)"
                 " VALUES ('keeper:1:aa', 'keeper', 1, %s)", (15 * 86400.0,))
    conn.execute("INSERT INTO nodes (instance, node, pid) VALUES ('older:2:bb', 'older', 2)")

    short = archive.apply_retention(conn, timedelta(days=7))
    assert short.partitions_dropped == 1
    assert partition_name(today - timedelta(days=20)) not in partitions(conn)
    assert partition_name(today - timedelta(days=10)) in partitions(conn)

    conn.execute("DELETE FROM nodes WHERE instance = 'keeper:1:aa'")  # gone (pruned)
    assert archive.apply_retention(conn, timedelta(days=7)).partitions_dropped == 1
    assert partition_name(today - timedelta(days=10)) not in partitions(conn)


def test_a_backlog_to_forget_goes_in_batches_that_each_commit(conn: psycopg.Connection) -> None:
    # One unbounded DELETE of every old key, in the statement that dropped the partitions:
    # a backlog past the statement timeout rolled the drops back with it every hour, for
    # good, and held the archive's lock (every completion) meanwhile.
    today = utc_today(conn)
    create_partition(conn, today - timedelta(days=20))
    conn.execute("INSERT INTO job_keys (idempotency_key, job_id, created_at)"
                 " SELECT 'old-' || n, -n, now() - interval '30 days'"
                 "   FROM generate_series(1, 2500) AS n")
    conn.execute("INSERT INTO processed_keys (idempotency_key, job_id, processed_at)"
                 " SELECT 'old-' || n, -n, now() - interval '30 days'"
                 "   FROM generate_series(1, 1500) AS n")
    conn.execute("SET statement_timeout = '10s'")
    first = archive.apply_retention(conn, timedelta(days=7), budget=0.0, batch=1000)
    # The old partition went at once, whatever was left to forget.
    assert partition_name(today - timedelta(days=20)) not in partitions(conn)
    assert (first.partitions_dropped, first.idempotency_keys_pruned, first.more) == (1, 1000, True)
    second = archive.apply_retention(conn, timedelta(days=7), budget=0.0, batch=1000)
    assert (second.idempotency_keys_pruned, second.more) == (1000, True)
    third = archive.apply_retention(conn, timedelta(days=7), budget=0.0, batch=1000)
    assert (third.idempotency_keys_pruned, third.effect_keys_pruned, third.more) == (
        500, 1000, True)
    last = archive.apply_retention(conn, timedelta(days=7), budget=0.0, batch=1000)
    assert (last.effect_keys_pruned, last.more) == (500, False)
    assert conn.execute("SELECT count(*) FROM job_keys").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM processed_keys").fetchone() == (0,)


def test_ensure_partitions_moves_rows_out_of_the_default_partition(
    conn: psycopg.Connection,
) -> None:
    archive.ensure_partitions(conn)
    today = utc_today(conn)
    day8, day9 = today + timedelta(days=8), today + timedelta(days=9)
    assert partition_name(day8) not in partitions(conn)
    early = archive_row(conn, midnight(day8))
    late = archive_row(conn, midnight(day9) - timedelta(microseconds=1))
    next_day = archive_row(conn, midnight(day9) + timedelta(hours=6))
    far = archive_row(conn, midnight(today + timedelta(days=40)))
    assert {partition_of(conn, i) for i in (early, late, next_day, far)} == {
        "jobs_archive_default"}

    assert archive.ensure_partitions(conn, days_ahead=10) == 3
    assert partition_of(conn, early) == partition_of(conn, late) == partition_name(day8)
    assert partition_of(conn, next_day) == partition_name(day9)
    assert partition_of(conn, far) == "jobs_archive_default"
    assert partition_name(today + timedelta(days=10)) in partitions(conn)
    assert archive.ensure_partitions(conn, days_ahead=10) == 0


def test_all_jobs_shows_live_archived_and_dead_jobs(conn: psycopg.Connection) -> None:
    # A job that failed once and then succeeded keeps its history in the archive.
    retried = jobd.enqueue(conn, "h", {"kind": "retried"}, priority=TOP)
    [job] = queue.claim(conn, "default", "w1", 1, 30)
    assert queue.fail(conn, [Failure(job.lease, "flaky", 0, 8)]).retried == [retried]
    [job] = queue.claim(conn, "default", "w2", 1, 30)
    assert queue.complete(conn, [job.lease]).applied == [retried]
    dead = kill_one(conn)
    failed = jobd.enqueue(conn, "h", priority=TOP)
    [job] = queue.claim(conn, "default", "w3", 1, 30)
    queue.fail(conn, [Failure(job.lease, "later", 3600, 8)])
    claimed = jobd.enqueue(conn, "h", priority=TOP)
    queue.claim(conn, "default", "w4", 1, 30)
    pending = jobd.enqueue(conn, "h")

    states = dict(conn.execute("SELECT id, state FROM all_jobs").fetchall())
    assert states == {retried: "done", dead: "dead", failed: "failed", claimed: "claimed",
                      pending: "pending"}
    row = conn.execute(
        "SELECT payload, attempts, claimed_by, errors -> 0 ->> 'error', finished_at IS NOT NULL "
        "FROM all_jobs WHERE id = %s", (retried,)).fetchone()
    assert row == ({"kind": "retried"}, 2, "w2", "flaky", True)
    finished = dict(conn.execute("SELECT id, finished_at IS NOT NULL FROM all_jobs").fetchall())
    assert finished == {retried: True, dead: True, failed: False, claimed: False, pending: False}


def wait_until_blocked(admin: psycopg.Connection, pid: int, worker: threading.Thread) -> None:
    """Until the backend ``pid`` waits for a lock (or ``worker`` is done), with a deadline."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not worker.is_alive():
            return
        row = admin.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                            (pid,)).fetchone()
        if row == ("Lock",):
            return
        time.sleep(0.02)
    raise AssertionError("the second call neither finished nor waited for a lock")


def test_two_nodes_may_top_up_partitions_at_the_same_time(databases: Databases) -> None:
    url = databases.migrated()
    errors: list[BaseException] = []
    created: list[int] = []
    with connect(url, autocommit=False) as first, connect(url) as second, connect(url) as admin:
        created.append(archive.ensure_partitions(first, days_ahead=12))

        def top_up() -> None:
            try:
                created.append(archive.ensure_partitions(second, days_ahead=12))
            except psycopg.Error as exc:
                errors.append(exc)

        worker = threading.Thread(target=top_up)
        worker.start()
        wait_until_blocked(admin, second.info.backend_pid, worker)
        first.commit()
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert errors == []
        assert sorted(created) == [0, 5]
        today = utc_today(admin)
        assert partition_name(today + timedelta(days=12)) in partitions(admin)


def test_retention_behind_a_long_reader_does_not_stall_completions(
    db_url: str, conn: psycopg.Connection
) -> None:
    archive.ensure_partitions(conn)
    job_id = jobd.enqueue(conn, "h")
    [job] = queue.claim(conn, "default", "w", 1, 300)
    outcome: list[object] = []
    with connect(db_url, autocommit=False) as reader, connect(db_url) as maintenance, \
            connect(db_url) as worker:
        # A report over the archive, still running when the hourly maintenance starts.
        reader.execute("SELECT count(*) FROM all_jobs")
        now = conn.execute("SELECT now()").fetchone()
        assert now is not None

        def retention() -> None:
            try:
                outcome.append(archive.drop_before(maintenance, now[0]))
            except psycopg.Error as exc:  # giving up on the lock is an acceptable outcome
                outcome.append(exc)

        thread = threading.Thread(target=retention)
        thread.start()
        try:
            wait_until_blocked(conn, maintenance.info.backend_pid, thread)
            worker.execute("SET lock_timeout = '3s'")
            try:
                completed = queue.complete(worker, [job.lease]).applied
            except psycopg.errors.LockNotAvailable:
                completed = []
        finally:
            reader.rollback()
            thread.join(timeout=30)
    assert completed == [job_id]


def test_retention_prunes_old_effect_keys_and_delivered_outbox_entries(
        conn: psycopg.Connection) -> None:
    conn.execute("""
        INSERT INTO processed_keys (idempotency_key, job_id, processed_at) VALUES
            ('old', 1, now() - interval '8 days'), ('recent', 2, now() - interval '6 days');
        INSERT INTO outbox (key, sender, delivery_job_id, state, created_at, delivered_at)
        VALUES ('delivered-old', 's', 1, 'delivered', now() - interval '9 days',
                now() - interval '8 days'),
               ('delivered-recent', 's', 2, 'delivered', now() - interval '9 days',
                now() - interval '6 days'),
               ('pending-old', 's', 3, 'pending', now() - interval '9 days', NULL),
               ('dead-old', 's', 4, 'dead', now() - interval '9 days', NULL)""")
    done = archive.apply_retention(conn, timedelta(days=7))
    assert (done.effect_keys_pruned, done.outbox_entries_pruned) == (1, 1)
    assert conn.execute("SELECT idempotency_key FROM processed_keys").fetchall() == [("recent",)]
    assert sorted(row[0] for row in conn.execute("SELECT key FROM outbox")) == [
        "dead-old", "delivered-recent", "pending-old"]
    again = archive.apply_retention(conn, timedelta(days=7))
    assert (again.effect_keys_pruned, again.outbox_entries_pruned) == (0, 0)
