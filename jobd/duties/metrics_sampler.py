"""The metrics sampler: the queue-state and database-hazard gauges of the node's Prometheus
metrics, measured once per sampling interval on the supervisor's connection, never per
scrape (a scrape reads the last sample; ``jobd.metrics``).

One transaction, three statements (``metrics_queue_state``, ``metrics_database_hazards``,
``list_pauses``):
per configured lane the live jobs by state, the oldest due job's wait and the DLQ depth, from
index scans of the live table and the dead-letter queue (the archive is never read); then the
oldest open transaction, the xmin horizon, the hot table's dead tuples and the notification
queue's fill; then the lanes and handlers paused. Its cost grows with the number of live
jobs of the lanes, not with history, and is bounded in time: after a sample that took long,
the next waits :data:`DUTY_CYCLE_FACTOR` times as long, so sampling never takes more than 5 %
of one backend.

The per-lane counts are shared by the fleet (``queue_samples``, migration 0016): a node
whose lanes another node counted within the sampling interval uses those counts, so the
backlog is counted about once per interval however many nodes export the gauges.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from jobd.duties import Duty
from jobd.queries import query

SAMPLE_INTERVAL = 5.0  # seconds between samples
DUTY_CYCLE_FACTOR = 20.0  # the pause after a sample is at least this many times its duration

# The states of jobd_queue_depth: due (claimable now), scheduled (pending, later), retrying
# (failed, waiting for its retry), claimed (running or buffered by a worker).
DEPTH_STATES = ("due", "scheduled", "retrying", "claimed")


@dataclass(frozen=True, slots=True)
class LaneState:
    depth: dict[str, int]  # by DEPTH_STATES
    dead: int
    oldest_unclaimed_age: float  # seconds the oldest due job has waited; 0 without one


@dataclass(frozen=True, slots=True)
class Sample:
    lanes: dict[str, LaneState]
    oldest_transaction_age: float  # seconds
    xmin_horizon_age: int  # transaction ids
    jobs_dead_tuples: int
    notification_queue_usage: float  # 0..1
    # The pauses in force (jobd.pause): (lane, handler), handler None for the whole lane.
    pauses: tuple[tuple[str, str | None], ...]
    taken_at: float  # monotonic
    duration: float  # seconds the sample took, round trips included


def take_sample(conn: psycopg.Connection, lanes: Iterable[str],
                now: datetime | None = None, max_age: float = 0.0) -> Sample:
    """Measure now: one transaction (so an idle node pays one per interval).

    With ``max_age``, the lanes' counts that any node stored less than that many seconds ago
    are used instead of counting again (the fleet shares them: ``queue_samples``); what this
    call counts it stores for the others. The database hazards are always this node's own
    reading (they are cheap and per backend)."""
    wanted = list(lanes)
    started = time.monotonic()
    with conn.transaction():
        # And the lanes that have had jobs lately (lane_priorities) though no config here names
        # them: a lane that no node serves must show in the gauges, or no alert can see it.
        wanted += [lane for (lane,) in conn.execute(query("lanes_enqueued_to"))
                   if lane not in wanted]
        rows, age = _shared_counts(conn, wanted, now, max_age)
        if rows is None:
            rows = conn.execute(query("metrics_queue_state"),
                                {"lanes": wanted, "now": now}).fetchall()
            _store_counts(conn, rows, now)
            age = 0.0
        hazards = conn.execute(query("metrics_database_hazards")).fetchone()
        pauses = tuple((lane, handler) for lane, handler, _at, _by
                       in conn.execute(query("list_pauses"), {"lane": None}))
    assert hazards is not None
    states = {}
    for lane, due, scheduled, retrying, claimed, dead, oldest in rows:
        depth = {"due": due, "scheduled": scheduled, "retrying": retrying, "claimed": claimed}
        states[lane] = LaneState(depth, dead, oldest)
    finished = time.monotonic()
    oldest_transaction, xmin_age, dead_tuples, queue_usage = hazards
    # A shared count is as old as when it was taken: the sample age gauge says so.
    return Sample(states, oldest_transaction, xmin_age, dead_tuples, queue_usage, pauses,
                  taken_at=finished - age, duration=finished - started)


def _shared_counts(conn: psycopg.Connection, lanes: list[str], now: datetime | None,
                   max_age: float) -> tuple[list[tuple[Any, ...]] | None, float]:
    """Every lane's counts from another node's recent sample, and the oldest one's age; or
    None when any lane has none recent enough (then the node counts them all itself)."""
    if max_age <= 0 or not lanes:
        return None, 0.0
    found = conn.execute(query("shared_queue_state"),
                         {"lanes": lanes, "now": now, "max_age": max_age}).fetchall()
    if {row[0] for row in found} != set(lanes):
        return None, 0.0
    return sorted(row[:7] for row in found), max(row[7] for row in found)


def _store_counts(conn: psycopg.Connection, rows: list[tuple[Any, ...]],
                  now: datetime | None) -> None:
    if not rows:
        return
    columns = list(zip(*rows, strict=True))
    conn.execute(query("store_queue_state"), {
        "lanes": list(columns[0]), "due": list(columns[1]), "scheduled": list(columns[2]),
        "retrying": list(columns[3]), "claimed": list(columns[4]), "dead": list(columns[5]),
        "oldest": list(columns[6]), "now": now})


class MetricsSampler(Duty):
    name = "metrics sampler"
    alone = True  # read-only; a failed sample must not roll back the shared duties

    def __init__(self, lanes: Callable[[], Iterable[str]],
                 interval: float = SAMPLE_INTERVAL) -> None:
        super().__init__()
        self.lanes = lanes
        self.interval = interval
        self.latest: Sample | None = None

    def run(self, conn: psycopg.Connection, now: float) -> None:
        self.next_at = now + self.interval  # a failed sample waits for the next turn
        # Counts another node took within the interval are as good as this node's own.
        sample = take_sample(conn, self.lanes(), max_age=self.interval)
        self.latest = sample
        self.next_at = now + max(self.interval, sample.duration * DUTY_CYCLE_FACTOR)
