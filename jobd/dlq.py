"""Operating the dead-letter queue: replay dead jobs, purge old ones."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import psycopg

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
