"""The cron materializer: turns due occurrences of recurring schedules into jobs.

Every supervisor runs it; the fire ledger (``schedule_fires``, unique per schedule and
occurrence key, written in the same transaction as the job) makes concurrent materializers
harmless. "Due" is judged by the database clock only: the node's own clock decides nothing
but how long to sleep.

Catch-up after downtime, per schedule: ``latest`` fires the newest missed occurrence once,
``all`` fires every missed occurrence (at most :data:`CATCHUP_ALL_LIMIT`, the newest),
``none`` fires only occurrences less than :data:`NONE_GRACE` late. Under ``overlap: skip``
the newest of them is fired first, so it is the one that runs (:func:`plan`).

Ownership: each supervisor instance declares the schedules of its config (:func:`sync`) and
keeps the declarations live from its duty pass (:func:`refresh`); a leaving instance withdraws
them (:func:`withdraw`). A schedule fires while it is enabled (the operator's flag,
:func:`set_enabled`) and any live instance declares it. Differing definitions of one id are
reported as conflicts; the stored one changes only once no live instance declares it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
import structlog
from psycopg.types.json import Jsonb

from jobd import views
from jobd.config import ScheduleConfig
from jobd.cron import CronError, CronSchedule, Occurrence
from jobd.queries import query

CATCHUP_ALL_LIMIT = 100
NONE_GRACE = timedelta(seconds=60)
# The ledger must outlive any occurrence a late node could still compute; the cursor
# already stops recomputation, so this is a second line of defence with a wide margin.
LEDGER_RETENTION = timedelta(days=90)
# A declaration outlives a few missed duty passes, and at least a floor that covers a
# supervisor loop held up by a reload's import check or a slow statement: expiring early
# would let another node adopt its definition while this one still runs.
DECLARATION_TTL_DUTY_PASSES = 3
DECLARATION_TTL_FLOOR = 15.0
# Expired declarations (of instances that died without leaving) are deleted this long after.
DECLARATION_PRUNE_AFTER = timedelta(hours=1)

# Less than any two distinct instants of a schedule (they are whole minutes apart).
JUST_BEFORE = timedelta(microseconds=1)

log = structlog.get_logger("jobd.schedules")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do for one schedule at one tick."""

    fire: list[Occurrence]  # in the order to fire them
    advance_to: datetime | None  # move the cursor here although nothing fired


def plan(schedule: CronSchedule, catchup: str, cursor: datetime, now: datetime,
         overlap: str = "allow") -> Plan:
    """The occurrences in ``(cursor, now]`` to fire under the catch-up policy. Pure.

    Under ``overlap: skip`` the newest is fired first. Missed occurrences are all due at
    once, so skip lets only the first one fired run and records the others as skipped: that
    one must be the newest, the run a schedule that had not missed anything would be making.
    Fired oldest first, the stalest occurrence ran and every newer one, the latest included,
    was skipped behind it. A config refuses ``catchup: all`` with ``overlap: skip``
    (jobd.config); a definition stored by an earlier release may still have both, and
    several occurrences can share the newest instant (a spring-forward gap) under any
    policy."""
    todo = _plan(schedule, catchup, cursor, now)
    if overlap == "skip":
        return Plan(todo.fire[::-1], todo.advance_to)
    return todo


def _plan(schedule: CronSchedule, catchup: str, cursor: datetime, now: datetime) -> Plan:
    if catchup == "latest":
        newest = schedule.between(cursor, now, last=1)
        if not newest:
            return Plan([], None)
        # Every occurrence at the newest's instant: a spring-forward gap moves 02:00 and
        # 02:30 (or 02:00 and 03:00) to the instant after the jump, each its own occurrence,
        # and the cursor then moves past them all.
        return Plan(schedule.between(max(cursor, newest[0].fire_at - JUST_BEFORE), now), None)
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


@dataclass(frozen=True, slots=True)
class Conflict:
    """Live instances disagree on a schedule's definition; the stored one is kept."""

    schedule_id: str
    stored_by: tuple[str, ...]  # live instances declaring the stored definition
    differing: tuple[str, ...]  # live instances declaring another one


@dataclass(slots=True)
class SyncResult:
    # Occurrences the previous expression or zone still owed, fired before the change.
    owed: TickResult = field(default_factory=TickResult)
    created: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # stored definition replaced
    withdrawn: list[str] = field(default_factory=list)  # no longer declared by this instance
    conflicts: list[Conflict] = field(default_factory=list)


def declaration_ttl(duty_interval: float) -> float:
    """Seconds a declaration stays live without a refresh, for a given duty interval."""
    return max(DECLARATION_TTL_DUTY_PASSES * duty_interval, DECLARATION_TTL_FLOOR)


def definition(schedule: ScheduleConfig) -> dict[str, object]:
    """A configured schedule as declarations carry it (the SQL ``schedule_definition``)."""
    return {"cron": schedule.cron, "timezone": schedule.timezone, "handler": schedule.handler,
            "lane": schedule.lane, "payload": schedule.payload, "priority": schedule.priority,
            "catchup": schedule.catchup, "overlap": schedule.overlap}


def sync(conn: psycopg.Connection, schedules: Sequence[ScheduleConfig], instance: str,
         ttl: float, now: datetime | None = None) -> SyncResult:
    """Declare ``instance``'s configured schedules and withdraw its other declarations.

    Creates new schedules; a stored definition changes only when no other live instance
    still declares it (otherwise the difference is reported in ``conflicts``). Never
    enables or disables a schedule: that flag is the operator's. The schedules have passed
    the config's rules: a config file's as it loaded, values built in Python through
    :func:`jobd.config.check_schedules` (jobd.testing's materialize_schedules).
    """
    result = SyncResult()
    ordered = sorted(schedules, key=lambda schedule: schedule.id)
    with conn.transaction():
        # In id order, the order tick() locks them in, so a sync and another node's tick
        # cannot deadlock.
        for s in ordered:
            _fire_what_the_old_definition_owes(conn, s, now, result.owed)
            row = conn.execute(query("declare_schedule"), {
                "id": s.id, "instance": instance, "definition": Jsonb(definition(s)),
                "ttl": ttl, "now": now}).fetchone()
            assert row is not None
            if row[0] == "created":
                result.created.append(s.id)
            elif row[0] == "changed":
                result.changed.append(s.id)
        rows = conn.execute(query("withdraw_schedule_declarations_except"),
                            {"instance": instance, "ids": [s.id for s in ordered]}).fetchall()
        result.withdrawn = sorted(row[0] for row in rows)
        result.conflicts = conflicts(conn, [s.id for s in ordered], now)
        # Last: it may wait for another instance's refresh of a row it deletes, and a
        # statement that waits while holding schedule locks must be the final one.
        conn.execute(query("prune_schedule_declarations"),
                     {"after": DECLARATION_PRUNE_AFTER.total_seconds(), "now": now})
    return result


def _fire_what_the_old_definition_owes(conn: psycopg.Connection, schedule: ScheduleConfig,
                                       now: datetime | None, result: TickResult) -> None:
    """A new expression or zone starts at the change (migration 0035), so the occurrences
    the stored one has due since its cursor are fired first, under its catch-up policy: a
    restart with a changed config after a downtime, or a reload between an occurrence and
    the tick for it, skipped them."""
    row = conn.execute(query("schedule_before_its_change"), {
        "id": schedule.id, "cron": schedule.cron, "timezone": schedule.timezone,
        "now": now}).fetchone()
    if row is None:
        return
    cron, timezone, catchup, overlap, cursor, db_now = row
    try:
        stored = CronSchedule.parse(cron, timezone)
    except CronError:
        return  # nothing it can owe: the tick says so for every schedule that cannot fire
    owed = plan(stored, catchup, cursor, db_now, overlap)
    for occurrence in owed.fire:
        _fire(conn, schedule.id, occurrence, now, result)


def refresh(conn: psycopg.Connection, instance: str, schedules: Sequence[ScheduleConfig],
            ttl: float, now: datetime | None = None,
            owed: TickResult | None = None) -> list[str]:
    """Keep ``instance``'s declarations live; adopt its definitions that no longer conflict.

    Runs in the duty transaction after the tick: it takes no schedule lock that it would
    have to wait for, so it cannot close a lock cycle with another node's tick or sync.
    Returns the schedules whose stored definition it replaced; what the replaced
    expressions still owed is fired first and recorded in ``owed``.
    """
    if not schedules:
        return []
    conn.execute(query("refresh_schedule_declarations"), {
        "instance": instance, "ids": [s.id for s in schedules],
        "definitions": [Jsonb(definition(s)) for s in schedules], "ttl": ttl, "now": now})
    configured = {s.id: s for s in schedules}
    changed = []
    for (schedule_id,) in conn.execute(query("undecided_schedule_declarations"),
                                       {"instance": instance}).fetchall():
        # Locked here, without waiting (a busy schedule waits for the next pass), so that
        # what the stored expression owes is fired before the reconcile can replace it: the
        # tick before this fired nothing of a schedule no live node declared (this node's
        # own declarations had expired while it was away).
        if conn.execute(query("lock_schedule_without_waiting"),
                        {"schedule_id": schedule_id}).fetchone() is None:
            continue
        config = configured.get(schedule_id)  # None: a declaration a sync has yet to withdraw
        if config is not None:
            _fire_what_the_old_definition_owes(conn, config, now,
                                               owed if owed is not None else TickResult())
        row = conn.execute(query("reconcile_schedule"),
                           {"schedule_id": schedule_id, "now": now, "wait": False}).fetchone()
        if row is not None and row[0] == "changed":
            changed.append(schedule_id)
            log.info("schedule definition changed: no live node declares the previous one",
                     schedule=schedule_id, instance=instance)
    return changed


def withdraw(conn: psycopg.Connection, instance: str) -> None:
    """A leaving instance: its schedules no longer count as declared by it."""
    conn.execute(query("withdraw_schedule_declarations"), {"instance": instance})


def conflicts(conn: psycopg.Connection, ids: Sequence[str] | None = None,
              now: datetime | None = None) -> list[Conflict]:
    """Schedules (of ``ids``, or all) whose live declarations disagree with the stored one."""
    rows = conn.execute(query("schedule_conflicts"),
                        {"ids": None if ids is None else list(ids), "now": now}).fetchall()
    return [Conflict(schedule_id, tuple(stored_by), tuple(differing))
            for schedule_id, stored_by, differing in rows]


def report_sync(result: SyncResult) -> None:
    """Log what a sync did; a conflict names the schedule and the instances on each side."""
    if result.created:
        log.info("schedules created", schedules=result.created)
    if result.changed:
        log.info("schedule definitions changed", schedules=result.changed)
    if result.withdrawn:
        log.info("schedules no longer declared by this node", schedules=result.withdrawn)
    for conflict in result.conflicts:
        log.warning("schedule definitions differ between live nodes; the stored one is kept "
                    "until no live node declares it", schedule=conflict.schedule_id,
                    stored_by=list(conflict.stored_by), differing=list(conflict.differing))


class UnknownSchedule(LookupError):
    """No schedule has this id."""


def set_enabled(conn: psycopg.Connection, schedule_id: str, enabled: bool
                ) -> tuple[bool, bool]:
    """Set the operator's flag; returns (whether it changed, whether a live node declares
    the schedule). Raises :class:`UnknownSchedule`."""
    row = conn.execute(query("set_schedule_enabled"),
                       {"id": schedule_id, "enabled": enabled}).fetchone()
    if row is None:
        raise UnknownSchedule(schedule_id)
    was_enabled, declared = row
    return was_enabled != enabled, bool(declared)


def schedule_ids(conn: psycopg.Connection) -> list[str]:
    return [row[0] for row in conn.execute(query("schedule_ids")).fetchall()]


def tick(conn: psycopg.Connection, now: datetime | None = None) -> TickResult:
    """Fire every due occurrence of every enabled schedule; report the next fire instant."""
    result = TickResult()
    rows = conn.execute(query("due_schedules"), {"now": now}).fetchall()
    upcoming: list[datetime] = []
    for schedule_id, expression, timezone, catchup, overlap, cursor, db_now in rows:
        try:
            schedule = CronSchedule.parse(expression, timezone)
        except CronError as exc:
            log.error("schedule cannot be evaluated", schedule=schedule_id, error=str(exc))
            continue
        todo = plan(schedule, catchup, cursor, db_now, overlap)
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
        log.info("schedule skipped: a run of it is still in progress", schedule=schedule_id,
                 occurrence=occurrence.key)


def prune_ledger(conn: psycopg.Connection) -> None:
    conn.execute(query("prune_schedule_fires"),
                 {"older_than": LEDGER_RETENTION.total_seconds()})


def list_schedules(conn: psycopg.Connection, now: datetime | None = None
                   ) -> list[dict[str, object]]:
    """Every schedule with ``declared_by`` (live instances) and ``differing`` (those of them
    whose definition is not the stored one)."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(query("list_schedules"), {"now": now}).fetchall()


def listing(conn: psycopg.Connection, now: datetime | None = None) -> list[dict[str, Any]]:
    """The rows of ``jobd schedules list``: every schedule (as :func:`list_schedules` gives
    it) with its ``state`` and its next fire, ``next_fire_local`` and ``next_fire_utc``, by
    the database clock unless ``now`` is given."""
    rows = list_schedules(conn, now)
    at = views.database_clock(conn, now)
    return [listing_row(entry, at) for entry in rows]


def listing_row(entry: dict[str, object], now: datetime) -> dict[str, object]:
    """One row of :func:`list_schedules` with its state and next fire at ``now``. Pure."""
    state = listing_state(entry)
    local = utc = None
    # Only a schedule that fires has a next fire.
    if state in ("enabled", "conflict"):
        local, utc = next_fire(entry, now)
    return {**entry, "state": state, "next_fire_local": local, "next_fire_utc": utc}


def listing_state(entry: dict[str, object]) -> str:
    """disabled (by an operator), undeclared (no live node declares it: not firing),
    conflict (live nodes declare differing definitions; the stored one fires) or enabled."""
    if not entry["enabled"]:
        return "disabled"
    if not entry["declared_by"]:
        return "undeclared"
    return "conflict" if entry["differing"] else "enabled"


def next_fire(entry: dict[str, object], now: datetime
              ) -> tuple[datetime | None, datetime | None]:
    """The schedule's first occurrence after ``now`` and its cursor, as (local, UTC)."""
    cursor = entry["materialized_until"]
    assert isinstance(cursor, datetime)
    try:
        cron = CronSchedule.parse(str(entry["cron"]), str(entry["timezone"]))
    except CronError:
        return None, None  # written by another jobd version; list it without a next fire
    following = cron.next_after(max(now, cursor))
    if not following:
        return None, None
    return following[0].local(cron.zone), following[0].fire_at
