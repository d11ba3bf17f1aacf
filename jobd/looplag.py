"""How late a select loop runs its timers: the supervisor's ``jobd_supervisor_loop_lag_seconds``.

Before it sleeps, the loop knows the earliest moment it must act at (a timer, a duty, a
restart); when it wakes after that moment, the difference is how late it is. A turn that
took long shows as the next moment's lateness, so slow work and an oversleeping ``select``
both count. The gauge is the worst lateness of the last 5 to 10 seconds (one or two
:data:`WINDOW`), so a scrape every few seconds sees each spike, not only the latest turn's.

A moment that was already past when the loop last woke (a duty due from the start, at
moment 0 of the monotonic clock) is counted from that wake: the loop cannot have been late
for it before it ran at all, and counting from the moment itself made the first turns report
the machine's uptime.
"""

from __future__ import annotations

import time

WINDOW = 5.0  # seconds


class LoopLag:
    def __init__(self, now: float | None = None) -> None:
        self.window_start = time.monotonic() if now is None else now
        self.current = 0.0  # worst lateness in the window that began at window_start
        self.previous = 0.0  # worst lateness in the window before
        self.last_woke = self.window_start  # when the loop last woke (or began)

    def begin(self, now: float | None = None) -> None:
        """The loop starts turning now: what it had to do before waits from here."""
        self.last_woke = time.monotonic() if now is None else now

    def woke(self, due_at: float, now: float | None = None) -> None:
        """The loop woke at ``now`` for a moment due at ``due_at`` (monotonic)."""
        now = time.monotonic() if now is None else now
        self._rotate(now)
        self.current = max(self.current, now - max(due_at, self.last_woke))
        self.last_woke = now

    def worst(self, now: float | None = None) -> float:
        self._rotate(time.monotonic() if now is None else now)
        return max(self.current, self.previous)

    def _rotate(self, now: float) -> None:
        if now - self.window_start >= 2 * WINDOW:
            self.previous = self.current = 0.0
            self.window_start = now
        elif now - self.window_start >= WINDOW:
            self.previous, self.current = self.current, 0.0
            self.window_start += WINDOW
