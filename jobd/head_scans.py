"""When a supervisor duty reads its index from the head, and how far back it reads between.
Pure logic; the lane poll (``lane_heads``) and the lease sweep (``expired_leases``) take the
answer as ``look_back``.

Both statements look for the first live entries of an index that every job passes through:
the claim index by ``run_at``, the lease index by ``lease_until``. Each job leaves dead
entries there, so while something holds the xmin horizon back (docs/design/queue.md, "Claim
floors") a read from the head walks every job since the horizon was taken. Measured before
this rule (bench/pressure.py, 400 jobs/s, a three-minute held horizon): the poll read 22-33
thousand blocks a call every 5 s and the sweep 24 thousand every 10 s, growing with the
horizon's age, when the claims themselves read about 40.

So, as with the workers' scans from the head (``jobd.claim_floors``), a read from the head
is timed and the next is spaced so that such reads take at most
:data:`DUTY_HEAD_SCAN_SHARE` of the time, up to ``MAX_FULL_SCAN_INTERVAL`` apart. The runs
between read only from ``now()`` less a look back: :data:`~jobd.claim_floors.LOOK_BACK`, or
the time since the last run and a margin when that is longer, so consecutive runs always
overlap. A run asked for at once (``from_head_next``: a reload, a LISTEN reconnect, a sweep
that rolled back) reads from the head. What a bounded run misses
and the next read from the head catches:

- the poll: a job claimable with a ``run_at`` older than the look back that no notification
  announced (the LISTEN connection was down; a released job keeps its ``run_at``). The
  workers of a busy lane claim it anyway; an armed worker waits up to the spacing for it;
- the sweep: a lease that ran out longer ago than the look back and was not swept when it
  did (a step of the database's clock; a claim whose transaction outlived its own lease
  before it committed). A sweep that reached its row limit reads from the head next time.

A run that fails (a lost connection, a statement timeout) records nothing, so the next look
back reaches back to the last run that succeeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jobd.claim_floors import LOOK_BACK, MAX_FULL_SCAN_INTERVAL

# A quarter of the workers' HEAD_SCAN_SHARE: these duties are backstops for what
# notifications and the workers' own claims miss, so their reads from the head can wait
# longer. A read of the clean index costs well under a millisecond, so every poll and sweep
# still reads from the head then; after three minutes of a held horizon at 400 jobs/s the
# poll's read took 14 ms, which puts the next one 28 s later.
DUTY_HEAD_SCAN_SHARE = 0.0005
# Added to the time since the last run when that sets the look back: the monotonic clock
# that measures the gap and the database's clock that places the bound may drift apart a
# little between two runs.
LOOK_BACK_MARGIN = 1.0


@dataclass(slots=True)
class HeadScans:
    next_from_head: float = -math.inf  # monotonic
    last_run: float = -math.inf

    def look_back(self, now: float) -> float | None:
        """How many seconds before the database's ``now()`` the next run reads from, or None
        to read from the head: when one is due, or when the last run is so long ago (a
        stopped process) that a look back would cost as much."""
        if now >= self.next_from_head or now - self.last_run > MAX_FULL_SCAN_INTERVAL:
            return None
        return max(LOOK_BACK, now - self.last_run + LOOK_BACK_MARGIN)

    def from_head_next(self) -> None:
        """The next run reads from the head, however slow that has been."""
        self.next_from_head = -math.inf

    def ran(self, now: float, look_back: float | None, took: float,
            complete: bool = True) -> None:
        """A run at ``now`` with this ``look_back`` took ``took`` seconds; ``complete`` is
        False when it stopped at its row limit, so something may be left below its bound."""
        self.last_run = now
        if not complete:
            self.from_head_next()
        elif look_back is None:
            self.next_from_head = now + min(MAX_FULL_SCAN_INTERVAL, took / DUTY_HEAD_SCAN_SHARE)
