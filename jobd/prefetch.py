"""How many jobs a worker claims ahead of its free slots (its buffer), decided from how fast
it starts them. Pure logic: the claimer asks, with the monotonic clock and its count of
started jobs.

A lane that sets ``prefetch`` (or ``max_running``, which claims nothing ahead) gets that
size, always. Otherwise the buffer holds about :data:`HORIZON` of work at the start rate the
worker measured over its last window (:data:`ORDERED_HORIZON` in a lane with ``fair_by`` or
``max_wait``), never less than the floor (3 x ``concurrency``, the size a lane got before)
and never more than :data:`MAX_JOBS` (or the floor, if that is larger), nor than
:data:`BYTES_AHEAD` of payload at the size its claims brought (but never below one refill of
the slots, :meth:`Prefetch.claimed`). The claim itself carries a bound the database applies,
:data:`STORED_BYTES_AHEAD` of payload on disk in all, but never fewer jobs than start at
once, since what the claims brought says nothing of the next one's payloads
(:meth:`Prefetch.claim_bound`).
Why adapt instead of a larger fixed size:

- Short jobs want a large buffer. A claim is a round trip and a commit; at 1 x 10 with no-op
  handlers, claiming 3 x ``concurrency`` ahead drained about 14k jobs/s, 10 x about 23k,
  because each commit then carries several times the jobs (docs/performance.md).
- Slow jobs want a small one. Buffered jobs wait for a slot on this worker while another
  worker may be idle, and they go back to the queue after ``BUFFER_MAX_AGE`` unstarted, so
  a large buffer in front of one-second jobs would only be claimed and given back.

Measured this way, a buffer never holds more than about :data:`HORIZON` of this worker's
own work beyond the floor, so what a large buffer could cost (other workers idle beside it,
priorities and fair shares decided earlier than the jobs start) is bounded by it. A worker
that started nothing for :data:`IDLE_RESET` starts again from the floor: the next burst may
be of another kind.

Until its first window is measured, a worker that runs dry doubles the size (at most to the
cap): a claim came back full to a worker with nothing left to start and slots free, so the
buffer held less work than a claim's round trip (:meth:`Prefetch.ran_dry`). Slow jobs never
run dry (their slots are busy), so they keep the floor; short ones reach their size in a few
round trips, where a window of claims at the floor cost a burst of no-op jobs 20-50 ms at a
fraction of its rate (docs/performance.md, "What one worker waits for"). The first window's
measurement then decides as before. A fair or age-promoting lane does not double: its
buffer's bound is a fairness bound, not only a matter of speed.

After a crash in the lane (the supervisor's SUSPECTS byte) the floor holds for
:data:`HOLD_AFTER_CRASH`. A dead worker's run board (``jobd.run_board``) spares its buffer:
only the jobs it was running become suspects that run alone (``jobd.recovery``). But a board
that proves nothing (the worker died outside any handler) leaves every job it held a
suspect, and a poison that keeps arriving would then cost hundreds of solitary runs per
crash instead of a few dozen.
"""

from __future__ import annotations

import math

from jobd.config import LaneConfig

HORIZON = 0.05  # seconds of work at the measured start rate that the buffer holds
# ... in a lane with fair_by or max_wait, which decides shares and order per claim: a job of
# another key that arrives just after a claim waits behind at most this much buffered work.
# With HORIZON there (a buffer of up to 200 jobs in the incident drill's herd) the other
# handlers' pickup p99 went from 1.2-1.9 x their baseline to 4.7-5.2 x; at one worker's
# no-op drain this still takes claims of about 85 jobs instead of 25.
ORDERED_HORIZON = 0.005
WINDOW = 0.02  # the start rate is measured over windows at least this long
IDLE_RESET = 1.0  # a window this old (nothing measured since) no longer says anything
# At most this many jobs, whatever the lane's concurrency (unless its floor is larger). The
# buffer still holds no more than HORIZON of the worker's own work, so the cap counts only
# for short jobs. It was also at most 50 x concurrency until 2026-12-05: at concurrency 1
# that kept a no-op drain to claims of 50, and 1 x 1 drained at 0.6 x Graphile Worker's
# rate (docs/performance.md, "A cap in jobs, not in concurrency"). A first crash that its
# run board cannot attribute makes up to this many suspects, each run alone: at
# concurrency 1 that is how every job runs anyway.
MAX_JOBS = 500
HOLD_AFTER_CRASH = 30.0  # seconds at the floor after a crash in the lane
# At most this much payload (characters of JSON text) claimed ahead, whatever the start rate
# says. While a worker reads a claim it holds 3-4 x the claim's payload text (the driver's
# result and the jobs' strings): claims of a few hundred 1 MB jobs took workers to 0.5-1 GB
# each. 32 MB keeps what is claimed ahead near 128 MB of a worker's peak, so a node of a few
# workers fits a small container, and it binds only above 64 KB a job at MAX_JOBS: a drain
# of small payloads never meets it.
BYTES_AHEAD = 32 * 1024 * 1024
# The bound learned from claims comes one claim late: the first claim after payloads grow is
# sized from the small ones (500 jobs of 1 MB took a worker to about 1 GB). So an adaptive
# lane's claim also carries a bound the database applies (claim_jobs and claim_jobs_limited,
# "the byte bound"), in the bytes a payload takes on disk, which is all the claim can read
# without decompressing it: a quarter of BYTES_AHEAD, so that payloads compressed 4 to 1 on
# disk (JSON often is) still come to no more than BYTES_AHEAD of text, and incompressible
# ones to a quarter.
STORED_BYTES_AHEAD = BYTES_AHEAD // 4


class Prefetch:
    """The buffer size to claim for: fixed when the lane says so, else adapted."""

    def __init__(self, lane: LaneConfig) -> None:
        self.floor = lane.buffer_size
        adaptive = lane.prefetch is None and lane.max_running is None
        self.cap = max(self.floor, MAX_JOBS) if adaptive else self.floor
        self.horizon = ORDERED_HORIZON if lane.ordered else HORIZON
        self.size = self.floor
        # The jobs are short: the start rate's horizon of work is more than the floor. An
        # adapted buffer then grows past its floor; a fixed one (the lane's prefetch) stays,
        # and this says the same thing for it (jobd.slots puts jobs on deck only then).
        self.short = False
        self._window_at: float | None = None  # when the current window began
        self._window_count = 0  # the started count at its beginning
        self._held_until = -math.inf  # the floor holds until then (a crash in the lane)
        self._measured = False  # the current window is not the first since a reset
        # A fair or age-promoting lane's buffer is a fairness bound: it does not double.
        self._doubles = adaptive and not lane.ordered
        # The byte bound (BYTES_AHEAD), learned from what claims brought; it never takes the
        # buffer below one refill of every slot. A lane's own prefetch is taken as given.
        self._adaptive = adaptive and self.floor > 0
        self._least = min(self.floor, lane.concurrency)
        self.bytes_per_job = 0.0  # the payload characters a claimed job brought, recently
        self.stored_per_job = 0.0  # ... and the bytes it held on disk, as the bound says
        self.byte_cap = self.cap  # the most jobs BYTES_AHEAD allows at that size

    def hold(self, now: float) -> None:
        """A worker of the lane crashed: keep to the floor for a while."""
        self._held_until = now + HOLD_AFTER_CRASH
        self.size = self.floor
        self.short = False

    def current(self, started: int, now: float) -> int:
        """The size now, given the worker's total of started jobs so far."""
        if self.floor == 0 or now < self._held_until:
            # Nothing is claimed ahead (a limited lane), or a crash holds the floor: nothing
            # to measure; measure afresh once the hold ends.
            self._window_at = None
            self.short = False
            return min(self.floor, self.byte_cap)
        if self._window_at is None or now - self._window_at >= IDLE_RESET:
            self._begin(started, now)
            self.size = min(self.floor, self.byte_cap)
            self.short = False
            self._measured = False
        elif now - self._window_at >= WINDOW:
            rate = (started - self._window_count) / (now - self._window_at)
            wanted = math.ceil(rate * self.horizon)
            self.size = min(self.byte_cap, max(self.floor, wanted))
            self.short = wanted > self.floor
            self._begin(started, now)
            self._measured = True
        return self.size

    def ran_dry(self, now: float) -> None:
        """A full claim came back to a worker with nothing left to start and slots free:
        before the first window is measured, double the size (at most to the cap)."""
        if (not self._doubles or self._measured or self._window_at is None
                or now < self._held_until):
            return
        self.size = min(self.byte_cap, self.size * 2)

    def claimed(self, jobs: int, payload_chars: int, bounded: bool = False) -> None:
        """A claim brought ``jobs`` jobs with ``payload_chars`` characters of payload in all,
        and the database's byte bound cut it short (``bounded``) or not: bound the size so
        that a buffer of such jobs holds at most BYTES_AHEAD of text, and about
        STORED_BYTES_AHEAD on disk, so that the next claim asks for about what the bound
        lets it take (the rows it locks beyond that go back unclaimed, and other workers'
        claims have stepped past them). A bounded claim's jobs held about the bound each
        over their number; after a claim within it the estimate halves, so that it comes
        down once payloads shrink (while they do not, every other claim meets the bound and
        learns it again). Payloads of text that grow count at once; ones that shrink count
        half per claim, so one small claim among large ones does not open the buffer to
        MAX_JOBS of the large ones again."""
        if not self._adaptive or jobs == 0:
            return
        self.bytes_per_job = _learned(self.bytes_per_job, payload_chars / jobs)
        within = STORED_BYTES_AHEAD / jobs
        self.stored_per_job = (_learned(self.stored_per_job, within) if bounded
                               else min(self.stored_per_job, within) / 2)
        most = min(BYTES_AHEAD // max(self.bytes_per_job, 1.0),
                   STORED_BYTES_AHEAD // max(self.stored_per_job, 1.0))
        self.byte_cap = max(self._least, min(self.cap, int(most)))
        self.size = min(self.size, self.byte_cap)

    def claim_bound(self) -> int | None:
        """The payload bytes (as stored) a claim may bring in all, unless the jobs that start
        at once hold more: None for a lane whose own prefetch or max_running fixes the
        buffer."""
        return STORED_BYTES_AHEAD if self._adaptive else None

    def claim_limit(self, free: int, least: int) -> int:
        """How many jobs to ask a claim for, given ``free`` room and ``least`` jobs that start
        at once: one more than the byte bound lets it take at the size on disk that bounded
        claims told (so that it meets the bound and learns the size anew), rather than all
        the room. The buffer is never smaller than one refill of the slots, so without this
        a worker at concurrency 100 with 1 MB payloads locked 100 rows a claim to take 9;
        the rest went back pending, stepped over meanwhile by the other workers' claims."""
        if not self._adaptive or self.stored_per_job <= 0:
            return free
        fits = math.ceil(STORED_BYTES_AHEAD / self.stored_per_job)
        return min(free, max(least, fits) + 1)

    def _begin(self, started: int, now: float) -> None:
        self._window_at = now
        self._window_count = started


def _learned(before: float, now: float) -> float:
    """A mean size after a claim: larger counts at once, smaller half."""
    return now if now >= before else (before + now) / 2
