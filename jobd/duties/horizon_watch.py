"""Warns when something holds back vacuum on jobd's tables: the cause of most "the queue got
slow" incidents. While a transaction (or a replication slot, or a prepared transaction)
keeps the xmin horizon back, none of the dead rows that every claimed and finished job
leaves can be removed; claims stay cheap (``jobd.claim_floors``), but the table and its
indexes grow until it ends. The warning names the holder, so the operator can end it.

It also warns while autovacuum is switched off for ``jobs`` (the server's ``autovacuum`` or
``track_counts``, or the table's ``autovacuum_enabled``): then nothing removes those rows at
all, unless the operator runs VACUUM by hand, and the table grows by tens of thousands of
dead rows a minute under load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psycopg
import structlog

from jobd.duties import Periodic
from jobd.queries import query

log = structlog.get_logger("jobd.duties.horizon_watch")

# A replication slot has no age in seconds; this many transactions behind is worth a word.
SLOT_WARNING_XIDS = 10_000_000
# While the same holder stays, the warning repeats this often (seconds), not every turn.
REPEAT_EVERY = 300.0
# While autovacuum stays off, its warning repeats this often (seconds): a setting the
# operator may have chosen (vacuuming by hand), worth a reminder, not a stream.
AUTOVACUUM_REPEAT_EVERY = 3600.0


@dataclass(frozen=True, slots=True)
class Holder:
    kind: str
    pid: int | None
    name: str | None  # application name, prepared transaction id or slot name
    state: str | None
    age_seconds: float | None
    age_xids: int | None

    def over(self, threshold_seconds: float) -> bool:
        if self.age_seconds is not None:
            return self.age_seconds >= threshold_seconds
        return self.age_xids is not None and self.age_xids >= SLOT_WARNING_XIDS


class HorizonWatch(Periodic):
    name = "horizon watch"

    def __init__(self, interval: Callable[[], float], threshold: Callable[[], float]) -> None:
        super().__init__(interval)
        self.threshold = threshold
        self.warned: dict[tuple[str, int | None, str | None], float] = {}
        self.autovacuum_off: tuple[str, ...] = ()  # the reasons last warned of
        self.autovacuum_warned = 0.0
        self.clock = 0.0

    def run(self, conn: psycopg.Connection, now: float) -> None:
        self.clock = now
        super().run(conn, now)

    def work(self, conn: psycopg.Connection, now: float) -> None:
        self._watch_holders(conn)
        self._watch_autovacuum(conn)

    def _watch_autovacuum(self, conn: psycopg.Connection) -> None:
        reasons = tuple(row[0] for row in conn.execute(query("autovacuum_switched_off")))
        if not reasons:
            if self.autovacuum_off:
                log.info("autovacuum is on again for jobd.jobs")
            self.autovacuum_off = ()
            return
        if (reasons == self.autovacuum_off
                and self.clock - self.autovacuum_warned < AUTOVACUUM_REPEAT_EVERY):
            return
        self.autovacuum_off, self.autovacuum_warned = reasons, self.clock
        log.warning("autovacuum is off for jobd.jobs: nothing removes the dead rows every "
                    "job leaves unless VACUUM is run by hand; the table and its indexes grow "
                    "and claims slow down", reasons=list(reasons))

    def _watch_holders(self, conn: psycopg.Connection) -> None:
        holders = [Holder(*row) for row in conn.execute(query("horizon_holders")).fetchall()]
        over = [h for h in holders if h.over(self.threshold())]
        current = {(h.kind, h.pid, h.name) for h in over}
        for key in set(self.warned) - current:
            del self.warned[key]
            log.info("vacuum horizon released", kind=key[0], pid=key[1], name=key[2])
        for holder in over:
            key = (holder.kind, holder.pid, holder.name)
            if self.clock - self.warned.get(key, -REPEAT_EVERY) < REPEAT_EVERY:
                continue
            self.warned[key] = self.clock
            log.warning("vacuum is held back: dead jobs cannot be removed until it ends",
                        kind=holder.kind, pid=holder.pid, name=holder.name,
                        state=holder.state,
                        age_seconds=None if holder.age_seconds is None
                        else round(holder.age_seconds, 1),
                        age_xids=holder.age_xids)
