"""Cron occurrences in a time zone, with an explicit daylight-saving policy. Pure: no I/O.

croniter does the expression arithmetic on local wall-clock time (naive datetimes); this
module turns each wall-clock occurrence into instants following Debian cron's policy
(docs/design/schedules.md):

- A **fixed-time** schedule (neither the minute nor the hour field starts with ``*``, e.g.
  ``30 2 * * *``) fires once per local occurrence. A wall time skipped by a spring-forward
  jump fires at the first instant after the jump; a wall time repeated by a fall-back fires
  at its first pass only. Its occurrence key is the local wall time, so the two instants of
  a repeated 01:30 share one key and cannot both fire.
- A **wildcard** schedule (``*/15 * * * *``, ``0 * * * *``) fires by real time: at every
  instant whose local wall time matches. It keeps firing through both passes of a repeated
  hour and does not fire for wall times that do not exist. Its key is the UTC instant.
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo

from croniter import CroniterBadDateError, croniter

# The largest wall-clock shift a zone makes at once (Debian cron's threshold, too). Searches
# look this far past their bounds so that instants come out in true order.
MAX_SHIFT = timedelta(hours=3)
# How far ahead to look for the next occurrence before calling an expression impossible
# (e.g. 0 0 30 2 *: February 30th).
HORIZON = timedelta(days=366 * 30)

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


# croniter's random field (R, R/5, R(0-30)): not a schedule.
_RANDOM = re.compile(r"^R($|[/(])", re.IGNORECASE)

# One range of a field's list (22-2, FRI-MON, 22-2/2). Other shapes (*, 5, */15, 5/15) are
# croniter's alone to judge.
_RANGE = re.compile(r"^(?P<low>[0-9a-z]+)-(?P<high>[0-9a-z]+)(?:/(?P<step>[0-9]+))?$",
                    re.IGNORECASE)
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


@dataclass(frozen=True, slots=True)
class _Field:
    """One of the five fields: its name in messages, its bounds and the names it takes."""

    name: str
    first: int
    last: int
    names: dict[str, int]

    def value(self, text: str) -> int | None:
        """A bound's number (names by number, day-of-week 7 stays 7), None if unknown."""
        return int(text) if text.isdigit() else self.names.get(text.lower())

    def spell(self, value: int, as_name: bool) -> str:
        if as_name:
            return next(name for name, number in self.names.items() if number == value).upper()
        return str(value)


_FIELDS = (
    _Field("minute", 0, 59, {}),
    _Field("hour", 0, 23, {}),
    _Field("day-of-month", 1, 31, {"l": 31}),
    _Field("month", 1, 12, {name: number for number, name in enumerate(_MONTHS, 1)}),
    _Field("day-of-week", 0, 6, {name: number for number, name in enumerate(_DAYS)}),
)
_DAY_OF_WEEK = _FIELDS[4]


class CronError(ValueError):
    """An invalid expression or time zone; the message says which and why."""


# Files of the zone database that load as zones but are not one every node reads alike.
# "localtime" is the host's own zone (a link to /etc/localtime): each node would put the same
# occurrence key at its own instant. "posixrules" is the rules file for POSIX TZ strings.
# The right/ tree counts leap seconds in its transition times, which zoneinfo reads as UTC
# seconds: every change lands 27 s late, so a fixed 02:30 fired at 03:01 on a spring-forward
# night, and a wildcard schedule fired at 02:00, a wall time that does not exist.
_HOST_ZONES = {"localtime": "this host's own zone, which another node may not share",
               "posixrules": "the rules file for POSIX TZ strings, not a zone"}
_LEAP_SECOND_TREE = "right/"


def time_zone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA time zone ``name``; CronError for anything else. A folder of the zone
    database (``Europe``) is not a zone: ZoneInfo raises IsADirectoryError for it."""
    if name in _HOST_ZONES:
        raise CronError(f"time zone {name!r} is {_HOST_ZONES[name]}; use an IANA name like "
                        "Europe/Berlin")
    if name.startswith(_LEAP_SECOND_TREE):
        raise CronError(f"time zone {name!r} counts leap seconds, which put its offset "
                        f"changes off by seconds; use {name.removeprefix(_LEAP_SECOND_TREE)!r}")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError(
            f"unknown time zone {name!r} (use an IANA name like Europe/Berlin)") from None


@dataclass(frozen=True, slots=True, order=True)
class Occurrence:
    fire_at: datetime  # the instant (UTC)
    key: str  # deterministic identity of the occurrence, for deduplication

    def local(self, zone: tzinfo) -> datetime:
        return self.fire_at.astimezone(zone)


@dataclass(frozen=True, slots=True)
class CronSchedule:
    expression: str
    zone: zoneinfo.ZoneInfo
    wildcard: bool

    @classmethod
    def parse(cls, expression: str, timezone: str = "UTC") -> CronSchedule:
        fields = ALIASES.get(expression.strip(), expression).split()
        if len(fields) != 5:
            raise CronError(
                f"invalid cron expression {expression!r}: expected 5 fields "
                "(minute hour day-of-month month day-of-week) or an alias like @daily")
        normalized = " ".join(fields)
        if any(_RANDOM.match(field) for field in fields):
            # croniter draws R again at every evaluation: each tick, and each node, would
            # find another minute, each a new occurrence (a new ledger key).
            raise CronError(f"invalid cron expression {expression!r}: R (random) is not "
                            "supported; pick the time")
        if not croniter.is_valid(normalized):
            raise CronError(f"invalid cron expression {expression!r}")
        try:
            fields = [_plain_ranges(field, text)
                      for field, text in zip(_FIELDS, fields, strict=True)]
        except ValueError as exc:
            raise CronError(f"invalid cron expression {expression!r}: {exc}") from None
        normalized = " ".join(fields)
        try:
            croniter(normalized, datetime(2000, 1, 1)).get_next(datetime)
        except CroniterBadDateError:
            raise CronError(
                f"cron expression {expression!r} matches no date (e.g. February 30th)"
            ) from None
        zone = time_zone(timezone)
        wildcard = fields[0].startswith("*") or fields[1].startswith("*")
        return cls(normalized, zone, wildcard)

    # --- wall clock to instants ------------------------------------------------------------

    def _instants(self, wall: datetime) -> list[Occurrence]:
        """The occurrences of one wall-clock match (0, 1 or 2 of them)."""
        first = wall.replace(tzinfo=self.zone, fold=0)
        second = wall.replace(tzinfo=self.zone, fold=1)
        exists = _round_trips(first) or _round_trips(second)
        if not exists:
            end_of_gap = None if self.wildcard else self._end_of_gap(wall)
            if end_of_gap is None:
                # By real time, a wall time that never happens does not fire; nor does a
                # fixed time in a jump longer than a DST change.
                return []
            return [Occurrence(end_of_gap, self._local_key(wall))]
        instants = sorted({first.astimezone(UTC), second.astimezone(UTC)})
        if self.wildcard:
            return [Occurrence(instant, _utc_key(instant)) for instant in instants]
        return [Occurrence(instants[0], self._local_key(wall))]

    def _end_of_gap(self, wall: datetime) -> datetime | None:
        """The first instant after the spring-forward jump that skipped ``wall``; None for a
        jump longer than MAX_SHIFT. Those are a zone crossing the date line (Pacific/Apia
        skipped 2011-12-30) or a station changing zones: Debian cron takes a jump that long
        for a clock change and runs no fixed-time job of the skipped time, and the search
        margins, MAX_SHIFT wide, would not keep such an instant in order."""
        probe = wall
        for _ in range(int(MAX_SHIFT / timedelta(minutes=1)) + 1):
            probe += timedelta(minutes=1)
            candidate = probe.replace(second=0, microsecond=0, tzinfo=self.zone)
            if _round_trips(candidate):
                return candidate.astimezone(UTC)
        return None

    def _local_key(self, wall: datetime) -> str:
        return wall.strftime("%Y-%m-%dT%H:%M") + " " + self.zone.key

    # --- searches --------------------------------------------------------------------------

    def _walls(self, start: datetime, forward: bool) -> Iterator[datetime]:
        walker = croniter(self.expression, start)
        step = walker.get_next if forward else walker.get_prev
        while True:
            yield step(datetime)

    def _wall(self, instant: datetime) -> datetime:
        return instant.astimezone(self.zone).replace(tzinfo=None)

    def _margin(self, instant: datetime) -> timedelta:
        """MAX_SHIFT if the zone's offset changes within MAX_SHIFT of ``instant``, else 0.

        Near a change, wall-clock order and real-time order can disagree, so searches look
        past their bounds; elsewhere they need not (a */1 schedule then costs a few steps).
        """
        before = (instant - MAX_SHIFT).astimezone(self.zone).utcoffset()
        after = (instant + MAX_SHIFT).astimezone(self.zone).utcoffset()
        return MAX_SHIFT if before != after else timedelta(0)

    def next_after(self, after: datetime, count: int = 1) -> list[Occurrence]:
        """The first ``count`` occurrences strictly after ``after``, in order."""
        found: list[Occurrence] = []
        horizon = self._wall(after) + HORIZON
        start = self._wall(after) - self._margin(after) - timedelta(minutes=1)
        for wall in self._walls(start, forward=True):
            if len(found) >= count:
                last = sorted(found)[count - 1].fire_at
                if wall > self._wall(last) + self._margin(last):
                    break
            if wall > horizon:
                break
            found.extend(o for o in self._instants(wall) if o.fire_at > after)
        return sorted(found)[:count]

    def between(self, after: datetime, until: datetime, last: int | None = None
                ) -> list[Occurrence]:
        """Occurrences in ``(after, until]`` in order; with ``last``, only the latest ones.

        Searches backwards from ``until``, so catching up after a long downtime costs what
        the occurrences kept cost, not what the downtime was.
        """
        if last == 0:
            return []
        found: list[Occurrence] = []
        floor = self._wall(after) - self._margin(after)
        start = self._wall(until) + self._margin(until) + timedelta(minutes=1)
        for wall in self._walls(start, forward=False):
            if wall < floor:
                break
            if last is not None and len(found) >= last:
                earliest_kept = sorted(found)[-last].fire_at
                if wall < self._wall(earliest_kept) - self._margin(earliest_kept):
                    break
            found.extend(o for o in self._instants(wall) if after < o.fire_at <= until)
        found.sort()
        return found if last is None else found[-last:]


def _plain_ranges(field: _Field, text: str) -> str:
    """``text`` (one field, already valid for croniter) with its ranges meaning what they
    mean to cron; ValueError for a reversed range.

    croniter departs from cron in two ways that silently fire at times nobody wrote. A
    reversed range wraps (hour 22-2 is 22,23,0,1,2; day-of-week 5-1, a mistyped 1-5, fires
    Friday to Monday) where cronie refuses it. An equal range means the whole cycle (hour
    5-5 fires every hour) where cron reads the one value.
    """
    return ",".join(_plain_range(field, token) for token in text.split(","))


def _plain_range(field: _Field, token: str) -> str:
    match = _RANGE.match(token)
    if match is None:
        return token
    low, high = field.value(match["low"]), field.value(match["high"])
    if low is None or high is None:
        return token
    if field is _DAY_OF_WEEK and high == 0 and low != 0:
        # Sunday ending a range ends the week (FRI-SUN, 5-0): day 7, as croniter reads it.
        high = 7
    if low == high:
        return match["low"]
    if low > high:
        as_names = match["low"].isalpha() and match["high"].isalpha()
        step = int(match["step"]) if match["step"] else None
        raise ValueError(f"{field.name} range {token} is reversed; write "
                         f"{_unwrapped(field, low, high, step, as_names)}")
    return token


def _unwrapped(field: _Field, low: int, high: int, step: int | None, as_names: bool) -> str:
    """What a reversed range meant, written without wrapping: 22-2 as 22-23,0-2, 22-2/2 as
    22,0,2 (the steps continue across the wrap), day-of-week 7-1 as 0-1 (both Sunday)."""
    def span(first: int, last: int) -> str:
        if first == last:
            return field.spell(first, as_names)
        return f"{field.spell(first, as_names)}-{field.spell(last, as_names)}"

    if field is _DAY_OF_WEEK and low == 7:
        return span(0, high) + (f"/{step}" if step else "")
    if step is None:
        return f"{span(low, field.last)},{span(field.first, high)}"
    size = field.last - field.first + 1
    values = [(low - field.first + offset) % size + field.first
              for offset in range(0, (high - low) % size + 1, step)]
    return ",".join(field.spell(value, as_names) for value in values)


def _round_trips(aware: datetime) -> bool:
    """Whether an aware local time exists: converting to UTC and back gives it again."""
    back = aware.astimezone(UTC).astimezone(aware.tzinfo)
    return back.replace(tzinfo=None) == aware.replace(tzinfo=None)


def _utc_key(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%MZ")
