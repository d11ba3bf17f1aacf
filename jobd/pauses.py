"""Pausing and resuming lanes, or single handlers of a lane, on every node at once.

A pause is a row in ``lane_pauses``: the claim reads it, so it holds the moment it commits,
on every node and across restarts. Running jobs finish; jobs claimed ahead into a worker's
buffer go back to the queue unstarted. The SQL functions ``jobd.pause(lane, handler)`` and
``jobd.resume(lane, handler)`` do the same from any language; both notify the lane's
supervisors, which tell its workers (see ``docs/design/queue.md``, "Pause and resume").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from jobd import caller_connection, validation
from jobd.db import DEFAULT_SCHEMA
from jobd.queries import qualified, query


@dataclass(frozen=True, slots=True)
class Pause:
    lane: str
    handler: str | None  # None: the whole lane
    paused_at: datetime
    paused_by: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _checked(lane: str, handler: str | None) -> None:
    validation.name("lane", lane)
    if handler is not None:
        validation.name("handler", handler)


def pause(conn: psycopg.Connection, lane: str, handler: str | None = None, *,
          schema: str = DEFAULT_SCHEMA) -> bool:
    """Pause ``lane``, or only ``handler``'s jobs in it; False if it was paused already.
    Takes effect when the caller's transaction commits."""
    conn = caller_connection.checked(conn, "jobd.pause")
    _checked(lane, handler)
    with caller_connection.schema_hint(schema):
        row = conn.cursor(row_factory=tuple_row).execute(
            qualified("pause_qualified", schema), {"lane": lane, "handler": handler}
        ).fetchone()
    assert row is not None
    return bool(row[0])


def resume(conn: psycopg.Connection, lane: str, handler: str | None = None, *,
           schema: str = DEFAULT_SCHEMA) -> bool:
    """End the pause that :func:`pause` with the same arguments made (the lane's own, or
    one handler's: the others stay); False if there was none."""
    conn = caller_connection.checked(conn, "jobd.resume")
    _checked(lane, handler)
    with caller_connection.schema_hint(schema):
        row = conn.cursor(row_factory=tuple_row).execute(
            qualified("resume_qualified", schema), {"lane": lane, "handler": handler}
        ).fetchone()
    assert row is not None
    return bool(row[0])


def pauses(conn: psycopg.Connection, lane: str | None = None) -> list[Pause]:
    """The pauses in force (of ``lane``, else all), by lane, the lane's own first."""
    rows = conn.execute(query("list_pauses"), {"lane": lane}).fetchall()
    return [Pause(*row) for row in rows]


def lane_known(conn: psycopg.Connection, lane: str) -> bool:
    """Whether any node runs ``lane``, or it holds live or dead jobs, or a schedule feeds it."""
    row = conn.execute(query("lane_known"), {"lane": lane}).fetchone()
    assert row is not None
    return bool(row[0])


def lane_controls(conn: psycopg.Connection, lane: str) -> tuple[bool, frozenset[str]]:
    """What a worker of ``lane`` needs: whether the lane is paused, and which handlers."""
    row = conn.execute(query("lane_controls"), {"lane": lane}).fetchone()
    assert row is not None
    return bool(row[0]), frozenset(row[1])
