"""Operating the dead-letter queue: replay dead jobs (by id, or all of a handler's), purge
old ones, and quarantine: move a handler's pending jobs into it at once."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from jobd import validation
from jobd.errors import UsageError
from jobd.queries import query


def replay(
    conn: psycopg.Connection, ids: Sequence[int], now: datetime | None = None
) -> list[int]:
    """Move the dead jobs ``ids`` back to the queue, all or none.

    Raises :class:`UsageError` naming the ids that are not in the dead-letter queue; then
    nothing is replayed.
    """
    wanted = list(dict.fromkeys(ids))
    with conn.transaction():
        replayed = [row[0] for row in conn.execute(query("replay_dead"),
                                                   {"ids": wanted, "now": now})]
        missing = sorted(set(wanted) - set(replayed))
        if missing:
            raise NotInDeadLetterQueue(missing)
    return replayed


def purge(conn: psycopg.Connection, before: datetime) -> int:
    """Delete dead jobs that died before ``before``; their idempotency keys are freed."""
    row = conn.execute(query("purge_dead"), {"before": before}).fetchone()
    assert row is not None
    return int(row[0])


class NotInDeadLetterQueue(UsageError):
    """Some ids given to replay are not dead jobs; the replay was rolled back."""

    def __init__(self, missing: list[int]) -> None:
        super().__init__(
            "not in the dead-letter queue: " + ", ".join(map(str, missing)) + "; nothing replayed"
        )


def replay_handler(conn: psycopg.Connection, handler: str, lane: str | None = None,
                   now: datetime | None = None) -> list[int]:
    """Move every dead job of ``handler`` (of ``lane``, if given) back to the queue, in one
    statement; returns their ids (none is not an error: there may be none)."""
    rows = conn.execute(query("replay_dead_of_handler"),
                        {"handler": handler, "lane": lane, "now": now}).fetchall()
    return sorted(row[0] for row in rows)


def quarantine(conn: psycopg.Connection, handler: str, lane: str | None = None,
               payload_match: dict[str, Any] | None = None) -> dict[str, int]:
    """Move every pending or failed job of ``handler`` (of ``lane``; whose payload contains
    ``payload_match``) to the dead-letter queue in one statement, with an error saying it was
    quarantined. Running jobs are left alone. Returns how many moved, per lane."""
    validation.name("handler", handler)
    if lane is not None:
        validation.name("lane", lane)
    match = None if payload_match is None else Jsonb(payload_match)
    rows = conn.execute(query("quarantine"), {"handler": handler, "lane": lane,
                                              "payload_match": match}).fetchall()
    return {row[0]: int(row[1]) for row in rows}
