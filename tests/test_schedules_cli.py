"""`jobd schedules next` and `jobd schedules list`, run as subprocesses."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from cli_support import UNREACHABLE, assert_one_line_error, cli, ok

from jobd.config import ScheduleConfig
from jobd.cron import CronSchedule
from jobd.schedules import sync, tick


def next_json(*args: str) -> list[str]:
    data = json.loads(ok("schedules", "next", *args, "--json"))
    assert isinstance(data, list) and all(isinstance(item, str) for item in data)
    return data


# --- schedules next ------------------------------------------------------------------------


def test_next_prints_iso_timestamps_with_offsets_across_the_spring_forward_night() -> None:
    data = next_json("--cron", "30 2 * * *", "--tz", "Europe/Berlin",
                     "--from", "2026-03-28T00:00:00+01:00", "--count", "3")
    assert data == ["2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00",
                    "2026-03-30T02:30:00+02:00"]
    assert all(datetime.fromisoformat(item).utcoffset() is not None for item in data)


def test_next_previews_both_passes_of_the_fall_back_night() -> None:
    assert next_json("--cron", "30 2 * * *", "--tz", "Europe/Berlin",
                     "--from", "2026-10-25T00:00:00+02:00", "--count", "2") == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]
    assert next_json("--cron", "*/30 * * * *", "--tz", "Europe/Berlin",
                     "--from", "2026-10-25T01:45:00+02:00", "--count", "5") == [
        "2026-10-25T02:00:00+02:00", "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+01:00",
        "2026-10-25T03:00:00+01:00"]


def test_next_is_strictly_after_from_and_accepts_z_and_aliases() -> None:
    assert next_json("--cron", "@daily", "--tz", "America/New_York",
                     "--from", "2026-11-01T04:00:00Z", "--count", "2") == [
        "2026-11-02T00:00:00-05:00", "2026-11-03T00:00:00-05:00"]
    assert next_json("--cron", "0 * * * *", "--from", "2026-06-01T12:00:00+00:00",
                     "--count", "1") == ["2026-06-01T13:00:00+00:00"]


def test_next_defaults_to_now_and_ten_occurrences_without_a_database() -> None:
    before = datetime.now().astimezone()
    data = json.loads(ok("schedules", "next", "--cron", "*/5 * * * *", "--json",
                         "--database-url", UNREACHABLE))
    assert len(data) == 10
    instants = [datetime.fromisoformat(item) for item in data]
    assert before < instants[0] <= before + timedelta(minutes=5, seconds=5)
    assert instants == sorted(instants)


def test_next_table_shows_local_utc_and_the_occurrence_key() -> None:
    out = ok("schedules", "next", "--cron", "30 2 * * *", "--tz", "Europe/Berlin",
             "--from", "2026-03-28T12:00:00+01:00", "--count", "1")
    lines = out.splitlines()
    assert lines[0] == "30 2 * * * in Europe/Berlin (fixed time: once per local time)"
    assert lines[1].split() == ["local", "UTC", "occurrence", "key"]
    assert lines[2].split() == ["2026-03-29", "03:00:00", "+02:00", "2026-03-29",
                                "01:00:00.000Z", "2026-03-29T02:30", "Europe/Berlin"]


@pytest.mark.parametrize(("args", "expected"), [
    (("--cron", "61 * * * *"), "invalid cron expression '61 * * * *'"),
    (("--cron", "* * * *"), "expected 5 fields"),
    (("--cron", "* * * * * *"), "expected 5 fields"),
    (("--cron", "nonsense"), "invalid cron expression 'nonsense'"),
    (("--cron", "0 * * * *", "--tz", "Mars/Olympus"), "unknown time zone 'Mars/Olympus'"),
    (("--cron", "0 * * * *", "--tz", "Europe/Berlinn"), "unknown time zone 'Europe/Berlinn'"),
    (("--cron", "0 * * * *", "--from", "2026-01-01T00:00:00"), "has no UTC offset"),
    (("--cron", "0 * * * *", "--from", "tomorrow"), "--from"),
    (("--cron", "0 * * * *", "--count", "0"), "--count"),
    (("--tz", "UTC",), "--cron"),
])
def test_next_rejects_bad_input_with_one_line_and_exit_2(
    args: tuple[str, ...], expected: str
) -> None:
    assert expected in assert_one_line_error(cli("schedules", "next", *args))


def test_next_rejects_an_expression_that_never_fires() -> None:
    assert "0 0 30 2 *" in assert_one_line_error(cli("schedules", "next", "--cron", "0 0 30 2 *"))


# --- schedules list ------------------------------------------------------------------------


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def synced(conn: psycopg.Connection) -> None:
    """nightly (fixed time, Berlin), quarter (fired once) and gone (disabled)."""
    configs = [
        ScheduleConfig("nightly", "30 2 * * *", "send_report", timezone="Europe/Berlin"),
        ScheduleConfig("quarter", "*/15 * * * *", "h", timezone="UTC"),
        ScheduleConfig("gone", "0 9 * * 1-5", "h", timezone="America/New_York"),
    ]
    sync(conn, configs)
    sync(conn, configs[:2])
    conn.execute("UPDATE schedules SET materialized_until = now() - interval '20 minutes'"
                 " WHERE id = 'quarter'")
    assert [sid for sid, _, _ in tick(conn).enqueued] == ["quarter"]


def expected_next(expression: str, zone: str, before: datetime, after: datetime
                  ) -> set[datetime]:
    cron = CronSchedule.parse(expression, zone)
    return {cron.next_after(moment)[0].fire_at for moment in (before, after)}


def test_list_json_shows_expression_zone_next_fire_last_fire_and_state(
    conn: psycopg.Connection, db_url: str
) -> None:
    synced(conn)
    before = db_now(conn)
    data = json.loads(ok("schedules", "list", "--json", "--database-url", db_url))
    after = db_now(conn)
    rows: dict[str, dict[str, Any]] = {row["id"]: row for row in data}
    assert sorted(rows) == ["gone", "nightly", "quarter"]
    assert {k: rows["nightly"][k] for k in ("cron", "timezone", "state", "enabled")} == {
        "cron": "30 2 * * *", "timezone": "Europe/Berlin", "state": "enabled", "enabled": True}
    assert rows["gone"]["state"] == "disabled" and rows["gone"]["enabled"] is False
    assert rows["gone"]["next_fire_local"] is None and rows["gone"]["next_fire_utc"] is None

    for sid, expression, zone in (("nightly", "30 2 * * *", "Europe/Berlin"),
                                  ("quarter", "*/15 * * * *", "UTC")):
        local = datetime.fromisoformat(rows[sid]["next_fire_local"])
        utc = datetime.fromisoformat(rows[sid]["next_fire_utc"])
        assert local == utc and local.utcoffset() == utc.astimezone(
            CronSchedule.parse(expression, zone).zone).utcoffset()
        assert utc in expected_next(expression, zone, before, after)
    assert rows["nightly"]["last_fire_at"] is None
    last = datetime.fromisoformat(rows["quarter"]["last_fire_at"])
    assert before - timedelta(minutes=15) < last <= before and last.minute % 15 == 0


def test_list_table_has_one_row_per_schedule(conn: psycopg.Connection, db_url: str) -> None:
    synced(conn)
    lines = ok("schedules", "list", "--database-url", db_url).splitlines()
    assert lines[0].split() == ["id", "cron", "zone", "next", "fire", "(local)", "next", "fire",
                                "(UTC)", "last", "fire", "state"]
    by_id = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_id) == ["gone", "nightly", "quarter"]
    assert "30 2 * * *" in by_id["nightly"] and "Europe/Berlin" in by_id["nightly"]
    assert by_id["nightly"].split()[-1] == "enabled" and by_id["gone"].split()[-1] == "disabled"
    # Local next fire with its offset, e.g. "2026-11-30 02:30:00 +01:00", then UTC.
    nightly = by_id["nightly"].split()
    assert nightly[8] == "02:30:00" and nightly[9] in ("+01:00", "+02:00")
    assert nightly[11].endswith("Z") and nightly[12] == "-"  # never fired
    assert by_id["gone"].split()[-4:] == ["-", "-", "-", "disabled"]  # no next fire, none yet


def test_list_with_no_schedules(db_url: str) -> None:
    assert ok("schedules", "list", "--database-url", db_url).strip() == "(no schedules)"
    assert json.loads(ok("schedules", "list", "--json", "--database-url", db_url)) == []
