"""The retention pass's prune of idempotency keys: a sweep over the expired keys whose batches
each read what they examine, however large the backlog, and keep every key whose job is live
or dead-lettered until it no longer is."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg

import jobd
from jobd import archive, queue
from jobd.queries import query

TOP = 2**31 - 1
BATCH = 500
# The backlog: the oldest keys belong to dead-lettered jobs, the next to jobs still live, the
# rest to jobs gone from both (archived, then dropped with their partition).
DEAD, LIVE, FREE = 3000, 2000, 5000


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def fill_backlog(conn: psycopg.Connection) -> None:
    """Expired keys in created_at order: DEAD dead-lettered jobs', LIVE live jobs', then FREE
    keys of jobs gone; and recent keys of live jobs, which no sweep reaches."""
    conn.execute("""
        INSERT INTO job_keys (idempotency_key, job_id, created_at)
        SELECT 'key-' || n, n, now() - interval '30 days' + n * interval '1 second'
          FROM generate_series(1, %(expired)s::int) AS n""",
                 {"expired": DEAD + LIVE + FREE})
    conn.execute("""
        INSERT INTO job_keys (idempotency_key, job_id, created_at)
        SELECT 'recent-' || n, n, now() - interval '1 day'
          FROM generate_series(%(first)s::int, %(first)s::int + 9999) AS n""",
                 {"first": DEAD + LIVE + FREE + 1})
    conn.execute("""
        INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at, attempts,
                                 idempotency_key, created_at, errors)
        SELECT n, 'default', 'h', '{}', 0, now(), 1, 'key-' || n, now(), '[]'
          FROM generate_series(1, %(dead)s::int) AS n""", {"dead": DEAD})
    conn.execute("""
        INSERT INTO jobs (id, handler, run_at, idempotency_key)
        SELECT n, 'h', now() + interval '1 day', 'key-' || n
          FROM generate_series(%(first)s::int, %(last)s::int) AS n""",
                 {"first": DEAD + 1, "last": DEAD + LIVE})
    conn.execute("""
        INSERT INTO jobs (id, handler, run_at)
        SELECT n, 'h', now() + interval '1 day'
          FROM generate_series(%(first)s::int, %(first)s::int + 19999) AS n""",
                 {"first": DEAD + LIVE + FREE + 1})
    conn.execute("ANALYZE job_keys, jobs, dead_letter")


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def rows_read(node: dict[str, Any]) -> float:
    """The rows a plan node produced and filtered out, over all its loops (EXPLAIN gives
    both per loop)."""
    per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
    return float(per_loop * node["Actual Loops"])


def explain_batch(conn: psycopg.Connection, cutoff: datetime) -> list[dict[str, Any]]:
    """One batch of the prune, run under EXPLAIN ANALYZE: the nodes of its plan."""
    row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query("prune_job_keys"),
                       {"cutoff": cutoff, "batch": BATCH}).fetchone()
    assert row is not None
    return list(plan_nodes(row[0][0]["Plan"]))


def key_count(conn: psycopg.Connection, pattern: str) -> int:
    row = conn.execute("SELECT count(*) FROM job_keys WHERE idempotency_key LIKE %s",
                       (pattern,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_batch_reads_no_more_rows_than_it_examines_whatever_the_backlog(
    conn: psycopg.Connection,
) -> None:
    # Each batch read and sorted every expired key (and hashed dead_letter) to find the
    # few it deleted: its cost grew with the backlog, not with the batch.
    fill_backlog(conn)
    cutoff = db_now(conn) - timedelta(days=7)
    batches = 0
    while key_count(conn, "key-%") > DEAD + LIVE:
        nodes = explain_batch(conn, cutoff)
        batches += 1
        assert batches <= (DEAD + LIVE + FREE) // BATCH + 1, "the sweep is not moving on"
        for node in nodes:
            assert rows_read(node) <= BATCH, node
            assert node["Node Type"] not in ("Hash", "Hash Join"), node
            if node.get("Relation Name") in ("job_keys", "jobs", "dead_letter"):
                assert node["Node Type"] != "Seq Scan", node
    # The batches before the first free key deleted nothing, yet walked on past the keys
    # they kept; the sweep went through the backlog once.
    assert batches == (DEAD + LIVE + FREE) // BATCH
    assert key_count(conn, "recent-%") == 10000


def test_keys_of_live_and_dead_jobs_are_kept_and_a_key_passed_over_goes_once_its_job_ends(
    conn: psycopg.Connection,
) -> None:
    live = jobd.enqueue(conn, "h", priority=TOP, idempotency_key="old-live")
    dead = jobd.enqueue(conn, "h", priority=TOP, max_attempts=1, idempotency_key="old-dead")
    [job] = queue.claim(conn, "default", "w", 1, 30)
    assert job.id == live
    for n in range(5):
        jobd.enqueue(conn, "gone", idempotency_key=f"old-free-{n}")
    conn.execute("DELETE FROM jobs WHERE handler = 'gone'")
    # The live job's key first in the sweep's order, then the dead job's, then the rest.
    conn.execute("""
        UPDATE job_keys SET created_at = now() - interval '30 days'
                                       + CASE idempotency_key WHEN 'old-live' THEN interval '0'
                                                              WHEN 'old-dead' THEN interval '1s'
                                                              ELSE interval '2s' END""")
    [doomed] = queue.claim(conn, "default", "w", 1, 30)
    assert queue.fail(conn, [queue.Failure(doomed.lease, "boom", 0, 8)]).dead == [dead]
    cutoff = db_now(conn) - timedelta(days=7)

    # One batch of two keys a pass: the first passes over both kept keys.
    first, more = archive.prune_before(conn, cutoff, budget=0.0, batch=2)
    assert (first["idempotency_keys_pruned"], more) == (0, True)
    # The live job finishes while the sweep is past its key.
    assert queue.complete(conn, [job.lease]).applied == [live]
    forgotten = 0
    for _ in range(3):
        pruned, more = archive.prune_before(conn, cutoff, budget=0.0, batch=2)
        forgotten += pruned["idempotency_keys_pruned"]
    assert forgotten == 5
    keys = {key for (key,) in conn.execute("SELECT idempotency_key FROM job_keys")}
    assert keys == {"old-live", "old-dead"}, "the sweep reached the cutoff"
    # The next sweep starts at the head again and forgets the key it passed over.
    pruned, more = archive.prune_before(conn, cutoff, budget=0.0, batch=2)
    assert pruned["idempotency_keys_pruned"] == 1
    keys = {key for (key,) in conn.execute("SELECT idempotency_key FROM job_keys")}
    assert keys == {"old-dead"}
    assert jobd.enqueue(conn, "h", idempotency_key="old-dead") == dead
    assert jobd.enqueue(conn, "h", idempotency_key="old-live") != live
