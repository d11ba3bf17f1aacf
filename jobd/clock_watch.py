"""Whether the database's clock stepped between two claims. Pure logic: the claimer reads
the database's time off each claim's leases and asks.

A worker's claim floors hold dry instants sent as ages and placed at the database's
``now()`` (``jobd.claim_floors``): a clock stepped forward by an hour would put every job
due in that hour below them, to be claimed only by the one full scan a second
(docs/incidents/0001-poison-pill-and-herd.md). So the claimer compares how far the
database's clock moved between two claims with how far this process's monotonic clock did,
and forgets its floors when the two disagree by more than :data:`CLOCK_STEP`.

A claim's ``now()`` is read somewhere between the instant the claim was sent and the
instant its answer came back, so the monotonic clock gives a range, not an instant: the
disagreement is what lies outside the range. Read at the answer alone, a claim that took
two seconds on a loaded server looked like a step back of two seconds, and the next claim
scanned from the head, the costliest claim, just when the server was busiest.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from jobd import queue

# The disagreement between the two clocks, in seconds, that counts as a step.
CLOCK_STEP = 1.0


@dataclass(slots=True)
class ClockWatch:
    # The database's clock at the last claim that took a job, and the monotonic instants
    # that claim was sent and answered at.
    last: tuple[datetime, float, float] | None = None

    def step(self, db_now: datetime, sent_at: float, answered_at: float) -> float | None:
        """Note the database's time at a claim sent at monotonic instant ``sent_at`` and
        answered at ``answered_at``. Returns how far that clock stepped since the last one
        beyond what the monotonic clock allows, in seconds (negative: back), when by more
        than :data:`CLOCK_STEP`; else None."""
        previous, self.last = self.last, (db_now, sent_at, answered_at)
        if previous is None:
            return None
        moved = (db_now - previous[0]).total_seconds()
        # The least and the most the database's clock can have moved without a step.
        least, most = sent_at - previous[2], answered_at - previous[1]
        step = moved - most if moved > most else moved - least if moved < least else 0.0
        return None if abs(step) <= CLOCK_STEP else step

    def step_at_claim(self, claimed: queue.Claimed, visibility_timeout: float,
                      sent_at: float, answered_at: float) -> float | None:
        """:meth:`step` at a claim's return: the claim set each lease to the database's
        ``now()`` + ``visibility_timeout``. None too when it took nothing."""
        first = claimed.suspect or (claimed.jobs[0] if claimed.jobs else None)
        if first is None:
            return None
        return self.step(first.lease_until - timedelta(seconds=visibility_timeout), sent_at,
                         answered_at)
