"""Which workers to wake, and when: the decisions between the LISTEN connection (and the
duties that learn of due work) and the workers' wake pipes. Pure: no I/O.

Everything that says "lane L may have work" ends here: a notification (``lane#n``: n jobs
due now; ``lane@t``: the earliest job is due at t), a retry the supervisor recorded, the
fallback poll, a schedule's fire, suspects left by a crash; and the news every worker of a
lane must hear (``lane!pause``, ``lane!cancel``). :meth:`WakeRouter.route` then
picks the workers to poke: as many as the due jobs need, least loaded first, because waking
every worker for one job makes all but one claim nothing, and on a small machine those empty
claims compete with the job for CPU.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Protocol, TypeVar

from jobd import protocol
from jobd.wakeup import Wakeup

WAKE_MARGIN = 0.01  # seconds past a due instant, for the error of the measured clock offset


class Wakeable(Protocol):
    """What routing needs to know of a worker process."""

    retiring: bool
    # The router's estimate of work it sent since the worker's last report, or since it last
    # ran out of work (its run board's idle count, read before routing): so an idle lane's
    # wake-ups go to the worker that has just finished, warm, not to each worker in turn.
    wake_load: int

    # Read only: the router never sets them (a worker process computes them).
    @property
    def lane(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def busy(self) -> int: ...


W = TypeVar("W", bound=Wakeable)


class WakeRouter:
    def __init__(self) -> None:
        # The database clock, kept as an offset from the monotonic clock and never from the
        # wall clock: a step of this node's wall clock (NTP, a resumed VM, an operator) must
        # not move the timers between two measurements. Until the first measurement, the
        # wall clock is taken to be right.
        self._db_minus_monotonic = time.time() - time.monotonic()
        self._at: dict[str, float] = {}  # lane -> monotonic instant of its earliest due work
        self._now: dict[str, int | None] = {}  # lane -> jobs due (None: wake every worker)
        self._suspects: set[str] = set()
        self._suspects_at: list[tuple[float, str]] = []  # (monotonic instant, lane), a heap
        self._news: dict[str, set[bytes]] = {}  # lane -> bytes for every worker of it

    # --- the database clock ------------------------------------------------------------

    def measured_db_clock(self, db_epoch: float, at: float | None = None) -> None:
        """The database clock read ``db_epoch`` at monotonic instant ``at`` (default: now;
        a node heartbeat's round trip)."""
        self._db_minus_monotonic = db_epoch - (time.monotonic() if at is None else at)

    def db_epoch(self, now: float | None = None) -> float:
        """The database clock at monotonic instant ``now`` (default: now), as last measured."""
        return (time.monotonic() if now is None else now) + self._db_minus_monotonic

    @property
    def db_clock_offset(self) -> float:
        """Database epoch minus this node's wall-clock epoch, now."""
        return self.db_epoch() - time.time()

    @db_clock_offset.setter
    def db_clock_offset(self, offset: float) -> None:
        self.measured_db_clock(time.time() + offset)

    # --- what is due ----------------------------------------------------------------------

    def due_now(self, lane: str, count: int | None = None) -> None:
        """``count`` jobs of ``lane`` are due (None: unknown, wake every worker)."""
        pending = self._now.get(lane, 0)
        self._now[lane] = None if count is None or pending is None else pending + count

    def due_everywhere(self, lanes: Iterable[str]) -> None:
        for lane in lanes:
            self.due_now(lane)

    def due_at(self, lane: str, at_epoch: float) -> None:
        """Work of ``lane`` falls due at ``at_epoch`` (database clock)."""
        at = self.monotonic_at(at_epoch)
        current = self._at.get(lane)
        if current is None or at < current:
            self._at[lane] = at

    def retries_due(self, next_retry_by_lane: Mapping[str, datetime]) -> None:
        """Retries the supervisor recorded (a sweep, crash attribution): wake each lane when
        its earliest one falls due."""
        for lane, run_at in next_retry_by_lane.items():
            self.due_at(lane, run_at.timestamp())

    def suspects_due(self, lane: str, at_epoch: float | None = None) -> None:
        """A suspect of ``lane`` is due now, or at ``at_epoch``: its workers must look."""
        if at_epoch is None:
            self._suspects.add(lane)
        else:
            heapq.heappush(self._suspects_at, (self.monotonic_at(at_epoch), lane))

    def controls_changed(self, lane: str) -> None:
        """The lane's pauses changed: every worker of it must look at them again."""
        self._news.setdefault(lane, set()).add(protocol.CONTROLS)

    def cancels_requested(self, lane: str) -> None:
        """Running jobs of the lane were asked to stop: its workers renew their leases now,
        which tells each of them whether it holds one."""
        self._news.setdefault(lane, set()).add(protocol.CANCELS)

    def jobs_behind(self, lane: str) -> None:
        """Jobs due for a while were enqueued: every worker of the lane may hold floors above
        them and claims from the head next."""
        self._news.setdefault(lane, set()).add(protocol.BEHIND)

    def notified(self, wakeups: Iterable[Wakeup]) -> None:
        for wakeup in wakeups:
            if wakeup.control == "pause":
                self.controls_changed(wakeup.lane)
            elif wakeup.control == "cancel":
                self.cancels_requested(wakeup.lane)
            elif wakeup.control == "behind":
                self.jobs_behind(wakeup.lane)
            elif wakeup.at_epoch is None:
                self.due_now(wakeup.lane, wakeup.due)
            else:
                self.due_at(wakeup.lane, wakeup.at_epoch)

    def monotonic_at(self, at_epoch: float, now: float | None = None) -> float:
        """The monotonic instant by which ``at_epoch`` (database clock) has passed."""
        now = time.monotonic() if now is None else now
        delay = at_epoch + WAKE_MARGIN - self.db_epoch(now)
        return now + max(0.0, delay)

    def next_moment(self) -> float:
        """The earliest timer (monotonic), or infinity."""
        moments = list(self._at.values())
        if self._suspects_at:
            moments.append(self._suspects_at[0][0])
        return min(moments, default=math.inf)

    # --- whom to wake -----------------------------------------------------------------------

    def route(self, workers: Sequence[W], now: float | None = None) -> list[tuple[W, bytes]]:
        """The pokes to send now: (worker, byte) pairs. Consumes what was due."""
        now = time.monotonic() if now is None else now
        for lane, at in list(self._at.items()):
            if at <= now:
                del self._at[lane]
                self.due_now(lane)
        while self._suspects_at and self._suspects_at[0][0] <= now:
            self._suspects.add(heapq.heappop(self._suspects_at)[1])
        pokes: list[tuple[W, bytes]] = []
        for lane in sorted(self._suspects):
            pokes += [(w, protocol.SUSPECTS) for w in _serving(workers, lane)]
        for lane, news in sorted(self._news.items()):
            pokes += [(w, byte) for w in _serving(workers, lane) for byte in sorted(news)]
        for lane, due in self._now.items():
            pokes += [(w, protocol.WAKE) for w in choose(_serving(workers, lane), due)]
        self._suspects.clear()
        self._now.clear()
        self._news.clear()
        return pokes


def _serving(workers: Sequence[W], lane: str) -> list[W]:
    return [w for w in workers if w.lane == lane and not w.retiring]


def choose(workers: list[W], due: int | None) -> list[W]:
    """The workers to wake for ``due`` jobs: all of them for an unknown number, else the
    least loaded, as many as needed at their capacity. Each chosen worker's estimated load
    grows until its next report, so the next wake-up picks another."""
    if due is None or not workers:
        return workers
    workers = sorted(workers, key=lambda w: w.busy + w.wake_load - w.capacity)
    needed = max(1, -(-due // max(1, workers[0].capacity)))
    chosen = workers[:needed]
    for worker in chosen:
        worker.wake_load += min(due, worker.capacity)
    return chosen
