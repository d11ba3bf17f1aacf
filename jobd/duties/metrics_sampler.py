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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

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
                now: datetime | None = None) -> Sample:
    """Measure now: one transaction (so an idle node pays one per interval)."""
    started = time.monotonic()
    with conn.transaction():
        rows = conn.execute(query("metrics_queue_state"),
                            {"lanes": list(lanes), "now": now}).fetchall()
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
    return Sample(states, oldest_transaction, xmin_age, dead_tuples, queue_usage, pauses,
                  taken_at=finished, duration=finished - started)


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
        sample = take_sample(conn, self.lanes())
        self.latest = sample
        self.next_at = now + max(self.interval, sample.duration * DUTY_CYCLE_FACTOR)
