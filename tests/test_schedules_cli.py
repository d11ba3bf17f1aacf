"""`jobd schedules next`, `list`, `disable` and `enable`, and the conflict line of `jobd status`,
run as subprocesses."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from cli_support import UNREACHABLE, assert_one_line_error, cli, ok

import jobd.schedules
from jobd.config import ScheduleConfig
from jobd.cron import CronSchedule
from jobd.schedules import tick

NODE = "web-1:100:aaaaaa"


def sync(conn: psycopg.Connection, configs: list[ScheduleConfig], instance: str = NODE) -> None:
    """A node declaring ``configs`` on the database clock, live for the whole test."""
    jobd.schedules.sync(conn, configs, instance, ttl=3600)


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
    (("--cron", "0 0 * * FRI-MON"), "day-of-week range FRI-MON is reversed; write FRI-SAT"),
    (("--cron", "0 * * * *", "--tz", "Mars/Olympus"), "unknown time zone 'Mars/Olympus'"),
    (("--cron", "0 * * * *", "--tz", "Europe/Berlinn"), "unknown time zone 'Europe/Berlinn'"),
    (("--cron", "0 * * * *", "--tz", "Europe"), "unknown time zone 'Europe'"),
    (("--cron", "0 * * * *", "--tz", "localtime"), "time zone 'localtime' is this host's"),
    (("--cron", "0 * * * *", "--tz", "right/Europe/Berlin"), "use 'Europe/Berlin'"),
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
    """nightly (fixed time, Berlin), quarter (fired once), gone (no node declares it any
    more) and off (disabled by an operator)."""
    configs = [
        ScheduleConfig("nightly", "30 2 * * *", "send_report", timezone="Europe/Berlin"),
        ScheduleConfig("quarter", "*/15 * * * *", "h", timezone="UTC"),
        ScheduleConfig("off", "0 8 * * *", "h", timezone="UTC"),
        ScheduleConfig("gone", "0 9 * * 1-5", "h", timezone="America/New_York"),
    ]
    sync(conn, configs)
    sync(conn, configs[:3])
    jobd.schedules.set_enabled(conn, "off", False)
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
    assert sorted(rows) == ["gone", "nightly", "off", "quarter"]
    assert {k: rows["nightly"][k] for k in ("cron", "timezone", "state", "enabled",
                                            "declared_by", "differing")} == {
        "cron": "30 2 * * *", "timezone": "Europe/Berlin", "state": "enabled", "enabled": True,
        "declared_by": [NODE], "differing": []}
    assert rows["off"]["state"] == "disabled" and rows["off"]["enabled"] is False
    assert rows["gone"]["state"] == "undeclared" and rows["gone"]["enabled"] is True
    assert rows["gone"]["declared_by"] == []
    for sid in ("gone", "off"):
        assert rows[sid]["next_fire_local"] is None and rows[sid]["next_fire_utc"] is None

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
                                "(UTC)", "last", "fire", "nodes", "state"]
    by_id = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_id) == ["gone", "nightly", "off", "quarter"]
    assert "30 2 * * *" in by_id["nightly"] and "Europe/Berlin" in by_id["nightly"]
    assert by_id["nightly"].split()[-2:] == ["1", "enabled"]
    assert by_id["off"].split()[-2:] == ["1", "disabled"]
    # Local next fire with its offset, e.g. "2026-11-30 02:30:00 +01:00", then UTC.
    nightly = by_id["nightly"].split()
    assert nightly[8] == "02:30:00" and nightly[9] in ("+01:00", "+02:00")
    assert nightly[11].endswith("Z") and nightly[12] == "-"  # never fired
    # No next fire, none yet, declared by no live node.
    assert by_id["gone"].split()[-5:] == ["-", "-", "-", "0", "undeclared"]


def test_list_with_no_schedules(db_url: str) -> None:
    assert ok("schedules", "list", "--database-url", db_url).strip() == "(no schedules)"
    assert json.loads(ok("schedules", "list", "--json", "--database-url", db_url)) == []


# --- schedules disable / enable, and conflicts -----------------------------------------------


def state_of(db_url: str, schedule_id: str) -> dict[str, Any]:
    rows = json.loads(ok("schedules", "list", "--json", "--database-url", db_url))
    [row] = [row for row in rows if row["id"] == schedule_id]
    return row


def test_disable_and_enable_set_the_operators_flag_that_no_sync_overrides(
    conn: psycopg.Connection, db_url: str
) -> None:
    config = ScheduleConfig("nightly", "30 2 * * *", "send_report", timezone="Europe/Berlin")
    sync(conn, [config])
    out = ok("schedules", "disable", "nightly", "--database-url", db_url)
    assert out.strip() == ("schedule nightly disabled: no node fires it until "
                           "`jobd schedules enable nightly`")
    assert ok("schedules", "disable", "nightly", "--database-url", db_url).strip() == (
        "schedule nightly was already disabled")
    # Nodes starting with the schedule in their config leave the flag alone.
    sync(conn, [config])
    sync(conn, [config], instance="web-2:200:bbbbbb")
    row = state_of(db_url, "nightly")
    assert (row["state"], row["enabled"], row["next_fire_utc"]) == ("disabled", False, None)
    assert row["declared_by"] == [NODE, "web-2:200:bbbbbb"]

    data = json.loads(ok("schedules", "enable", "nightly", "--json", "--database-url", db_url))
    assert data == {"id": "nightly", "enabled": True, "changed": True, "declared": True}
    assert state_of(db_url, "nightly")["state"] == "enabled"
    assert ok("schedules", "enable", "nightly", "--database-url", db_url).strip() == (
        "schedule nightly was already enabled")


def test_enabling_a_schedule_no_node_declares_says_so(
    conn: psycopg.Connection, db_url: str
) -> None:
    sync(conn, [ScheduleConfig("s", "* * * * *", "h")])
    ok("schedules", "disable", "s", "--database-url", db_url)
    sync(conn, [])
    lines = ok("schedules", "enable", "s", "--database-url", db_url).splitlines()
    assert lines == ["schedule s enabled; occurrences due while it was disabled are skipped",
                     "(no live node declares s: it fires once a running node's config has it)"]
    assert state_of(db_url, "s")["state"] == "undeclared"


@pytest.mark.parametrize("action", ["disable", "enable"])
def test_an_unknown_schedule_is_a_usage_error(
    conn: psycopg.Connection, db_url: str, action: str
) -> None:
    sync(conn, [ScheduleConfig("a", "* * * * *", "h"), ScheduleConfig("b", "@daily", "h")])
    line = assert_one_line_error(cli("schedules", action, "nope", "--database-url", db_url))
    assert "no schedule 'nope'; known: a, b" in line


def test_disable_and_enable_have_help(db_url: str) -> None:
    for action, words in (("disable", "no node fires it"), ("enable", "skipped")):
        text = ok("schedules", action, "--help")
        assert words in " ".join(text.split()) and "ID" in text


def test_a_conflict_shows_in_schedules_list_and_in_status(
    conn: psycopg.Connection, db_url: str
) -> None:
    sync(conn, [ScheduleConfig("report", "30 2 * * *", "h")])
    sync(conn, [ScheduleConfig("report", "45 3 * * *", "h"), ScheduleConfig("calm", "@daily", "h")],
         instance="web-2:200:bbbbbb")
    sync(conn, [ScheduleConfig("report", "30 2 * * *", "h"),
                ScheduleConfig("calm", "@daily", "h")])
    row = state_of(db_url, "report")
    assert (row["state"], row["cron"]) == ("conflict", "30 2 * * *")  # the first one is kept
    assert row["declared_by"] == [NODE, "web-2:200:bbbbbb"]
    assert row["differing"] == ["web-2:200:bbbbbb"]
    assert row["next_fire_utc"] is not None  # it keeps firing, with the stored definition
    assert state_of(db_url, "calm")["state"] == "enabled"

    out = ok("status", "--database-url", db_url)
    tail = out.rstrip().splitlines()[-2:]
    assert tail[0] == ("schedules with conflicting definitions on live nodes (the stored one "
                       "is kept):")
    assert tail[1].split() == ["report:", "stored", "by", f"{NODE};", "differing:",
                               "web-2:200:bbbbbb"]
    status = json.loads(ok("status", "--json", "--database-url", db_url))
    assert status["schedule_conflicts"] == [
        {"schedule": "report", "stored_by": [NODE], "differing": ["web-2:200:bbbbbb"]}]


def test_status_has_no_conflict_line_without_conflicts(
    conn: psycopg.Connection, db_url: str
) -> None:
    sync(conn, [ScheduleConfig("report", "30 2 * * *", "h")])
    assert "conflicting" not in ok("status", "--database-url", db_url)


@pytest.mark.parametrize("start", ["9999-12-31T23:58:00Z", "0001-01-01T00:00:00Z"])
def test_next_near_the_calendars_ends_is_a_usage_error(start: str) -> None:
    line = assert_one_line_error(cli("schedules", "next", "--cron", "* * * * *", "--from",
                                     start, "--database-url", UNREACHABLE), 2)
    assert "too close to the calendar's end" in line


def test_next_across_a_skipped_day_leaves_the_day_out() -> None:
    # Samoa crossed the date line: 2011-12-30 never happened in Pacific/Apia. The search for
    # the end of that 24-hour jump raised a CronError: a traceback, exit 1.
    out = json.loads(ok("schedules", "next", "--cron", "0 12 * * *", "--tz", "Pacific/Apia",
                        "--from", "2011-12-28T00:00:00Z", "--count", "4", "--json",
                        "--database-url", UNREACHABLE))
    assert out == ["2011-12-28T12:00:00-10:00", "2011-12-29T12:00:00-10:00",
                   "2011-12-31T12:00:00+14:00", "2012-01-01T12:00:00+14:00"]


def test_next_refuses_a_count_it_would_have_to_build_in_memory() -> None:
    line = assert_one_line_error(cli("schedules", "next", "--cron", "* * * * *", "--count",
                                     "100000000", "--database-url", UNREACHABLE), 2)
    assert "at most 10,000" in line
    assert len(ok("schedules", "next", "--cron", "* * * * *", "--count", "10000",
                  "--database-url", UNREACHABLE).splitlines()) > 10000
