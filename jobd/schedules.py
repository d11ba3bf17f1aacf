"""The cron materializer: turns due occurrences of recurring schedules into jobs.

Every supervisor runs it; the fire ledger (``schedule_fires``, unique per schedule and
occurrence key, written in the same transaction as the job) makes concurrent materializers
harmless. "Due" is judged by the database clock only: the node's own clock decides nothing
but how long to sleep.

Catch-up after downtime, per schedule: ``latest`` fires the newest missed occurrence once,
``all`` fires every missed occurrence (at most :data:`CATCHUP_ALL_LIMIT`, the newest),
``none`` fires only occurrences less than :data:`NONE_GRACE` late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg
import structlog
from psycopg.types.json import Jsonb

from jobd.config import ScheduleConfig
from jobd.cron import CronError, CronSchedule, Occurrence
from jobd.queries import query

CATCHUP_ALL_LIMIT = 100
NONE_GRACE = timedelta(seconds=60)
# The ledger must outlive any occurrence a late node could still compute; the cursor
# already stops recomputation, so this is a second line of defence with a wide margin.
LEDGER_RETENTION = timedelta(days=90)

log = structlog.get_logger("jobd.schedules")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do for one schedule at one tick."""

    fire: list[Occurrence]
    advance_to: datetime | None  # move the cursor here although nothing fired


def plan(schedule: CronSchedule, catchup: str, cursor: datetime, now: datetime) -> Plan:
    """The occurrences in ``(cursor, now]`` to fire under the catch-up policy. Pure."""
    if catchup == "latest":
        return Plan(schedule.between(cursor, now, last=1), None)
    if catchup == "all":
        return Plan(schedule.between(cursor, now, last=CATCHUP_ALL_LIMIT), None)
    if catchup == "none":
        horizon = now - NONE_GRACE
        start = max(cursor, horizon)
        return Plan(schedule.between(start, now), horizon if cursor < horizon else None)
    raise ValueError(f"unknown catch-up policy {catchup!r}")


@dataclass(slots=True)
class TickResult:
    enqueued: list[tuple[str, str, int]] = field(default_factory=list)  # id, occurrence, job
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    next_fire_at: datetime | None = None


def sync(conn: psycopg.Connection, schedules: Sequence[ScheduleConfig],
         now: datetime | None = None) -> list[str]:
    """Write the configured schedules; disable the ones no longer configured (returned)."""
    with conn.transaction():
        # In id order, the order tick() locks them in, so a sync and another node's tick
        # cannot deadlock.
        for s in sorted(schedules, key=lambda schedule: schedule.id):
            conn.execute(query("sync_schedule"), {
                "id": s.id, "cron": s.cron, "timezone": s.timezone, "handler": s.handler,
                "lane": s.lane, "payload": Jsonb(s.payload), "priority": s.priority,
                "catchup": s.catchup, "overlap": s.overlap, "now": now,
            })
        rows = conn.execute(query("disable_schedules_except"),
                            {"ids": [s.id for s in schedules]}).fetchall()
    return [row[0] for row in rows]


def tick(conn: psycopg.Connection, now: datetime | None = None) -> TickResult:
    """Fire every due occurrence of every enabled schedule; report the next fire instant."""
    result = TickResult()
    rows = conn.execute(query("due_schedules"), {"now": now}).fetchall()
    upcoming: list[datetime] = []
    for schedule_id, expression, timezone, catchup, cursor, db_now in rows:
        try:
            schedule = CronSchedule.parse(expression, timezone)
        except CronError as exc:
            log.error("schedule cannot be evaluated", schedule=schedule_id, error=str(exc))
            continue
        todo = plan(schedule, catchup, cursor, db_now)
        for occurrence in todo.fire:
            _fire(conn, schedule_id, occurrence, now, result)
        if todo.advance_to is not None:
            conn.execute(query("advance_schedule"),
                         {"schedule_id": schedule_id, "until": todo.advance_to})
        following = schedule.next_after(max(cursor, db_now))
        if following:
            upcoming.append(following[0].fire_at)
    result.next_fire_at = min(upcoming, default=None)
    return result


def _fire(conn: psycopg.Connection, schedule_id: str, occurrence: Occurrence,
          now: datetime | None, result: TickResult) -> None:
    row = conn.execute(query("fire_schedule"), {
        "schedule_id": schedule_id, "occurrence": occurrence.key,
        "fire_at": occurrence.fire_at, "now": now,
    }).fetchone()
    assert row is not None
    outcome, job_id = row
    if outcome == "enqueued":
        result.enqueued.append((schedule_id, occurrence.key, job_id))
        log.info("schedule fired", schedule=schedule_id, occurrence=occurrence.key,
                 job_id=job_id)
    elif outcome == "duplicate":
        result.duplicates.append((schedule_id, occurrence.key))
    elif outcome == "skipped_overlap":
        result.skipped.append((schedule_id, occurrence.key))
        log.info("schedule skipped: previous run still in progress", schedule=schedule_id,
                 occurrence=occurrence.key)


def prune_ledger(conn: psycopg.Connection) -> None:
    conn.execute(query("prune_schedule_fires"),
                 {"older_than": LEDGER_RETENTION.total_seconds()})


def list_schedules(conn: psycopg.Connection) -> list[dict[str, object]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(query("list_schedules")).fetchall()
