"""The clock that jobd.testing's helpers judge "due" by.

Every statement that compares time takes a ``now`` parameter (jobd/sql/queries.sql): NULL
means the database clock, an instant means that instant. A :class:`Clock` decides what the
helpers pass there, so a test moves time for delayed jobs, retries and schedules without
sleeping and without touching the machine's clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import psycopg
from psycopg.rows import tuple_row

from jobd.queries import query


def _duration(by: timedelta | float) -> timedelta:
    return by if isinstance(by, timedelta) else timedelta(seconds=by)


def _aware(at: datetime) -> datetime:
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"a clock needs an aware datetime (with a time zone), not {at!r}")
    return at


class Clock:
    """The database clock, moved forward by ``advance``, or frozen at an instant.

    ``Clock()`` follows the database clock (``now()``; inside a test's open transaction
    that is the transaction's start, the instant ``jobd.enqueue(..., delay=...)`` counts
    from). ``advance(timedelta(minutes=5))`` moves it ahead of the database by that much;
    ``freeze(at)`` stops it at ``at``, after which ``advance`` moves the frozen instant.
    """

    def __init__(self, at: datetime | None = None) -> None:
        self._frozen: datetime | None = None if at is None else _aware(at)
        self._offset = timedelta(0)

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    def freeze(self, at: datetime) -> Clock:
        """Stop the clock at ``at`` (an aware datetime); returns the clock."""
        self._frozen = _aware(at)
        self._offset = timedelta(0)
        return self

    def advance(self, by: timedelta | float) -> Clock:
        """Move the clock forward by ``by`` (a timedelta or seconds); returns the clock."""
        step = _duration(by)
        if step < timedelta(0):
            raise ValueError(f"a clock only moves forward, not by {step}")
        if self._frozen is not None:
            self._frozen += step
        else:
            self._offset += step
        return self

    def reset(self) -> Clock:
        """Follow the database clock again."""
        self._frozen = None
        self._offset = timedelta(0)
        return self

    def now(self, conn: psycopg.Connection) -> datetime:
        """The clock's instant: the frozen one, else the database's ``now()`` (on ``conn``)
        plus what the clock was advanced by."""
        if self._frozen is not None:
            return self._frozen
        # database_clock names no table: it runs on any connection, whatever its search_path;
        # read as a tuple, whatever row factory the test's connection has.
        row = conn.cursor(row_factory=tuple_row).execute(
            query("database_clock"), {"now": None}).fetchone()
        assert row is not None
        return row[0] + self._offset

    def parameter(self, conn: psycopg.Connection) -> datetime | None:
        """What jobd's statements take as ``now``: None while the clock is the database's
        own, so those statements read ``now()`` themselves, exactly as in production."""
        if self._frozen is None and not self._offset:
            return None
        return self.now(conn)

    def __repr__(self) -> str:
        if self._frozen is not None:
            return f"Clock(frozen at {self._frozen.isoformat()})"
        return f"Clock(database clock + {self._offset})" if self._offset else "Clock()"
