"""A worker's wake-up state: whether its row is in ``lane_waiters`` (so enqueues notify for
it), and when it claims again without being woken. Pure logic with the monotonic clock; the
claimer (``jobd.claimer``) consults it, the worker's loop does the round trips.

- A claim that came back short is tried again after each delay of :data:`LINGER` (none by
  default), then the worker arms (``queue.arm``).
- An arming that finds an enqueue in flight ('contended'), or due work ('work'), makes the
  worker claim again after :data:`RETRY_DELAYS`, the last one repeating.
- An armed worker stays armed while its claims come back short: every enqueue since its
  arming has notified, so it sleeps without arming again. Its claims look past the floors as
  a probe would, so it probes once more when a probe would have (``recheck_at``), and writes
  its row again every :data:`ARMED_REFRESH`. The claim after a full one disarms it.
"""

from __future__ import annotations

from dataclasses import dataclass

# After a short claim, claim again after each of these delays (seconds) before arming. Empty:
# polls of 1, 2 and 4 ms spared some NOTIFYs at 400 jobs/s but added milliseconds to the
# pickup of an idle lane (p50 2.3-3.1 ms, p99 10-12 ms at 200/s, against 2.1-2.5 and 5-9
# without, disturbed runs); an idle lane's pickup comes first.
LINGER: tuple[float, ...] = ()
# Claim again after these delays while an arming finds enqueues in flight, or due work that
# the next claim then does not get (a row another claimer holds); the last one repeats.
RETRY_DELAYS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
# An armed worker writes its row again after this long (armed_at), well inside the hour after
# which the retention duty removes a row as a dead worker's (WAITER_STALE_AFTER).
ARMED_REFRESH = 600.0


@dataclass(slots=True)
class Arming:
    armed: bool = False  # this worker's row is in lane_waiters (as far as it knows)
    armed_at: float = 0.0  # monotonic: when it last wrote that row
    # The next claim removes the row: the last one came back full (the worker has work, so
    # wake-ups would only cost the producers a NOTIFY).
    disarm_due: bool = False
    lingering: int | None = None  # how many LINGER claims came back short
    retries: int = 0  # arming attempts since the last claim that took something
    next_try_at: float | None = None  # a LINGER or RETRY_DELAYS claim is due then
    # Armed after a look above the floors only: look from the head of the lane then, so a
    # job that became due below them does not wait for the fallback poll.
    recheck_at: float | None = None

    def disarmed(self) -> None:
        """The worker's row is gone (a claim removed it, or the lane was paused)."""
        self.armed = False
        self.disarm_due = False
        self.recheck_at = None

    def claimed(self, took: bool, maybe_more: bool, now: float) -> None:
        """A claim came back; ``maybe_more``: it was full, so claim again at once."""
        if took:
            self.retries = 0
            self.lingering = None
        if maybe_more:
            self.next_try_at = None
        elif (self.lingering or 0) < len(LINGER):
            step = self.lingering or 0
            self.next_try_at = now + LINGER[step]
            self.lingering = step + 1
        else:
            self.lingering = len(LINGER)
            self.next_try_at = None  # lingered: arm now (wants)

    def stay_armed(self, recheck_at: float | None) -> None:
        """An armed worker's claim came back short and left its row: it stays armed (every
        enqueue since its arming has notified, so it sleeps without arming again: two
        transactions and a row version in lane_waiters a job saved, at a steady rate that
        leaves the workers idle between jobs), and probes again at ``recheck_at``."""
        self.recheck_at = recheck_at

    def due(self, now: float) -> bool:
        """Whether a LINGER or retry claim is due now (it is then no longer pending)."""
        if self.next_try_at is not None and now >= self.next_try_at:
            self.next_try_at = None
            return True
        return False

    def wants(self, now: float) -> bool:
        """Whether to arm now, for a worker that has nothing to claim."""
        if self.armed:
            # Refreshed well before the retention duty takes it for a dead worker's.
            return ((self.recheck_at is not None and now >= self.recheck_at)
                    or now >= self.armed_at + ARMED_REFRESH)
        return self.next_try_at is None and self.lingering == len(LINGER)

    def paused(self) -> None:
        """Arming answered 'paused': wait unarmed for the lane's resume."""
        self.recheck_at = None
        self.lingering = None

    def armed_now(self, now: float, recheck_at: float | None) -> None:
        """Arming answered 'armed': sleep until woken, or until ``recheck_at``."""
        self.armed = True
        self.armed_at = now
        self.disarm_due = False
        self.lingering = None
        self.retries = 0
        self.recheck_at = recheck_at

    def claim_again(self, result: str, now: float) -> None:
        """Arming answered 'work' or 'contended': claim again after the next retry delay. On
        'work' the worker is registered and keeps its row (migration 0024): it claims as an
        armed worker does after a wake-up (in a limited lane, where 'work' is often due work
        without budget, that claim disarms and the worker goes on polling after RETRY_DELAYS
        until the budget lets one through). On 'contended' nothing was written: the worker is
        armed as much as it was."""
        if result == "work":
            self.armed = True
            self.armed_at = now
        self.recheck_at = None
        delay = RETRY_DELAYS[min(self.retries, len(RETRY_DELAYS) - 1)]
        self.retries += 1
        self.next_try_at = now + delay

    def disconnected(self) -> None:
        """A new connection: the server may have lost lane_waiters (a restart empties it)."""
        self.disarmed()
        self.lingering = None
