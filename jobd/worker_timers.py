"""When a worker's loop wakes up by itself: its safety poll, the retries of its own failed
jobs, and how long ``select`` may sleep before the next thing falls due.

The supervisor wakes a worker when work arrives; these timers are what a worker does without
being told, so they must neither miss a moment (a job's timeout, a retry, a batch of outcomes
waiting for company) nor spin (a poll overdue while the database is down).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from jobd.config import LaneConfig

SAFETY_POLL_FACTOR = 12  # a worker's own fallback poll, in lane poll_intervals


def poll_delay(lane: LaneConfig) -> float:
    """The supervisor polls each lane every poll_interval and wakes its workers; a worker
    polls by itself only much more rarely, in case the supervisor cannot. Jitter keeps a
    fleet of idle workers from polling in lockstep."""
    return lane.poll_interval * SAFETY_POLL_FACTOR * random.uniform(0.8, 1.2)


@dataclass(slots=True)
class Timers:
    """The moments a worker looks at its lane unasked: the safety poll and its retries."""

    lane: LaneConfig
    next_poll: float = 0.0  # monotonic: the safety poll is due then
    wake_at: list[float] = field(default_factory=list)  # retries of our own failed jobs

    def poll_later(self, now: float) -> None:
        """Something just looked at the lane: the safety poll can wait a full delay."""
        self.next_poll = now + poll_delay(self.lane)

    def take_due(self, now: float) -> bool:
        """Whether the poll or a retry is due (there may be work); forgets due retries."""
        if any(t <= now for t in self.wake_at) or now >= self.next_poll:
            self.wake_at = [t for t in self.wake_at if t > now]
            return True
        return False


def select_timeout(now: float, *, local: Iterable[float | None],
                   database: Iterable[float | None], database_ready: float,
                   connected: bool) -> float:
    """Seconds until the soonest moment. ``local`` moments need only the process (a
    deadline, a report); ``database`` ones need the database, so they count no sooner than
    it can be used again: a poll overdue because the database is down must not turn the
    loop into a spin. The worker's heartbeat and report are always among ``local``."""
    moments = [moment for moment in local if moment is not None]
    moments += [max(moment, database_ready) for moment in database if moment is not None]
    if not connected or database_ready > now:
        moments.append(database_ready)
    return max(0.0, min(moments) - now)
