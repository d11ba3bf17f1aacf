"""What a worker counts for the node's Prometheus metrics, per handler, and how the totals
travel to the supervisor in its status report (``protocol.StatusReport.work``).

A worker keeps cumulative totals since it started: jobs claimed, outcomes, a histogram of
run times per handler, a histogram of pickup delays (claim time minus ``run_at``, both from
the database clock) and stale completions. Each report carries all of them, so a lost or
unreadable report costs nothing but a second of delay, and the supervisor can add the last
totals of a worker that ended to the node's own (``jobd.metrics``).

Handler names come from the database; any name outside the worker's allow-list is counted
as :data:`UNLISTED`, so labels stay bounded whatever a table holds.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from typing import Any

from jobd.jobs import Job

OUTCOMES = ("done", "failed", "dead", "lease_lost", "released", "cancelled")
_OUTCOME_INDEX = {name: index for index, name in enumerate(OUTCOMES)}
DONE, FAILED, DEAD, LEASE_LOST, RELEASED, CANCELLED = range(len(OUTCOMES))
UNLISTED = "unlisted"  # the handler label of jobs whose handler is not in the allow-list

# Upper bounds (seconds) of the histogram buckets; the last bucket (+Inf) is implied.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
PICKUP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0, 300.0, 900.0, 3600.0)


class Histogram:
    """Counts per bucket (not cumulative; the last one is +Inf) and the sum of the values."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # A bucket counts the values up to and including its bound (Prometheus' "le").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def observe_all(self, values: Iterable[float]) -> None:
        """:meth:`observe` each value, a negative one as zero (a claim a clock tick before
        ``run_at``); one call per batch on the worker's hot path."""
        bounds, counts, total = self.bounds, self.counts, 0.0
        for value in values:
            if value < 0.0:
                value = 0.0
            counts[bisect_left(bounds, value)] += 1
            total += value
        self.total += total

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values at or below it) per bucket, ending with +Inf."""
        running, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets

    def add(self, other: Histogram) -> None:
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be added")
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    def to_json(self) -> list[float]:
        return [*self.counts, self.total]

    @classmethod
    def from_json(cls, bounds: tuple[float, ...], data: object) -> Histogram:
        if not isinstance(data, list) or len(data) != len(bounds) + 2:
            raise ValueError(f"a histogram is {len(bounds) + 2} numbers")
        histogram = cls(bounds)
        histogram.counts = [_count(value) for value in data[:-1]]
        total = data[-1]
        if isinstance(total, bool) or not isinstance(total, int | float) or total < 0:
            raise ValueError(f"a histogram's sum must be a number >= 0, not {total!r}")
        histogram.total = float(total)
        return histogram


class HandlerWork:
    """One handler's totals: claims, outcomes (in the order of :data:`OUTCOMES`), run times."""

    __slots__ = ("claimed", "duration", "outcomes")

    def __init__(self) -> None:
        self.claimed = 0
        self.outcomes = [0] * len(OUTCOMES)
        self.duration = Histogram(DURATION_BUCKETS)

    def outcome(self, name: str) -> int:
        return self.outcomes[_OUTCOME_INDEX[name]]

    def add(self, other: HandlerWork) -> None:
        self.claimed += other.claimed
        self.outcomes = [a + b for a, b in zip(self.outcomes, other.outcomes, strict=True)]
        self.duration.add(other.duration)

    def to_json(self) -> dict[str, Any]:
        return {"claimed": self.claimed, "outcomes": self.outcomes,
                "duration": self.duration.to_json()}

    @classmethod
    def from_json(cls, data: object) -> HandlerWork:
        if not isinstance(data, dict):
            raise ValueError("a handler's totals are an object")
        work = cls()
        work.claimed = _count(data.get("claimed"))
        outcomes = data.get("outcomes")
        if not isinstance(outcomes, list) or len(outcomes) != len(OUTCOMES):
            raise ValueError(f"outcomes are {len(OUTCOMES)} counts")
        work.outcomes = [_count(value) for value in outcomes]
        work.duration = Histogram.from_json(DURATION_BUCKETS, data.get("duration"))
        return work


class WorkTotals:
    """The totals of one worker, or of a lane's workers added up."""

    __slots__ = ("handlers", "pickup", "stale_completions")

    def __init__(self) -> None:
        self.handlers: dict[str, HandlerWork] = {}
        self.pickup = Histogram(PICKUP_BUCKETS)
        self.stale_completions = 0

    def handler(self, name: str) -> HandlerWork:
        work = self.handlers.get(name)
        if work is None:
            work = self.handlers[name] = HandlerWork()
        return work

    def add(self, other: WorkTotals) -> None:
        for name, work in other.handlers.items():
            self.handler(name).add(work)
        self.pickup.add(other.pickup)
        self.stale_completions += other.stale_completions

    def to_json(self) -> dict[str, Any]:
        return {"handlers": {name: work.to_json() for name, work in self.handlers.items()},
                "pickup": self.pickup.to_json(), "stale_completions": self.stale_completions}

    @classmethod
    def from_json(cls, data: object) -> WorkTotals:
        """ValueError for anything that is not a worker's totals."""
        if not isinstance(data, dict) or not isinstance(data.get("handlers"), dict):
            raise ValueError("work totals are an object with handlers")
        totals = cls()
        for name, work in data["handlers"].items():
            totals.handlers[str(name)] = HandlerWork.from_json(work)
        totals.pickup = Histogram.from_json(PICKUP_BUCKETS, data.get("pickup"))
        totals.stale_completions = _count(data.get("stale_completions"))
        return totals


class WorkObserver:
    """The worker's side: turns claims and written outcomes into its totals. It runs on the
    worker loop's hot path, per job: one cached lookup and a few increments."""

    __slots__ = ("_by_name", "allowed", "totals", "visibility_timeout")

    def __init__(self, allowed: Iterable[str], visibility_timeout: float) -> None:
        self.allowed = frozenset(allowed)
        self.visibility_timeout = visibility_timeout
        self.totals = WorkTotals()
        self._by_name: dict[str, HandlerWork] = {}  # allowed names only, so it stays small

    def work_of(self, handler: str) -> HandlerWork:
        work = self._by_name.get(handler)
        if work is None:
            if handler not in self.allowed:
                return self.totals.handler(UNLISTED)
            work = self._by_name[handler] = self.totals.handler(handler)
        return work

    def claimed(self, jobs: Iterable[Job]) -> None:
        """Jobs a claim took. The claim's moment is its lease's start, ``lease_until`` minus
        the visibility timeout: the database clock, like ``run_at``, so the pickup delay
        needs no clock of this node and no extra column. A job enqueued due in the past
        waited from its enqueue (``created_at``), not from its ``run_at``."""
        for handler, count in Counter(job.handler for job in jobs).items():
            self.work_of(handler).claimed += count
        lease = self.visibility_timeout
        self.totals.pickup.observe_all(
            (job.lease_until - max(job.run_at, job.created_at)).total_seconds() - lease
            for job in jobs)

    def finished(self, handler: str, outcome: int, seconds: float) -> None:
        """A run ended with ``outcome`` (an index into :data:`OUTCOMES`) after ``seconds``."""
        work = self.work_of(handler)
        work.outcomes[outcome] += 1
        work.duration.observe(seconds)

    def released(self, jobs: Iterable[Job]) -> None:
        """Buffered jobs given back unstarted: an outcome, no run time."""
        for job in jobs:
            self.work_of(job.handler).outcomes[RELEASED] += 1


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a count, not {value!r}")
    return value
