"""The materializer against a real PostgreSQL: racing nodes, the fire ledger, catch-up, overlap,
archive, the database clock, and syncing schedules from the config."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import jobd.cron
import jobd.schedules
from jobd import archive, queue
from jobd.config import ScheduleConfig, parse
from jobd.cron import CronSchedule
from jobd.db import connect
from jobd.schedules import CATCHUP_ALL_LIMIT, NONE_GRACE, SyncResult, tick

NODE = "test-node:1:aaaaaa"
# Longer than any span of injected clocks below (they run from 2026-10 to 2027-03 and the
# real clock): one node's declarations stay live for the whole test.
LONG_TTL = 3 * 365 * 86400.0


def sync(conn: psycopg.Connection, configs: list[ScheduleConfig],
         now: datetime | None = None, instance: str = NODE) -> SyncResult:
    """One node declaring ``configs``, with declarations that outlive the test."""
    return jobd.schedules.sync(conn, configs, instance, LONG_TTL, now)


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def schedule(id: str, cron: str, timezone: str = "UTC", **options: Any) -> ScheduleConfig:
    return ScheduleConfig(id=id, cron=cron, handler="report", timezone=timezone, **options)


def ledger(conn: psycopg.Connection, schedule_id: str | None = None) -> list[tuple[Any, ...]]:
    """(schedule_id, occurrence, fire_at, outcome, job_id) rows, oldest first."""
    return conn.execute(
        "SELECT schedule_id, occurrence, fire_at, outcome, job_id FROM schedule_fires"
        " WHERE %(id)s::text IS NULL OR schedule_id = %(id)s ORDER BY fire_at, occurrence",
        {"id": schedule_id}).fetchall()


def jobs_of(conn: psycopg.Connection, schedule_id: str) -> list[tuple[Any, ...]]:
    """(id, run_at, idempotency_key, state) of every job of a schedule, live or archived."""
    return conn.execute(
        "SELECT id, run_at, idempotency_key, state FROM all_jobs"
        " WHERE idempotency_key LIKE %s ORDER BY run_at, id",
        (f"jobd:schedule:{schedule_id}:%",)).fetchall()


def cursor_of(conn: psycopg.Connection, schedule_id: str) -> datetime:
    row = conn.execute("SELECT materialized_until FROM schedules WHERE id = %s",
                       (schedule_id,)).fetchone()
    assert row is not None
    return row[0]


def set_cursor(conn: psycopg.Connection, schedule_id: str, at: datetime) -> None:
    conn.execute("UPDATE schedules SET materialized_until = %s WHERE id = %s", (at, schedule_id))


def utc(*fields: int) -> datetime:
    return datetime(*fields, tzinfo=UTC)  # type: ignore[misc]


# --- racing materializers ------------------------------------------------------------------


# A tick costs the cron arithmetic of every schedule, which grows with the number of
# occurrences in the three hours the search looks past both ends (about 3 ms of CPU for */10,
# 20 ms for */1), so the race uses */10 to afford thousands of ticks.
RACE_SCHEDULES = [
    schedule("ten-minutes", "*/10 * * * *", "Europe/Berlin", catchup="all"),
    schedule("quarter-hour", "*/15 * * * *", "Europe/Berlin", catchup="all"),
    schedule("nightly", "30 2 * * *", "Europe/Berlin", catchup="all"),
    schedule("early", "0 3 * * *", "Europe/Berlin", catchup="all"),
]
# Berlin's fall-back night, 00:00 CEST to 05:00 CET: 02:00-03:00 local happens twice.
RACE_START, RACE_END = utc(2026, 10, 24, 22), utc(2026, 10, 25, 4)


def _race(db_url: str, seed: int, start: datetime, end: datetime, barrier: Any,
          results: Any) -> None:
    """One materializer node: its own connection and its own clock, stepping to ``end``."""
    rng = random.Random(seed)
    stats = {"ticks": 0, "enqueued": 0, "duplicates": 0, "skipped": 0, "resets": 0,
             "largest_tick": 0}
    with connect(db_url) as conn:
        barrier.wait(timeout=60)
        now = start
        while now < end:
            now = min(end, now + timedelta(seconds=rng.uniform(1, 60)))
            if rng.random() < 0.5:  # the supervisor ticks inside its duty transaction
                with conn.transaction():
                    result = tick(conn, now=now)
            else:
                result = tick(conn, now=now)
            handled = len(result.enqueued) + len(result.duplicates) + len(result.skipped)
            stats["ticks"] += 1
            stats["enqueued"] += len(result.enqueued)
            stats["duplicates"] += len(result.duplicates)
            stats["skipped"] += len(result.skipped)
            stats["largest_tick"] = max(stats["largest_tick"], handled)
            if rng.random() < 0.02:
                # A late node: one schedule's cursor goes back up to an hour, so already
                # fired occurrences are computed and fired again.
                set_cursor(conn, rng.choice(RACE_SCHEDULES).id,
                           max(start, now - timedelta(minutes=rng.uniform(5, 60))))
                stats["resets"] += 1
    results.put(stats)


def test_three_racing_materializers_fire_every_occurrence_exactly_once(
    conn: psycopg.Connection, db_url: str
) -> None:
    start, end = RACE_START, RACE_END
    sync(conn, RACE_SCHEDULES, now=start)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(3)
    results = context.Queue()
    nodes = [context.Process(target=_race, args=(db_url, seed, start, end, barrier, results))
             for seed in range(3)]
    for node in nodes:
        node.start()
    stats = [results.get(timeout=120) for _ in nodes]
    for node in nodes:
        node.join(timeout=30)
        assert node.exitcode == 0

    assert sum(s["ticks"] for s in stats) > 2000
    assert max(s["largest_tick"] for s in stats) < CATCHUP_ALL_LIMIT  # nothing truncated
    assert sum(s["duplicates"] for s in stats) > 0  # the nodes did compute the same occurrences
    assert sum(s["skipped"] for s in stats) == 0

    rows = ledger(conn)
    expected = {
        (s.id, o.key, o.fire_at)
        for s in RACE_SCHEDULES
        for o in CronSchedule.parse(s.cron, s.timezone).between(start, end)}
    # None missing, none extra, none twice.
    assert len(rows) == len(expected) == len({(r[0], r[1], r[2]) for r in rows})
    assert {(r[0], r[1], r[2]) for r in rows} == expected
    assert {r[3] for r in rows} == {"enqueued"}
    assert sum(s["enqueued"] for s in stats) == len(rows)
    # Exactly one job per fire, with the fire's instant and key.
    jobs = conn.execute(
        "SELECT f.schedule_id, f.occurrence, f.fire_at, j.run_at, j.idempotency_key"
        "  FROM schedule_fires AS f JOIN jobs AS j ON j.id = f.job_id").fetchall()
    assert len(jobs) == len(rows)
    assert all(run_at == fire_at and key == f"jobd:schedule:{sid}:{occurrence}"
               for sid, occurrence, fire_at, run_at, key in jobs)
    assert conn.execute("SELECT count(*), count(DISTINCT idempotency_key) FROM jobs"
                        ).fetchone() == (len(rows), len(rows))
    # The DST night itself: the fixed-time schedules fired once each, at the policy's instant.
    nightly = [r for r in rows if r[0] == "nightly"]
    assert len(nightly) == 1
    local = nightly[0][2].astimezone(CronSchedule.parse("* * * * *", "Europe/Berlin").zone)
    assert local.isoformat() == "2026-10-25T02:30:00+02:00"
    ten = [r[2].astimezone(local.tzinfo) for r in rows if r[0] == "ten-minutes"]
    assert len(ten) == (end - start) / timedelta(minutes=10)
    assert sum(1 for t in ten if t.hour == 2) == 12  # both passes of 02:00-03:00


# --- the database clock --------------------------------------------------------------------


def test_fire_schedule_refuses_an_occurrence_in_the_future_of_the_database_clock(
    conn: psycopg.Connection,
) -> None:
    sync(conn, [schedule("s", "* * * * *")])
    row = conn.execute("SELECT * FROM fire_schedule('s', 'k1', now() + interval '10 minutes')"
                       ).fetchone()
    assert row == ("not_due", None)
    # A caller's own idea of "now" does not help either: the database clock is the default.
    row = conn.execute("SELECT * FROM fire_schedule('s', 'k2', now() + interval '1 second')"
                       ).fetchone()
    assert row == ("not_due", None)
    assert ledger(conn) == []
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    row = conn.execute("SELECT * FROM fire_schedule('s', 'k3', now() - interval '1 second')"
                       ).fetchone()
    assert row is not None and row[0] == "enqueued"


def _tick_and_check_against_the_database_clock(conn: psycopg.Connection) -> None:
    """Ticks with the real clock; asserts that the database clock alone decided."""
    cron = CronSchedule.parse("* * * * *", "UTC")
    cursor = cursor_of(conn, "s")
    before = db_now(conn)
    result = tick(conn)
    after = db_now(conn)
    fired = {key for _, key, _ in result.enqueued}
    assert {o.key for o in cron.between(cursor, before)} <= fired
    assert fired <= {o.key for o in cron.between(cursor, after)}
    assert conn.execute("SELECT count(*) FROM schedule_fires WHERE fire_at > now()"
                        ).fetchone() == (0,)
    assert result.next_fire_at is not None
    assert before < result.next_fire_at <= after + timedelta(minutes=1)


def test_tick_with_a_node_clock_ten_minutes_ahead_fires_nothing_early(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync(conn, [schedule("s", "* * * * *", catchup="all")])
    conn.execute("UPDATE schedules SET materialized_until = now() - interval '150 seconds'")
    ahead = timedelta(minutes=10)
    real_time = time.time

    class AheadDatetime(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> AheadDatetime:  # type: ignore[override]
            return super().now(tz) + ahead  # type: ignore[return-value]

    monkeypatch.setattr(time, "time", lambda: real_time() + ahead.total_seconds())
    monkeypatch.setattr(jobd.schedules, "datetime", AheadDatetime)
    monkeypatch.setattr(jobd.cron, "datetime", AheadDatetime)
    # Had the node's clock counted, about ten more occurrences would be due.
    node_now = datetime.fromtimestamp(time.time(), UTC)
    assert len(CronSchedule.parse("* * * * *").between(cursor_of(conn, "s"), node_now)) >= 11

    _tick_and_check_against_the_database_clock(conn)
    assert 2 <= len(ledger(conn)) <= 3  # the 150 s behind the database clock, no more


TICK_SCRIPT = """
import json, sys
from datetime import UTC, datetime
from jobd.db import connect
from jobd.schedules import tick
with connect(sys.argv[1]) as conn:
    result = tick(conn)
    print(json.dumps({"node_now": datetime.now(UTC).isoformat(),
                      "fired": [key for _, key, _ in result.enqueued]}))
"""


@pytest.mark.skipif(shutil.which("faketime") is None, reason="the faketime binary is missing")
def test_tick_in_a_process_whose_clock_is_ten_minutes_ahead_fires_nothing_early(
    conn: psycopg.Connection, db_url: str
) -> None:
    sync(conn, [schedule("s", "* * * * *", catchup="all")])
    conn.execute("UPDATE schedules SET materialized_until = now() - interval '150 seconds'")
    cursor, before = cursor_of(conn, "s"), db_now(conn)
    done = subprocess.run(["faketime", "-f", "+10m", sys.executable, "-c", TICK_SCRIPT, db_url],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    after = db_now(conn)
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout.splitlines()[-1])  # after any log lines
    assert datetime.fromisoformat(output["node_now"]) - after > timedelta(minutes=9)
    cron = CronSchedule.parse("* * * * *", "UTC")
    assert {o.key for o in cron.between(cursor, before)} <= set(output["fired"])
    assert set(output["fired"]) <= {o.key for o in cron.between(cursor, after)}
    assert conn.execute("SELECT count(*) FROM schedule_fires WHERE fire_at > now()"
                        ).fetchone() == (0,)


# --- catch-up ------------------------------------------------------------------------------


def test_catchup_policies_after_three_days_of_downtime(conn: psycopg.Connection) -> None:
    now = utc(2026, 10, 20, 12, 2, 30)
    cron = CronSchedule.parse("*/5 * * * *", "UTC")
    sync(conn, [schedule(policy, "*/5 * * * *", catchup=policy)
                for policy in ("latest", "all", "none")], now=now - timedelta(days=3))
    missed = cron.between(now - timedelta(days=3), now)
    assert len(missed) == 864

    result = tick(conn, now=now)

    latest = jobs_of(conn, "latest")
    assert [run_at for _, run_at, _, _ in latest] == [utc(2026, 10, 20, 12, 0)]
    assert [row[2] for row in latest] == ["jobd:schedule:latest:2026-10-20T12:00Z"]
    assert [r[2] for r in ledger(conn, "all")] == [o.fire_at for o in missed[-CATCHUP_ALL_LIMIT:]]
    assert [r[1] for r in jobs_of(conn, "all")] == [
        o.fire_at for o in missed[-CATCHUP_ALL_LIMIT:]]
    assert jobs_of(conn, "none") == [] and ledger(conn, "none") == []
    assert cursor_of(conn, "none") == now - NONE_GRACE
    assert cursor_of(conn, "latest") == cursor_of(conn, "all") == utc(2026, 10, 20, 12, 0)
    assert len(result.enqueued) == 1 + CATCHUP_ALL_LIMIT
    assert result.next_fire_at == utc(2026, 10, 20, 12, 5)

    # Caught up, all three fire the next occurrence on time, once.
    for at in (utc(2026, 10, 20, 12, 5, 20), utc(2026, 10, 20, 12, 5, 40)):
        tick(conn, now=at)
    for policy, count in (("latest", 2), ("all", CATCHUP_ALL_LIMIT + 1), ("none", 1)):
        jobs = jobs_of(conn, policy)
        assert len(jobs) == count and jobs[-1][1] == utc(2026, 10, 20, 12, 5), policy


def test_a_fixed_time_in_a_skipped_day_does_not_fire_and_the_tick_goes_on(
    conn: psycopg.Connection,
) -> None:
    # Pacific/Apia skipped 2011-12-30 (-10:00 to +14:00). Looking for the end of that jump,
    # a tick over it raised a CronError, which ends the supervisor: no jump that long is a
    # daylight-saving change, and as in Debian cron the skipped day's noon does not fire.
    sync(conn, [schedule("noon", "0 12 * * *", "Pacific/Apia"),
                schedule("other", "*/5 * * * *")], now=utc(2011, 12, 29, 23))
    fired = []
    for hour in range(1, 49):
        fired += tick(conn, now=utc(2011, 12, 29, 23) + timedelta(hours=hour)).enqueued
    assert [o for s, o, _ in fired if s == "noon"] == ["2011-12-31T12:00 Pacific/Apia",
                                                       "2012-01-01T12:00 Pacific/Apia"]
    assert len([s for s, _, _ in fired if s == "other"]) == 48


def test_catchup_none_fires_an_occurrence_that_is_less_than_a_minute_late(
    conn: psycopg.Connection,
) -> None:
    sync(conn, [schedule("none", "30 2 * * *", "Europe/Berlin", catchup="none")],
         now=utc(2026, 10, 1))
    tick(conn, now=utc(2026, 10, 25, 0, 30, 45))  # 02:30 +02:00, 45 s late
    assert [r[1] for r in jobs_of(conn, "none")] == [utc(2026, 10, 25, 0, 30)]


# --- overlap -------------------------------------------------------------------------------


def test_overlap_skip_waits_for_the_previous_job_to_finish(conn: psycopg.Connection) -> None:
    t0 = utc(2026, 10, 20, 12, 0, 30)
    sync(conn, [schedule("skip", "*/5 * * * *", overlap="skip"),
                schedule("allow", "*/5 * * * *", lane="other")], now=t0)

    def at(minutes: int) -> datetime:
        return t0 + timedelta(minutes=minutes, seconds=10)

    first = tick(conn, now=at(5))
    assert {sid for sid, _, _ in first.enqueued} == {"skip", "allow"}
    [(skip_job_id, _, _, _)] = jobs_of(conn, "skip")

    # The 12:10 occurrence while the 12:05 job is pending: recorded as skipped, no job.
    second = tick(conn, now=at(10))
    assert second.skipped == [("skip", "2026-10-20T12:10Z")]
    assert ledger(conn, "skip")[-1][1:] == (
        "2026-10-20T12:10Z", utc(2026, 10, 20, 12, 10), "skipped_overlap", None)
    assert len(jobs_of(conn, "skip")) == 1
    assert cursor_of(conn, "skip") == utc(2026, 10, 20, 12, 10)
    assert tick(conn, now=at(10) + timedelta(seconds=20)).skipped == []  # dealt with once

    # Running (claimed) counts as still in progress too.
    [job] = queue.claim(conn, "default", "w", 1, 600, now=at(12))
    assert job.id == skip_job_id
    assert tick(conn, now=at(15)).skipped == [("skip", "2026-10-20T12:15Z")]

    # Once it is done, the next occurrence enqueues.
    assert queue.complete(conn, [job.lease], now=at(17)).applied == [skip_job_id]
    after = tick(conn, now=at(20))
    assert [(sid, key) for sid, key, _ in after.enqueued if sid == "skip"] == [
        ("skip", "2026-10-20T12:20Z")]
    assert [r[3] for r in ledger(conn, "skip")] == [
        "enqueued", "skipped_overlap", "skipped_overlap", "enqueued"]
    # allow (the default) enqueued every occurrence regardless.
    assert [r[1] for r in jobs_of(conn, "allow")] == [
        utc(2026, 10, 20, 12, m) for m in (5, 10, 15, 20)]


def test_overlap_skip_is_not_blocked_by_a_previous_job_that_died(
    conn: psycopg.Connection,
) -> None:
    t0 = utc(2026, 10, 20, 12, 0, 30)
    sync(conn, [schedule("skip", "*/5 * * * *", overlap="skip")], now=t0)
    tick(conn, now=utc(2026, 10, 20, 12, 5, 1))
    [job] = queue.claim(conn, "default", "w", 1, 600, now=utc(2026, 10, 20, 12, 5, 2))
    outcome = queue.fail(conn, [queue.Failure(job.lease, "boom", 0, 1)],
                         now=utc(2026, 10, 20, 12, 5, 3))
    assert outcome.dead == [job.id]
    assert [key for _, key, _ in tick(conn, now=utc(2026, 10, 20, 12, 10, 1)).enqueued] == [
        "2026-10-20T12:10Z"]


def test_overlap_skip_catching_up_runs_the_newest_missed_occurrence(
    conn: psycopg.Connection,
) -> None:
    # A config refuses catchup: all with overlap: skip; an earlier release's node still
    # declares what its config says, and the definition it stored is the one that fires.
    t0 = utc(2026, 10, 20, 8, 30)
    stored = jobd.schedules.definition(schedule("s", "0 * * * *", catchup="all"))
    conn.execute("SELECT declare_schedule('s', 'old-node:1:aa', %s, %s, %s)",
                 (json.dumps({**stored, "overlap": "skip"}), LONG_TTL, t0))

    # Down from 08:30 to 12:30: 09:00 to 12:00 all due at once.
    result = tick(conn, now=t0 + timedelta(hours=4))

    [(_, occurrence, job_id)] = result.enqueued
    assert occurrence == "2026-10-20T12:00Z"
    assert [r[1:] for r in jobs_of(conn, "s")] == [
        (utc(2026, 10, 20, 12), "jobd:schedule:s:2026-10-20T12:00Z", "pending")]
    assert [(r[2].hour, r[3], r[4]) for r in ledger(conn, "s")] == [
        (9, "skipped_overlap", None), (10, "skipped_overlap", None),
        (11, "skipped_overlap", None), (12, "enqueued", job_id)]
    assert sorted(result.skipped) == [("s", f"2026-10-20T{h}:00Z") for h in ("09", "10", "11")]
    assert cursor_of(conn, "s") == utc(2026, 10, 20, 12)
    assert conn.execute("SELECT last_job_id FROM schedules WHERE id = 's'").fetchone() == (
        job_id,)


def test_a_config_files_schedule_payload_reaches_its_jobs_as_written(
    conn: psycopg.Connection,
) -> None:
    # Only a payload left out (or null) is {}; [], 0, false and "" are JSON values of their
    # own, which jobd.enqueue and a ScheduleConfig built in Python keep as they are.
    written = {"list": "[]", "zero": "0", "falsy": "false", "text": "''", "nulled": "null",
               "left": None}
    config = parse("handlers: {report: 'jobd.examples:echo'}\nschedules:\n" + "".join(
        f"  - {{id: {name}, cron: '0 * * * *', handler: report"
        + (f", payload: {payload}}}\n" if payload is not None else "}\n")
        for name, payload in written.items()))
    t0 = utc(2026, 10, 20, 8, 30)
    sync(conn, list(config.schedules), now=t0)
    tick(conn, now=t0 + timedelta(hours=1))
    payloads = dict(conn.execute(
        "SELECT split_part(idempotency_key, ':', 3), payload FROM jobs").fetchall())
    assert payloads == {"list": [], "zero": 0, "falsy": False, "text": "", "nulled": {}, "left": {}}


# --- the ledger outlives jobs --------------------------------------------------------------


def test_a_late_node_cannot_refire_an_occurrence_whose_job_was_archived(
    conn: psycopg.Connection,
) -> None:
    t0 = utc(2026, 10, 20, 12, 0, 30)
    sync(conn, [schedule("s", "*/5 * * * *")], now=t0)
    [(_, key, job_id)] = tick(conn, now=utc(2026, 10, 20, 12, 5, 5)).enqueued
    [job] = queue.claim(conn, "default", "w", 1, 60, now=utc(2026, 10, 20, 12, 5, 6))
    assert queue.complete(conn, [job.lease]).applied == [job_id]
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    assert conn.execute("SELECT state FROM jobs_archive WHERE id = %s", (job_id,)
                        ).fetchone() == ("done",)

    # A late node: its view of the cursor is from before the occurrence.
    set_cursor(conn, "s", t0)
    late = tick(conn, now=utc(2026, 10, 20, 12, 6))
    assert late.duplicates == [("s", key)] and late.enqueued == []
    assert jobs_of(conn, "s") == [
        (job_id, utc(2026, 10, 20, 12, 5), f"jobd:schedule:s:{key}", "done")]

    # Even after archive retention dropped the job and forgot its idempotency key.
    archive.drop_before(conn, db_now(conn) + timedelta(days=30))
    archive.prune_before(conn, db_now(conn) + timedelta(days=30))
    assert jobs_of(conn, "s") == []
    assert conn.execute("SELECT count(*) FROM job_keys").fetchone() == (0,)
    set_cursor(conn, "s", t0)
    again = tick(conn, now=utc(2026, 10, 20, 12, 7))
    assert again.duplicates == [("s", key)] and again.enqueued == []
    assert conn.execute("SELECT count(*) FROM all_jobs").fetchone() == (0,)
    assert len(ledger(conn, "s")) == 1


def test_a_late_node_in_the_second_pass_of_a_repeated_hour_finds_the_first_fire(
    conn: psycopg.Connection,
) -> None:
    sync(conn, [schedule("nightly", "30 2 * * *", "Europe/Berlin")], now=utc(2026, 10, 24, 22))
    first = tick(conn, now=utc(2026, 10, 25, 0, 30, 5))  # 02:30:05 +02:00
    assert [key for _, key, _ in first.enqueued] == ["2026-10-25T02:30 Europe/Berlin"]
    # Another node at 02:30:05 +01:00, one real hour later, with a stale cursor.
    set_cursor(conn, "nightly", utc(2026, 10, 24, 22))
    second = tick(conn, now=utc(2026, 10, 25, 1, 30, 5))
    assert second.enqueued == []
    assert second.duplicates == [("nightly", "2026-10-25T02:30 Europe/Berlin")]
    assert [r[1] for r in jobs_of(conn, "nightly")] == [utc(2026, 10, 25, 0, 30)]


def test_prune_ledger_keeps_ninety_days(conn: psycopg.Connection) -> None:
    sync(conn, [schedule("s", "* * * * *")])
    for days, key in ((100, "old"), (80, "recent")):
        conn.execute("INSERT INTO schedule_fires (schedule_id, occurrence, fire_at, outcome)"
                     " VALUES ('s', %s, now() - make_interval(days => %s), 'enqueued')",
                     (key, days))
    jobd.schedules.prune_ledger(conn)
    assert [r[1] for r in ledger(conn)] == ["recent"]


# --- sync ----------------------------------------------------------------------------------


def schedules_table(conn: psycopg.Connection) -> dict[str, tuple[Any, ...]]:
    rows = conn.execute("SELECT id, cron, enabled, materialized_until, updated_at FROM schedules"
                        ).fetchall()
    return {row[0]: row[1:] for row in rows}


def test_a_schedule_no_node_declares_stops_firing_and_keeps_its_ledger(
    conn: psycopg.Connection,
) -> None:
    t0 = utc(2026, 10, 20, 12, 0, 30)
    a, b = schedule("a", "*/5 * * * *"), schedule("b", "*/10 * * * *")
    assert sync(conn, [a, b], now=t0) == SyncResult(created=["a", "b"])
    assert {k: v[:3] for k, v in schedules_table(conn).items()} == {
        "a": ("*/5 * * * *", True, t0), "b": ("*/10 * * * *", True, t0)}
    tick(conn, now=utc(2026, 10, 20, 12, 10, 1))
    assert len(ledger(conn, "b")) == 1

    # The only node declaring b drops it from its config: b stops firing but is not
    # disabled, and keeps its ledger and cursor.
    assert sync(conn, [a]).withdrawn == ["b"]
    assert schedules_table(conn)["b"][1] is True
    assert len(ledger(conn, "b")) == 1 and cursor_of(conn, "b") == utc(2026, 10, 20, 12, 10)
    undeclared = tick(conn, now=utc(2026, 10, 20, 12, 20, 1))
    assert [sid for sid, _, _ in undeclared.enqueued] == ["a"]
    assert sync(conn, [a]).withdrawn == []  # already withdrawn: not reported again

    # Declared again, it resumes from its cursor under its catch-up policy (latest).
    assert sync(conn, [a, b]) == SyncResult()
    resumed = tick(conn, now=utc(2026, 10, 20, 12, 30, 1))
    assert [(sid, key) for sid, key, _ in resumed.enqueued if sid == "b"] == [
        ("b", "2026-10-20T12:30Z")]
    assert len(ledger(conn, "b")) == 2


def test_sync_of_a_changed_expression_starts_it_at_the_change(conn: psycopg.Connection) -> None:
    t0 = utc(2026, 10, 20, 12, 0, 30)
    sync(conn, [schedule("a", "*/5 * * * *")], now=t0)
    tick(conn, now=utc(2026, 10, 20, 12, 5, 1))
    cursor = cursor_of(conn, "a")
    unchanged_at = schedules_table(conn)["a"][3]
    sync(conn, [schedule("a", "*/5 * * * *")], now=utc(2026, 10, 20, 12, 10))
    assert schedules_table(conn)["a"][3] == unchanged_at  # nothing to write
    # A change of policy alone keeps the cursor: the missed */5 occurrences are still due.
    sync(conn, [schedule("a", "*/5 * * * *", catchup="all")], now=utc(2026, 10, 20, 12, 20))
    assert cursor_of(conn, "a") == cursor
    # A new expression starts at the change: its occurrences before it never were due (kept,
    # the cursor made the first tick fire every 02:30 and 14:00 since as missed).
    changed_at = utc(2026, 10, 20, 13, 30)
    sync(conn, [schedule("a", "0 2,14 * * *", "Europe/Berlin", catchup="all")],
         now=changed_at)
    cron, enabled, materialized_until, _ = schedules_table(conn)["a"]
    assert (cron, enabled, materialized_until) == ("0 2,14 * * *", True, changed_at)
    assert tick(conn, now=utc(2026, 10, 20, 13, 45)).enqueued == []  # 14:00 Berlin was 12:00Z
    result = tick(conn, now=utc(2026, 10, 21, 1))
    assert [key for _, key, _ in result.enqueued] == ["2026-10-21T02:00 Europe/Berlin"]


def test_the_job_carries_the_schedule_and_the_occurrence(conn: psycopg.Connection) -> None:
    config = ScheduleConfig(id="nightly-report", cron="30 2 * * *", timezone="Europe/Berlin",
                            handler="send_report", lane="reports", payload={"kind": "daily"},
                            priority=7)
    sync(conn, [config], now=utc(2027, 3, 28, 0))
    [(_, key, job_id)] = tick(conn, now=utc(2027, 3, 28, 1, 0, 1)).enqueued  # 03:00:01 +02:00
    assert key == "2027-03-28T02:30 Europe/Berlin"
    row = conn.execute("SELECT handler, lane, payload, priority, run_at, idempotency_key, state"
                       "  FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("send_report", "reports", {"kind": "daily"}, 7, utc(2027, 3, 28, 1),
                   "jobd:schedule:nightly-report:2027-03-28T02:30 Europe/Berlin", "pending")
    assert ledger(conn) == [("nightly-report", key, utc(2027, 3, 28, 1), "enqueued", job_id)]
    assert conn.execute("SELECT last_fire_at, last_job_id FROM schedules").fetchone() == (
        utc(2027, 3, 28, 1), job_id)


@pytest.mark.parametrize("stored", ["0 0 30 2 *", "0 22-2 * * *"])
def test_a_stored_schedule_that_cannot_be_evaluated_does_not_stop_the_others(
    conn: psycopg.Connection, stored: str,
) -> None:
    # sync refuses such an expression; an earlier release stored one (it took a reversed
    # range), and the tick skips it.
    t0 = utc(2026, 10, 20, 12, 0, 30)
    sync(conn, [schedule("bad", "0 0 * * *"), schedule("ok", "*/5 * * * *")], now=t0)
    conn.execute("UPDATE schedules SET cron = %s WHERE id = 'bad'", (stored,))
    result = tick(conn, now=utc(2026, 10, 20, 12, 5, 1))
    assert [sid for sid, _, _ in result.enqueued] == ["ok"]



def _wait_until_blocked(conn: psycopg.Connection, pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for a lock")


def test_a_sync_and_a_tick_on_another_node_do_not_deadlock(
    conn: psycopg.Connection, db_url: str
) -> None:
    configs = [schedule("b", "* * * * *"), schedule("a", "* * * * *")]  # not in id order
    sync(conn, configs, now=utc(2026, 10, 20, 12))
    with connect(db_url, autocommit=False) as syncing, \
            connect(db_url, autocommit=False) as ticking:
        syncing_pid = syncing.info.backend_pid
        with ThreadPoolExecutor(1) as pool:
            # The tick locks schedule a first; the sync, locking b first, then waits for a.
            ticking.execute("SELECT fire_schedule('a', 'x', now() - interval '1 minute')")
            done = pool.submit(lambda: (sync(syncing, configs), syncing.commit()))
            _wait_until_blocked(conn, syncing_pid)
            try:
                ticking.execute("SELECT fire_schedule('b', 'x', now() - interval '1 minute')")
                ticking.commit()
            finally:
                error = done.exception(timeout=30)
    assert error is None, repr(error)


# --- the listing of `jobd schedules list` ---------------------------------------------------


def listed_entry(**fields: Any) -> dict[str, object]:
    """A row as list_schedules returns it: declared by one node, agreeing."""
    return {"id": "s", "cron": "30 2 * * *", "timezone": "Europe/Berlin", "enabled": True,
            "declared_by": [NODE], "differing": [],
            "materialized_until": utc(2027, 3, 27), **fields}


def test_the_listing_state_of_a_schedule() -> None:
    state = jobd.schedules.listing_state
    assert state(listed_entry()) == "enabled"
    assert state(listed_entry(differing=[NODE])) == "conflict"
    assert state(listed_entry(declared_by=[])) == "undeclared"
    # The operator's flag wins over what nodes declare.
    assert state(listed_entry(enabled=False, differing=[NODE])) == "disabled"


def test_the_next_fire_follows_the_cursor_or_the_clock_whichever_is_later() -> None:
    # 02:30 does not exist in Berlin on 2027-03-28: Debian cron fires at 03:00 CEST (01:00Z).
    row = jobd.schedules.listing_row(listed_entry(), utc(2027, 3, 27, 12))
    assert (row["state"], row["next_fire_utc"]) == ("enabled", utc(2027, 3, 28, 1))
    local = row["next_fire_local"]
    assert isinstance(local, datetime) and (local.hour, local.minute) == (3, 0)
    ahead = jobd.schedules.listing_row(
        listed_entry(materialized_until=utc(2027, 3, 29, 12)), utc(2027, 3, 27, 12))
    assert ahead["next_fire_utc"] == utc(2027, 3, 30, 0, 30)


def test_only_a_schedule_that_fires_has_a_next_fire() -> None:
    for entry in (listed_entry(enabled=False), listed_entry(declared_by=[]),
                  listed_entry(cron="not a cron expression")):
        row = jobd.schedules.listing_row(entry, utc(2027, 3, 27, 12))
        assert (row["next_fire_local"], row["next_fire_utc"]) == (None, None)


def test_the_listing_judges_by_the_clock_it_is_given(conn: psycopg.Connection) -> None:
    sync(conn, [schedule("q", "*/15 * * * *")], now=utc(2026, 10, 20, 12))
    [row] = jobd.schedules.listing(conn, now=utc(2026, 10, 20, 12, 5))
    assert (row["id"], row["state"], row["next_fire_utc"]) == (
        "q", "enabled", utc(2026, 10, 20, 12, 15))
    [later] = jobd.schedules.listing(conn, now=utc(2026, 10, 20, 13, 1))
    assert later["next_fire_utc"] == utc(2026, 10, 20, 13, 15)
    # The declaration outlives the test's clocks; by the database clock it is listed too.
    [by_database] = jobd.schedules.listing(conn)
    assert by_database["state"] == "enabled"


@pytest.mark.parametrize("new_cron", ["0 * * * *", "0,30 * * * *"])
def test_a_change_after_a_downtime_fires_what_the_old_expression_owed_first(
    conn: psycopg.Connection, new_cron: str,
) -> None:
    # The only node stops at 09:55 and comes back at 10:05. With the same expression, 10:00
    # fires as missed (catchup: all); with a changed one the cursor moved to the change and
    # 10:00, due under both, was lost.
    sync(conn, [schedule("hourly", "0 * * * *", catchup="all")], now=utc(2026, 10, 20, 8, 30))
    tick(conn, now=utc(2026, 10, 20, 9, 0, 1))
    conn.execute("DELETE FROM schedule_declarations")  # the node left (withdraw)
    sync(conn, [schedule("hourly", new_cron, catchup="all")], now=utc(2026, 10, 20, 10, 5))
    tick(conn, now=utc(2026, 10, 20, 10, 5, 1))
    assert [row[1] for row in ledger(conn, "hourly")] == ["2026-10-20T09:00Z",
                                                          "2026-10-20T10:00Z"]
    # The new expression starts at the change: its 10:30 fires, nothing of it before 10:05.
    later = tick(conn, now=utc(2026, 10, 20, 10, 30, 1))
    assert [key for _, key, _ in later.enqueued] == (
        ["2026-10-20T10:30Z"] if new_cron == "0,30 * * * *" else [])
