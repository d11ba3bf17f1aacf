"""Cron occurrences and the DST policy (jobd.cron), and catch-up planning (jobd.schedules.plan).

Pure: no database. cronsim, which implements Debian cron's DST handling on aware datetimes,
is the reference; where it and jobd deliberately differ, a minute-by-minute scan of real time
is the judge.
"""

from __future__ import annotations

import itertools
import random
import zoneinfo
from datetime import UTC, date, datetime, timedelta

import cronsim
import pytest
from croniter import croniter

from jobd.cron import ALIASES, CronError, CronSchedule, Occurrence
from jobd.schedules import CATCHUP_ALL_LIMIT, NONE_GRACE, plan

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
NEW_YORK = zoneinfo.ZoneInfo("America/New_York")

# Local dates of the DST nights: (zone, spring forward, fall back).
DST_NIGHTS = {
    "Europe/Berlin": [(date(2026, 3, 29), date(2026, 10, 25)),
                      (date(2027, 3, 28), date(2027, 10, 31))],
    "America/New_York": [(date(2026, 3, 8), date(2026, 11, 1)),
                         (date(2027, 3, 14), date(2027, 11, 7))],
}
DST_EXPRESSIONS = ["30 2 * * *", "30 1 * * *", "0 * * * *", "*/15 * * * *", "0 */2 * * *"]


def local(zone: str | zoneinfo.ZoneInfo, *fields: int, fold: int = 0) -> datetime:
    tz = zoneinfo.ZoneInfo(zone) if isinstance(zone, str) else zone
    return datetime(*fields, tzinfo=tz, fold=fold)  # type: ignore[misc]


def local_day(tz: zoneinfo.ZoneInfo, day: date) -> tuple[datetime, datetime]:
    """The local day as an (after, until] window: midnight to the next midnight.

    Arithmetic on aware datetimes of one zone is wall-clock arithmetic, so the day's length
    (23, 24 or 25 hours) comes from the zone, not from a timedelta.
    """
    following = day + timedelta(days=1)
    return (local(tz, day.year, day.month, day.day),
            local(tz, following.year, following.month, following.day))


def ours(schedule: CronSchedule, after: datetime, count: int) -> list[datetime]:
    """``count`` fire instants after ``after``, in steps (next_after looks 30 years ahead)."""
    found: list[datetime] = []
    while len(found) < count:
        batch = schedule.next_after(found[-1] if found else after, count - len(found))
        if not batch:
            break
        found.extend(o.fire_at for o in batch)
    return found


def reference(expression: str, zone: str, after: datetime, count: int) -> list[datetime]:
    """cronsim's fire instants: it iterates aware local datetimes, strictly after the start."""
    start = after.astimezone(zoneinfo.ZoneInfo(zone))
    walker = cronsim.CronSim(ALIASES.get(expression, expression), start)
    return [moment.astimezone(UTC) for moment in itertools.islice(walker, count)]


def occurrences_until(schedule: CronSchedule, after: datetime, until: datetime
                      ) -> list[Occurrence]:
    """Every occurrence in (after, until], found with next_after alone."""
    found: list[Occurrence] = []
    cursor = after
    while True:
        batch = schedule.next_after(cursor, 50)
        found.extend(o for o in batch if o.fire_at <= until)
        if not batch or batch[-1].fire_at > until:
            return found
        cursor = batch[-1].fire_at


def real_time_scan(expression: str, zone: str, start: datetime, end: datetime
                   ) -> list[datetime]:
    """Every UTC minute in (start, end] whose local wall time matches: firing by real time.

    Only for expressions whose day, month and weekday fields are ``*``.
    """
    assert expression.split()[2:] == ["*", "*", "*"], expression
    expanded = croniter(expression).expanded
    minutes, hours = set(expanded[0]), set(expanded[1])
    tz = zoneinfo.ZoneInfo(zone)
    found = []
    moment = start.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while moment <= end:
        wall = moment.astimezone(tz)
        if (wall.minute in minutes or "*" in minutes) and (wall.hour in hours or "*" in hours):
            found.append(moment)
        moment += timedelta(minutes=1)
    return found


def fmt(instants: list[datetime], zone: str) -> list[str]:
    return [i.astimezone(zoneinfo.ZoneInfo(zone)).isoformat() for i in instants]


# --- DST nights against cronsim ------------------------------------------------------------


@pytest.mark.parametrize("expression", DST_EXPRESSIONS)
@pytest.mark.parametrize(("zone", "night"), [
    (zone, night) for zone, years in DST_NIGHTS.items() for pair in years for night in pair])
def test_dst_nights_match_cronsim(expression: str, zone: str, night: date) -> None:
    schedule = CronSchedule.parse(expression, zone)
    start = local(zone, night.year, night.month, night.day) - timedelta(days=1)
    end = start + timedelta(days=3)
    expected = [t for t in reference(expression, zone, start, 500) if t <= end]
    got = [o.fire_at for o in occurrences_until(schedule, start, end)]
    assert fmt(got, zone) == fmt(expected, zone)


@pytest.mark.parametrize("zone", sorted(DST_NIGHTS))
@pytest.mark.parametrize("year_index", [0, 1])
def test_spring_forward_a_skipped_fixed_time_fires_once_right_after_the_jump(
    zone: str, year_index: int
) -> None:
    night = DST_NIGHTS[zone][year_index][0]
    tz = zoneinfo.ZoneInfo(zone)
    schedule = CronSchedule.parse("30 2 * * *", zone)
    fires = schedule.between(*local_day(tz, night))  # a 23-hour day
    assert len(fires) == 1
    assert fires[0].local(tz).replace(tzinfo=None) == datetime(
        night.year, night.month, night.day, 3, 0)
    assert fires[0].local(tz).utcoffset() == local(tz, night.year, 7, 1).utcoffset()
    # Its identity is the wall time it was scheduled for, not the one it ran at.
    assert fires[0].key == f"{night:%Y-%m-%d}T02:30 {zone}"


@pytest.mark.parametrize("zone", sorted(DST_NIGHTS))
@pytest.mark.parametrize("year_index", [0, 1])
def test_fall_back_a_repeated_fixed_time_fires_once_at_the_first_pass(
    zone: str, year_index: int
) -> None:
    night = DST_NIGHTS[zone][year_index][1]
    tz = zoneinfo.ZoneInfo(zone)
    summer = local(tz, night.year, 7, 1).utcoffset()
    # The repeated hour is 02:00-03:00 in Berlin and 01:00-02:00 in New York.
    hour = 2 if zone == "Europe/Berlin" else 1
    schedule = CronSchedule.parse(f"30 {hour} * * *", zone)
    fires = schedule.between(*local_day(tz, night))  # a 25-hour day
    assert len(fires) == 1
    fired = fires[0].local(tz)
    assert (fired.hour, fired.minute, fired.utcoffset()) == (hour, 30, summer)
    assert fires[0].key == f"{night:%Y-%m-%d}T{hour:02d}:30 {zone}"
    # Asked again from between the two passes, nothing is left to fire that night.
    between_passes = local(tz, night.year, night.month, night.day, hour, 45, fold=1)
    assert schedule.next_after(between_passes)[0].local(tz).date() == night + timedelta(days=1)


def test_fall_back_30_1_in_berlin_is_not_ambiguous_and_fires_in_summer_time() -> None:
    schedule = CronSchedule.parse("30 1 * * *", "Europe/Berlin")
    [fire] = schedule.between(local(BERLIN, 2026, 10, 25), local(BERLIN, 2026, 10, 26))
    assert fire.local(BERLIN).isoformat() == "2026-10-25T01:30:00+02:00"


@pytest.mark.parametrize(("zone", "repeated_hour", "night"), [
    ("Europe/Berlin", 2, date(2026, 10, 25)), ("Europe/Berlin", 2, date(2027, 10, 31)),
    ("America/New_York", 1, date(2026, 11, 1)), ("America/New_York", 1, date(2027, 11, 7))])
def test_every_15_minutes_fires_through_both_passes_of_a_repeated_hour(
    zone: str, repeated_hour: int, night: date
) -> None:
    tz = zoneinfo.ZoneInfo(zone)
    schedule = CronSchedule.parse("*/15 * * * *", zone)
    fires = schedule.between(*local_day(tz, night))  # 25 hours
    in_hour = [o for o in fires if o.local(tz).hour == repeated_hour]
    assert [o.local(tz).isoformat()[11:] for o in in_hour] == [
        f"{repeated_hour:02d}:{m:02d}:00{off}"
        for off in (fmt_offset(tz, night, 0), fmt_offset(tz, night, 1))
        for m in (0, 15, 30, 45)]
    assert len({o.key for o in in_hour}) == 8
    assert all(b.fire_at - a.fire_at == timedelta(minutes=15) for a, b in itertools.pairwise(fires))
    assert len(fires) == 25 * 4


def fmt_offset(tz: zoneinfo.ZoneInfo, night: date, fold: int) -> str:
    return local(tz, night.year, night.month, night.day, 12).replace(
        month=7 if fold == 0 else 12).isoformat()[-6:]


@pytest.mark.parametrize(("zone", "night"), [
    ("Europe/Berlin", date(2026, 3, 29)), ("Europe/Berlin", date(2027, 3, 28)),
    ("America/New_York", date(2026, 3, 8)), ("America/New_York", date(2027, 3, 14))])
def test_every_15_minutes_does_not_fire_in_a_skipped_hour(zone: str, night: date) -> None:
    tz = zoneinfo.ZoneInfo(zone)
    schedule = CronSchedule.parse("*/15 * * * *", zone)
    fires = schedule.between(*local_day(tz, night))  # 23 hours
    assert [o for o in fires if o.local(tz).hour == 2] == []
    assert len(fires) == 23 * 4
    assert all(b.fire_at - a.fire_at == timedelta(minutes=15) for a, b in itertools.pairwise(fires))


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize("expression", ["30 2 * * *", "30 1 * * *", "0 0 * * *", "59 23 * * *"])
def test_a_daily_schedule_fires_once_per_local_day_for_a_whole_year(
    zone: str, expression: str
) -> None:
    tz = zoneinfo.ZoneInfo(zone)
    schedule = CronSchedule.parse(expression, zone)
    fires = schedule.between(local(tz, 2026, 1, 1) - timedelta(seconds=1),
                             local(tz, 2027, 1, 1) - timedelta(seconds=1))
    dates = [o.local(tz).date() for o in fires]
    assert len(fires) == 365
    assert sorted(set(dates)) == dates
    assert dates[0] == date(2026, 1, 1) and dates[-1] == date(2026, 12, 31)
    # Fixed-time keys are the local wall times, one per day, never repeated.
    minute, hour = expression.split()[:2]
    assert len({o.key for o in fires}) == 365
    assert [o.key for o in fires] == [
        f"{d:%Y-%m-%d}T{int(hour):02d}:{int(minute):02d} {zone}" for d in dates]


def test_a_wildcard_hour_step_does_not_keep_its_interval_through_dst_nights() -> None:
    # As docs/design/schedules.md's table says (and cronsim agrees): only schedules that fire
    # at least hourly keep their interval; an hour step follows the wall clock.
    schedule = CronSchedule.parse("0 */2 * * *", "Europe/Berlin")
    fall = schedule.next_after(datetime(2026, 10, 24, 21, 30, tzinfo=UTC), 4)
    assert [o.fire_at.strftime("%d %H:%M") for o in fall] == [
        "24 22:00", "25 00:00", "25 01:00", "25 03:00"]
    spring = schedule.next_after(datetime(2026, 3, 28, 22, 30, tzinfo=UTC), 2)
    assert [o.fire_at.strftime("%d %H:%M") for o in spring] == ["28 23:00", "29 02:00"]


def test_wildcard_keys_are_utc_instants_and_unique_through_a_repeated_hour() -> None:
    schedule = CronSchedule.parse("0 * * * *", "Europe/Berlin")
    fires = schedule.between(*local_day(BERLIN, date(2026, 10, 25)))
    assert len(fires) == 25
    assert [o.key for o in fires] == [o.fire_at.strftime("%Y-%m-%dT%H:%MZ") for o in fires]
    assert [(o.local(BERLIN).isoformat(), o.key) for o in fires[1:3]] == [
        ("2026-10-25T02:00:00+02:00", "2026-10-25T00:00Z"),
        ("2026-10-25T02:00:00+01:00", "2026-10-25T01:00Z")]


# --- where cronsim is not the reference ----------------------------------------------------


def test_two_fixed_times_in_one_skipped_hour_are_two_occurrences_at_the_same_instant() -> None:
    """Debian cron runs each skipped fixed-time minute after the jump; cronsim runs one."""
    schedule = CronSchedule.parse("0,30 2 * * *", "Europe/Berlin")
    fires = schedule.between(local(BERLIN, 2026, 3, 29), local(BERLIN, 2026, 3, 29, 12))
    assert [(o.local(BERLIN).isoformat(), o.key) for o in fires] == [
        ("2026-03-29T03:00:00+02:00", "2026-03-29T02:00 Europe/Berlin"),
        ("2026-03-29T03:00:00+02:00", "2026-03-29T02:30 Europe/Berlin"),
    ]
    start = local(BERLIN, 2026, 3, 29)
    assert fmt(reference("0,30 2 * * *", "Europe/Berlin", start, 1), "Europe/Berlin") == [
        "2026-03-29T03:00:00+02:00"]
    assert fmt(reference("0,30 2 * * *", "Europe/Berlin", start, 2), "Europe/Berlin")[1] == (
        "2026-03-30T02:00:00+02:00")


@pytest.mark.parametrize(("expression", "night", "missing_in_cronsim"), [
    # Fall back 02:00 +11:00 -> 01:30 +10:30: 01:30 repeats, 02:00 happens once, at 15:30Z.
    ("30 * * * *", datetime(2026, 4, 4, 12, tzinfo=UTC), "2026-04-05T01:30:00+10:30"),
    ("0 */2 * * *", datetime(2026, 4, 4, 12, tzinfo=UTC), "2026-04-05T02:00:00+10:30"),
    # Spring forward 02:00 +10:30 -> 02:30 +11:00: 02:30 exists, at the instant of the jump.
    ("30 * * * *", datetime(2026, 10, 3, 12, tzinfo=UTC), "2026-10-04T02:30:00+11:00"),
])
def test_lord_howe_half_hour_shift_fires_by_real_time_where_cronsim_misses(
    expression: str, night: datetime, missing_in_cronsim: str
) -> None:
    zone = "Australia/Lord_Howe"
    end = night + timedelta(days=1)
    got = fmt([o.fire_at for o in CronSchedule.parse(expression, zone).between(night, end)], zone)
    assert got == fmt(real_time_scan(expression, zone, night, end), zone)
    assert missing_in_cronsim in got
    assert missing_in_cronsim not in fmt(
        [t for t in reference(expression, zone, night, 100) if t <= end], zone)


WILDCARD_SCAN_ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
                       "America/St_Johns", "Asia/Kolkata"]


@pytest.mark.parametrize("zone", WILDCARD_SCAN_ZONES)
@pytest.mark.parametrize("expression", ["*/15 * * * *", "30 * * * *", "0 */2 * * *",
                                        "*/7 1-3 * * *", "* 2 * * *"])
def test_wildcard_schedules_fire_at_every_instant_whose_wall_time_matches(
    zone: str, expression: str
) -> None:
    schedule = CronSchedule.parse(expression, zone)
    assert schedule.wildcard
    tz = zoneinfo.ZoneInfo(zone)
    for instant in _transitions(tz, 2026):
        start, end = instant - timedelta(hours=4), instant + timedelta(hours=4)
        expected = real_time_scan(expression, zone, start, end)
        assert fmt([o.fire_at for o in schedule.between(start, end)], zone) == fmt(expected, zone)


def _transitions(tz: zoneinfo.ZoneInfo, year: int) -> list[datetime]:
    found, moment = [], datetime(year, 1, 1, tzinfo=UTC)
    offset = moment.astimezone(tz).utcoffset()
    while moment.year == year:
        moment += timedelta(minutes=30)
        if moment.astimezone(tz).utcoffset() != offset:
            found.append(moment)
            offset = moment.astimezone(tz).utcoffset()
    return found or [datetime(year, 6, 1, tzinfo=UTC)]


# --- between and next_after agree ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_between_agrees_with_next_after_over_random_windows(seed: int) -> None:
    rng = random.Random(seed)
    expressions = ["30 2 * * *", "30 1 * * *", "0 * * * *", "*/15 * * * *", "0,30 2 * * *",
                   "0 9 * * 1-5", "*/7 * * * *", "15 3 1 * *"]
    zones = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"]
    for _ in range(40):
        schedule = CronSchedule.parse(rng.choice(expressions), rng.choice(zones))
        # Windows start near a DST night half of the time.
        if rng.random() < 0.5:
            base = rng.choice([datetime(2026, 3, 28, 20, tzinfo=UTC),
                               datetime(2026, 10, 24, 20, tzinfo=UTC),
                               datetime(2026, 11, 1, 2, tzinfo=UTC),
                               datetime(2026, 4, 4, 12, tzinfo=UTC)])
        else:
            base = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(days=rng.uniform(0, 700))
        after = base + timedelta(seconds=rng.randrange(0, 12 * 3600))
        until = after + timedelta(seconds=rng.choice([0, 1, 59, 60, 900, 3600, 86400, 7 * 86400])
                                  * rng.random())
        full = schedule.between(after, until)
        context = (schedule.expression, schedule.zone.key, after, until)
        assert full == occurrences_until(schedule, after, until), context
        assert all(after < o.fire_at <= until for o in full)
        for last in (1, 2, 5, 100):
            assert schedule.between(after, until, last=last) == full[-last:], (context, last)


def test_between_with_last_zero_is_empty() -> None:
    schedule = CronSchedule.parse("*/15 * * * *", "UTC")
    start = datetime(2026, 6, 1, tzinfo=UTC)
    assert schedule.between(start, start + timedelta(days=1), last=0) == []


def test_bounds_are_exclusive_after_and_inclusive_until() -> None:
    schedule = CronSchedule.parse("*/15 * * * *", "UTC")
    at = datetime(2026, 6, 1, 12, 15, tzinfo=UTC)
    assert [o.fire_at for o in schedule.between(at - timedelta(minutes=15), at)] == [at]
    assert schedule.between(at, at + timedelta(minutes=14)) == []
    assert schedule.next_after(at)[0].fire_at == at + timedelta(minutes=15)
    assert schedule.next_after(at - timedelta(microseconds=1))[0].fire_at == at


# --- a broader cross-check with cronsim ----------------------------------------------------


CROSS_EXPRESSIONS = ["0 9 * * 1-5", "15 3 1 * *", "0 0 29 2 *", "*/7 * * * *", "0 12 * * 0",
                     "5 4 * * sun", "@hourly", "@daily"]
CROSS_ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"]


@pytest.mark.parametrize("zone", CROSS_ZONES)
@pytest.mark.parametrize("expression", CROSS_EXPRESSIONS)
def test_a_few_hundred_occurrences_match_cronsim(expression: str, zone: str) -> None:
    schedule = CronSchedule.parse(expression, zone)
    count = 120 if expression == "0 0 29 2 *" else 300  # 120 leap days: 480 years
    # Start a few days before each of the zone's DST changes (or on New Year in zones
    # without), so that the hourly and minutely expressions cross them.
    for instant in _transitions(zoneinfo.ZoneInfo(zone), 2026):
        start = instant - timedelta(days=3, minutes=17)
        expected = reference(expression, zone, start, count)
        assert len(expected) == count
        assert fmt(ours(schedule, start, count), zone) == fmt(expected, zone), start


def test_leap_day_schedule_skips_century_years_that_are_not_leap_years() -> None:
    schedule = CronSchedule.parse("0 0 29 2 *", "UTC")
    years = [t.year for t in ours(schedule, datetime(2096, 1, 1, tzinfo=UTC), 3)]
    assert years == [2096, 2104, 2108]


# --- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("expression", ["61 * * * *", "* * * *", "* * * * * *", "nonsense", "",
                                        "* 24 * * *", "0 0 32 * *", "0 0 * 13 *", "@sometimes"])
def test_invalid_expressions_are_rejected(expression: str) -> None:
    with pytest.raises(CronError, match="invalid cron expression"):
        CronSchedule.parse(expression, "UTC")


@pytest.mark.parametrize("expression", ["R 2 * * *", "r 2 * * *", "R/5 * * * *",
                                        "R(0-30) 2 * * *", "0 R * * *", "0 2 * * R"])
def test_random_fields_are_rejected(expression: str) -> None:
    # croniter draws R anew at each evaluation: a tick, a node, each saw another minute.
    with pytest.raises(CronError, match="R \\(random\\) is not supported"):
        CronSchedule.parse(expression, "UTC")


@pytest.mark.parametrize("expression", ["0 2 * * FRI", "0 2 * MAR *", "0 2 * * FRI,SAT"])
def test_names_with_an_r_are_still_names(expression: str) -> None:
    schedule = CronSchedule.parse(expression, "UTC")
    assert schedule.expression == expression
    assert schedule.next_after(datetime(2026, 1, 1, tzinfo=UTC))[0].fire_at.hour == 2


@pytest.mark.parametrize(("expression", "message"), [
    ("0 22-2 * * *", "hour range 22-2 is reversed; write 22-23,0-2"),
    ("50-10 * * * *", "minute range 50-10 is reversed; write 50-59,0-10"),
    ("0 0 25-5 * *", "day-of-month range 25-5 is reversed; write 25-31,1-5"),
    ("0 0 1 11-2 *", "month range 11-2 is reversed; write 11-12,1-2"),
    ("0 0 1 NOV-FEB *", "month range NOV-FEB is reversed; write NOV-DEC,JAN-FEB"),
    ("0 0 * * FRI-MON", "day-of-week range FRI-MON is reversed; write FRI-SAT,SUN-MON"),
    ("0 0 * * thu-tue", "day-of-week range thu-tue is reversed; write THU-SAT,SUN-TUE"),
    ("0 0 * * 1-5,6-2", "day-of-week range 6-2 is reversed; write 6,0-2"),
    # With a step, the values it stepped to across the wrap.
    ("0 22-2/2 * * *", "hour range 22-2/2 is reversed; write 22,0,2"),
    ("50-10/15 * * * *", "minute range 50-10/15 is reversed; write 50,5"),
    # Sunday starting a range is day 0; 7 starts none.
    ("0 0 * * 7-1", "day-of-week range 7-1 is reversed; write 0-1"),
    ("0 0 * * 7-3/2", "day-of-week range 7-3/2 is reversed; write 0-3/2"),
])
def test_a_reversed_range_is_refused_with_how_to_write_it(expression: str, message: str
                                                          ) -> None:
    # croniter wraps it (22-2 is 22,23,0,1,2); cron and systemd do not, and a mistyped
    # 5-1 for 1-5 would fire on days nobody meant.
    with pytest.raises(CronError) as caught:
        CronSchedule.parse(expression, "UTC")
    assert str(caught.value) == f"invalid cron expression {expression!r}: {message}"


def test_a_reversed_range_out_of_bounds_is_just_invalid() -> None:
    with pytest.raises(CronError, match=r"^invalid cron expression '0 25-2 \* \* \*'$"):
        CronSchedule.parse("0 25-2 * * *", "UTC")


@pytest.mark.parametrize(("expression", "normalized"), [
    ("0 5-5 * * *", "0 5 * * *"), ("5-5 * * * *", "5 * * * *"), ("0 0 5-5 * *", "0 0 5 * *"),
    ("0 0 1 JAN-JAN *", "0 0 1 JAN *"), ("0 0 * * 0-0", "0 0 * * 0"),
    ("0 0 * * 7-7", "0 0 * * 7"), ("0 0 * * SUN-SUN", "0 0 * * SUN"),
    ("5-5/10 * * * *", "5 * * * *"), ("0 1,3-3,5 * * *", "0 1,3,5 * * *"),
    # Ranges ending on Sunday as 7 are not reversed and stay as written.
    ("0 0 * * 7-0", "0 0 * * 7"),
    # Ranges ending on Sunday as 7 are not reversed and stay as written.
    ("0 0 * * 0-7", "0 0 * * 0-7"), ("0 0 * * SUN-SAT", "0 0 * * SUN-SAT"),
    ("0 0 * * 5-7", "0 0 * * 5-7"), ("0 0 * * MON-7", "0 0 * * MON-7"),
    ("0 0 * * 1-7/2", "0 0 * * 1-7/2"), ("0 0 * * 3-7/2", "0 0 * * 3-7/2"),
])
def test_equal_ranges_and_sunday_as_seven_fire_as_in_cron(expression: str, normalized: str
                                                          ) -> None:
    # croniter reads an equal range as the whole cycle: 0 5-5 * * * fired every hour.
    schedule = CronSchedule.parse(expression, "UTC")
    assert schedule.expression == normalized
    after = datetime(2026, 1, 1, tzinfo=UTC)
    assert ours(schedule, after, 20) == reference(normalized, "UTC", after, 20)


@pytest.mark.parametrize(("expression", "as_seven"), [
    ("0 0 * * FRI-SUN", "0 0 * * 5-7"), ("0 0 * * sat-sun", "0 0 * * 6-7"),
    ("0 0 * * MON-SUN", "0 0 * * 1-7"), ("0 0 * * 5-0", "0 0 * * 5-7"),
    ("0 0 * * 1-0/2", "0 0 * * 1-7/2"), ("0 0 * * 2-SUN/2", "0 0 * * 2-7/2"),
])
def test_sunday_ending_a_range_is_day_seven(expression: str, as_seven: str) -> None:
    # Not reversed: Sunday also ends the week. cronsim (like cronie) knows it only as 7.
    schedule = CronSchedule.parse(expression, "UTC")
    after = datetime(2026, 1, 1, tzinfo=UTC)
    assert ours(schedule, after, 20) == reference(as_seven, "UTC", after, 20)


def test_an_equal_range_up_to_the_last_day_is_that_day() -> None:
    assert CronSchedule.parse("0 0 31-L * *", "UTC").expression == "0 0 31 * *"


@pytest.mark.parametrize("zone", ["Mars/Olympus", "Europe/Berlinn", "", "../../etc/passwd",
                                  "CEST", "Europe", "America"])
def test_unknown_zones_are_rejected(zone: str) -> None:
    with pytest.raises(CronError, match="unknown time zone"):
        CronSchedule.parse("0 * * * *", zone)


@pytest.mark.parametrize(("zone", "reason"), [
    ("localtime", "this host's own zone"), ("posixrules", "not a zone"),
    ("right/Europe/Berlin", "counts leap seconds"), ("right/UTC", "counts leap seconds")])
def test_zone_files_that_are_not_a_shared_zone_are_rejected(zone: str, reason: str) -> None:
    # Each loads as a zone where the zone database has it: localtime would put one
    # occurrence key at another instant on each node, and right/ zones change their offset
    # 27 s late (a */30 schedule in right/Europe/Berlin fired at 02:00 on 2026-03-29, a wall
    # time Berlin skips).
    with pytest.raises(CronError, match=reason):
        CronSchedule.parse("*/30 * * * *", zone)


@pytest.mark.parametrize("expression", ["0 0 30 2 *", "0 0 31 4 *"])
def test_an_expression_that_never_fires_is_a_cron_error(expression: str) -> None:
    # Refused when parsed: a schedule that can never fire must not reach the sync.
    with pytest.raises(CronError, match="matches no date"):
        CronSchedule.parse(expression, "UTC")


def test_parse_normalizes_aliases_and_classifies_fixed_and_wildcard() -> None:
    assert CronSchedule.parse("@daily", "UTC").expression == "0 0 * * *"
    assert CronSchedule.parse(" @hourly ", "UTC").expression == "0 * * * *"
    assert not CronSchedule.parse("30 2 * * *", "UTC").wildcard
    assert not CronSchedule.parse("0,30 1-3 * * *", "UTC").wildcard
    assert CronSchedule.parse("*/15 2 * * *", "UTC").wildcard
    assert CronSchedule.parse("0 */2 * * *", "UTC").wildcard


# --- catch-up planning ---------------------------------------------------------------------


NOW = datetime(2026, 6, 10, 12, 2, 30, tzinfo=UTC)  # 150 s after the last */5 occurrence


@pytest.mark.parametrize(("expression", "zone", "behind"), [
    ("*/5 * * * *", "UTC", timedelta(hours=3)),
    ("*/5 * * * *", "UTC", timedelta(days=4)),
    ("30 2 * * *", "Europe/Berlin", timedelta(days=3)),
    ("30 2 * * *", "Europe/Berlin", timedelta(days=200)),
])
def test_catchup_latest_fires_only_the_newest_missed(
    expression: str, zone: str, behind: timedelta
) -> None:
    schedule = CronSchedule.parse(expression, zone)
    missed = schedule.between(NOW - behind, NOW)
    assert len(missed) > 1
    assert plan(schedule, "latest", NOW - behind, NOW).fire == [missed[-1]]
    assert plan(schedule, "latest", NOW - behind, NOW).advance_to is None


@pytest.mark.parametrize(("expression", "zone", "expected"), [
    ("0 2,3 * * *", "Europe/Berlin",
     ["2026-03-29T02:00 Europe/Berlin", "2026-03-29T03:00 Europe/Berlin"]),
    ("0,30 2 * * *", "Europe/Berlin",
     ["2026-03-29T02:00 Europe/Berlin", "2026-03-29T02:30 Europe/Berlin"]),
    ("0 2 * * *", "America/New_York", ["2026-03-08T02:00 America/New_York"]),
])
def test_catchup_latest_fires_every_occurrence_that_shares_the_newest_instant(
    expression: str, zone: str, expected: list[str]
) -> None:
    # Spring forward: fixed times in the gap move to the instant after the jump, each its
    # own occurrence; keeping one of them lost the others for good (the cursor moves past).
    schedule = CronSchedule.parse(expression, zone)
    jump = schedule.between(datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 3, 30, tzinfo=UTC))
    jump_at = next(o.fire_at for o in jump if o.key == expected[0])
    for cursor in (jump_at - timedelta(minutes=1), jump_at - timedelta(days=2)):
        fired = plan(schedule, "latest", cursor, jump_at + timedelta(seconds=5)).fire
        assert [o.key for o in fired] == expected
        assert {o.fire_at for o in fired} == {jump_at}


@pytest.mark.parametrize(("expression", "zone", "behind", "expected_count"), [
    ("*/5 * * * *", "UTC", timedelta(hours=3), 36),
    ("*/5 * * * *", "UTC", timedelta(days=4), CATCHUP_ALL_LIMIT),
    ("30 2 * * *", "Europe/Berlin", timedelta(days=3), 3),
    ("30 2 * * *", "Europe/Berlin", timedelta(days=200), CATCHUP_ALL_LIMIT),
])
def test_catchup_all_fires_every_missed_up_to_the_newest_hundred_in_order(
    expression: str, zone: str, behind: timedelta, expected_count: int
) -> None:
    schedule = CronSchedule.parse(expression, zone)
    missed = schedule.between(NOW - behind, NOW)
    planned = plan(schedule, "all", NOW - behind, NOW)
    assert len(planned.fire) == expected_count == min(len(missed), CATCHUP_ALL_LIMIT)
    assert planned.fire == missed[-expected_count:]
    assert planned.fire == sorted(planned.fire)


@pytest.mark.parametrize("catchup", ["latest", "all", "none"])
def test_under_overlap_skip_the_newest_is_fired_first(catchup: str) -> None:
    # Skip runs only the first occurrence fired while the others are due with it.
    schedule = CronSchedule.parse("*/5 * * * *", "UTC")
    for behind in (timedelta(hours=3), timedelta(seconds=150)):
        allowed = plan(schedule, catchup, NOW - behind, NOW)
        skipping = plan(schedule, catchup, NOW - behind, NOW, overlap="skip")
        assert skipping.fire == allowed.fire[::-1]
        assert skipping.advance_to == allowed.advance_to


@pytest.mark.parametrize("behind", [timedelta(hours=3), timedelta(days=4)])
def test_catchup_none_skips_what_is_older_than_the_grace_and_advances_the_cursor(
    behind: timedelta
) -> None:
    schedule = CronSchedule.parse("*/5 * * * *", "UTC")
    planned = plan(schedule, "none", NOW - behind, NOW)
    assert planned.fire == []
    assert planned.advance_to == NOW - NONE_GRACE

    just_after = datetime(2026, 6, 10, 12, 0, 30, tzinfo=UTC)  # 30 s late: within the grace
    planned = plan(schedule, "none", just_after - behind, just_after)
    assert [o.fire_at for o in planned.fire] == [datetime(2026, 6, 10, 12, 0, tzinfo=UTC)]
    assert planned.advance_to == just_after - NONE_GRACE


def test_catchup_none_when_not_behind_fires_normally_and_leaves_the_cursor() -> None:
    schedule = CronSchedule.parse("*/5 * * * *", "UTC")
    cursor = datetime(2026, 6, 10, 11, 59, 50, tzinfo=UTC)
    planned = plan(schedule, "none", cursor, cursor + timedelta(seconds=20))
    assert [o.fire_at for o in planned.fire] == [datetime(2026, 6, 10, 12, 0, tzinfo=UTC)]
    assert planned.advance_to is None


@pytest.mark.parametrize("catchup", ["latest", "all", "none"])
def test_nothing_is_planned_when_the_cursor_is_at_or_ahead_of_now(catchup: str) -> None:
    schedule = CronSchedule.parse("* * * * *", "UTC")
    assert plan(schedule, catchup, NOW, NOW).fire == []
    assert plan(schedule, catchup, NOW + timedelta(minutes=5), NOW).fire == []


def test_unknown_catchup_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="catch-up"):
        plan(CronSchedule.parse("* * * * *", "UTC"), "some", NOW - timedelta(hours=1), NOW)


def test_hourly_fires_every_real_hour_of_a_dst_year() -> None:
    """By real time: 8760 fires in 2026, one hour apart, whatever the zone does to its clocks."""
    for zone in ("Europe/Berlin", "America/New_York"):
        fires = CronSchedule.parse("0 * * * *", zone).between(
            datetime(2025, 12, 31, 23, 59, tzinfo=UTC), datetime(2026, 12, 31, 23, 59, tzinfo=UTC))
        assert len(fires) == 8760
        assert {b.fire_at - a.fire_at for a, b in itertools.pairwise(fires)} == {
            timedelta(hours=1)}
