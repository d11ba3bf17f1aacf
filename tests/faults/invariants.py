"""The SQL invariants every fault test ends with.

Whatever was done to the daemons, the server or the clocks, the database must still tell a
consistent story:

- nothing lost: every job the test enqueued is in exactly one place (jobs, jobs_archive or
  dead_letter), and, once the test has let everything finish, none is left in the queue;
- nothing stuck: no job stays 'claimed' past its lease (the sweep must have taken it back);
- attempts match the error history: each failed attempt left one entry, numbered 1, 2, ...,
  so a job's attempt counter equals its failures (plus the running or finishing attempt);
- the schedule ledger is consistent: every 'enqueued' fire names a job whose key (and,
  until a retry moves it, run_at) match the occurrence, no job is named twice, no schedule
  job exists without its fire, and nothing was fired before it was due by the database
  clock;
- exactly one effect per transactional job: a finished job has one effect row and one
  processed key, an unfinished one none.

:func:`check` collects every violation as a line of text; :func:`assert_invariants` fails
with all of them at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

# How long past its lease a claimed job may still be claimed: the sweep runs every duty
# interval, and the fault tests' duty intervals are at most a few seconds.
STUCK_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class Effects:
    """Where the transactional handlers write their effect rows: ``table`` has a column
    ``key`` holding the job's effect key (its idempotency key, else ``jobd:job:<id>``)."""

    table: str = "public.soak_effects"
    handler: str = "effect"


def _rows(conn: psycopg.Connection, statement: Any, params: Any = None) -> list[tuple[Any, ...]]:
    return conn.execute(statement, params).fetchall()


def nothing_lost(conn: psycopg.Connection, ids: Collection[int], *, settled: bool
                 ) -> list[str]:
    problems = []
    places = dict(_rows(conn, """
        SELECT id, array_agg(place ORDER BY place) FROM (
            SELECT id, 'jobs' AS place FROM jobd.jobs WHERE id = ANY(%(ids)s)
            UNION ALL SELECT id, 'jobs_archive' FROM jobd.jobs_archive WHERE id = ANY(%(ids)s)
            UNION ALL SELECT id, 'dead_letter' FROM jobd.dead_letter WHERE id = ANY(%(ids)s)
        ) AS found GROUP BY id""", {"ids": list(ids)}))
    missing = sorted(set(ids) - set(places))
    if missing:
        problems.append(f"lost: {len(missing)} jobs are nowhere, e.g. {missing[:5]}")
    doubled = {i: p for i, p in places.items() if len(p) > 1}
    if doubled:
        problems.append(f"duplicated: {len(doubled)} jobs in several places, e.g. "
                        f"{dict(list(doubled.items())[:5])}")
    if settled:
        left = sorted(i for i, p in places.items() if "jobs" in p)
        if left:
            problems.append(f"unfinished: {len(left)} jobs still in the queue, e.g. {left[:5]}")
    return problems


def nothing_stuck(conn: psycopg.Connection) -> list[str]:
    stuck = _rows(conn, """
        SELECT id, claimed_by, lease_until FROM jobd.jobs
         WHERE state = 'claimed'
           AND (lease_until IS NULL
                OR lease_until < now() - make_interval(secs => %(grace)s))
         ORDER BY id LIMIT 5""", {"grace": STUCK_GRACE_SECONDS})
    return [f"stuck in claimed past the lease: {stuck}"] if stuck else []


def _expected_failures(state: str, attempts: int) -> list[int]:
    """The attempt numbers that must have failed: every one but the running or successful
    last one for a claimed or done job; every one for a job waiting to retry or dead."""
    if state in ("claimed", "done"):
        return list(range(1, attempts))
    return list(range(1, attempts + 1))


def attempts_match_errors(conn: psycopg.Connection, ids: Collection[int]) -> list[str]:
    problems = []
    rows = _rows(conn, """
        SELECT id, state, attempts, max_attempts,
               ARRAY(SELECT (e ->> 'attempt')::int
                       FROM jsonb_array_elements(errors) WITH ORDINALITY AS h(e, n)
                      WHERE e ? 'error' ORDER BY n)
          FROM jobd.all_jobs WHERE id = ANY(%(ids)s)""", {"ids": list(ids)})
    for job_id, state, attempts, max_attempts, failed in rows:
        if state == "cancelled":
            continue  # a cancel may end a job at any point of its history
        expected = _expected_failures(state, attempts)
        if failed != expected:
            problems.append(f"job {job_id} ({state}, {attempts} attempts): error history "
                            f"has attempts {failed}, expected {expected}")
        if state in ("done", "dead") and attempts < 1:
            problems.append(f"job {job_id} is {state} without an attempt")
        if max_attempts is not None and attempts > max_attempts:
            problems.append(f"job {job_id}: {attempts} attempts of at most {max_attempts}")
    return problems[:20]


def schedule_ledger_consistent(conn: psycopg.Connection) -> list[str]:
    problems = []
    bad_fires = _rows(conn, """
        SELECT f.schedule_id, f.occurrence, f.outcome, f.job_id, j.idempotency_key, j.run_at,
               f.fire_at, j.handler, s.handler
          FROM jobd.schedule_fires AS f
          LEFT JOIN jobd.all_jobs AS j ON j.id = f.job_id
          LEFT JOIN jobd.schedules AS s ON s.id = f.schedule_id
         WHERE (f.outcome = 'enqueued'
                AND (j.id IS NULL
                     OR j.idempotency_key IS DISTINCT FROM
                        'jobd:schedule:' || f.schedule_id || ':' || f.occurrence
                     -- a retry moves run_at; until one, the job is due at the fire
                     OR (j.run_at <> f.fire_at AND j.errors = '[]'::jsonb)
                     OR j.handler IS DISTINCT FROM s.handler))
            OR (f.outcome = 'skipped_overlap' AND f.job_id IS NOT NULL)
         LIMIT 5""")
    if bad_fires:
        problems.append(f"fires whose job does not match the occurrence: {bad_fires}")
    shared = _rows(conn, """
        SELECT job_id, count(*) FROM jobd.schedule_fires WHERE job_id IS NOT NULL
         GROUP BY job_id HAVING count(*) > 1 LIMIT 5""")
    if shared:
        problems.append(f"jobs named by several fires: {shared}")
    orphans = _rows(conn, """
        SELECT j.id, j.idempotency_key FROM jobd.all_jobs AS j
         WHERE j.idempotency_key LIKE 'jobd:schedule:%%'
           AND NOT EXISTS (SELECT 1 FROM jobd.schedule_fires AS f WHERE f.job_id = j.id)
         LIMIT 5""")
    if orphans:
        problems.append(f"schedule jobs without a fire in the ledger: {orphans}")
    early = _rows(conn, """
        SELECT schedule_id, occurrence, fire_at, recorded_at FROM jobd.schedule_fires
         WHERE fire_at > recorded_at LIMIT 5""")
    if early:
        problems.append(f"occurrences fired before they were due (database clock): {early}")
    return problems


def one_effect_per_job(conn: psycopg.Connection, ids: Collection[int], effects: Effects
                       ) -> list[str]:
    problems = []
    rows = _rows(conn, sql.SQL("""
        SELECT j.id, j.state, coalesce(j.idempotency_key, 'jobd:job:' || j.id) AS key,
               (SELECT count(*) FROM {table} AS e
                 WHERE e.key = coalesce(j.idempotency_key, 'jobd:job:' || j.id)),
               EXISTS (SELECT 1 FROM jobd.processed_keys AS p
                        WHERE p.idempotency_key = coalesce(j.idempotency_key,
                                                           'jobd:job:' || j.id))
          FROM jobd.all_jobs AS j
         WHERE j.id = ANY(%(ids)s) AND j.handler = %(handler)s""").format(
        table=sql.SQL(effects.table)), {"ids": list(ids), "handler": effects.handler})
    for job_id, state, key, count, processed in rows:
        wanted = 1 if state == "done" else 0
        if count != wanted:
            problems.append(f"job {job_id} ({state}, key {key}): {count} effects, expected "
                            f"{wanted}")
        if processed != (state == "done"):
            problems.append(f"job {job_id} ({state}): processed key recorded = {processed}")
    strays = _rows(conn, sql.SQL("""
        SELECT e.key, count(*) FROM {table} AS e GROUP BY e.key HAVING count(*) > 1
         LIMIT 5""").format(table=sql.SQL(effects.table)))
    if strays:
        problems.append(f"keys with several effects: {strays}")
    return problems[:20]


def check(conn: psycopg.Connection, ids: Collection[int], *, settled: bool = True,
          effects: Effects | None = Effects()) -> list[str]:
    """Every violated invariant, as lines of text (empty when all hold)."""
    problems = nothing_lost(conn, ids, settled=settled)
    problems += nothing_stuck(conn)
    problems += attempts_match_errors(conn, ids)
    problems += schedule_ledger_consistent(conn)
    if effects is not None:
        problems += one_effect_per_job(conn, ids, effects)
    return problems


def assert_invariants(conn: psycopg.Connection, ids: Collection[int], *,
                      settled: bool = True, effects: Effects | None = Effects(),
                      context: str = "") -> None:
    problems = check(conn, ids, settled=settled, effects=effects)
    assert not problems, "invariants violated:\n  " + "\n  ".join(problems) + (
        f"\n{context}" if context else "")
