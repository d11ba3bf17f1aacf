"""A worker's lines about failed attempts and dead jobs, within a budget.

One line per failed attempt and per dead job is what an operator wants while failures are
few. A herd of failing jobs made that 150,000 lines for 50,000 jobs of three attempts,
2,900 lines (890 kB) a second from one lane: journald's default rate limit (10,000 lines in
30 s per service) then drops lines of every kind, the supervisor's included, and nobody
reads that many anyway. So a worker writes at most :data:`BURST` of them per :data:`WINDOW`;
beyond that it counts them by handler, and when the window ends writes one line with the
counts (``job failures not logged one by one``). Every dead job stays in the dead-letter
queue (``jobd dlq list``), each failed attempt in its job's ``errors``, and the totals in
``jobd_jobs_completed_total{outcome}``: the budget thins the log, not what is recorded.

Pure bookkeeping: the caller passes the monotonic clock and writes the one-by-one lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

WINDOW = 10.0  # seconds
BURST = 20  # lines about single failures per window, per worker

log = structlog.get_logger("jobd.failure_log")


@dataclass(slots=True)
class _Held:
    """Failures of one handler counted instead of logged, and the first one's error."""

    retried: int = 0
    dead: int = 0
    error: str = ""


@dataclass(slots=True)
class FailureLog:
    window_end: float | None = None  # monotonic; None: no failure since the last window
    written: int = 0  # one-by-one lines written in this window
    held: dict[tuple[str, str], _Held] = field(default_factory=dict)  # (lane, handler)

    def admit(self, now: float) -> bool:
        """Whether the next failure gets a line of its own; if not, :meth:`hold` it."""
        self.flush(now)
        if self.window_end is None:
            self.window_end = now + WINDOW
        if self.written < BURST:
            self.written += 1
            return True
        return False

    def hold(self, lane: str, handler: str, dead: bool, error: str) -> None:
        held = self.held.setdefault((lane, handler), _Held(error=error))
        if dead:
            held.dead += 1
        else:
            held.retried += 1

    def flush(self, now: float, force: bool = False) -> None:
        """At the end of the window (or at once, ``force``: the worker stops), one line per
        lane for what was held, and a new window."""
        if self.window_end is None or (now < self.window_end and not force):
            return
        by_lane: dict[str, dict[str, _Held]] = {}
        for (lane, handler), held in self.held.items():
            by_lane.setdefault(lane, {})[handler] = held
        for lane, handlers in sorted(by_lane.items()):
            retried = sum(h.retried for h in handlers.values())
            dead = sum(h.dead for h in handlers.values())
            # Counts under keys of their own: retried and dead elsewhere list job ids.
            (log.error if dead else log.warning)(
                "job failures not logged one by one: more than the log takes; the dead "
                "jobs are in the dead-letter queue (jobd dlq list)",
                lane=lane, retried_count=retried, dead_count=dead, window_s=WINDOW,
                handlers={name: {"retried": h.retried, "dead": h.dead, "error": h.error}
                          for name, h in sorted(handlers.items())})
        self.window_end = None
        self.written = 0
        self.held.clear()
