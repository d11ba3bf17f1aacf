"""Whether an ``async def`` handler blocks the event loop, and which one.

Every async job of a worker runs on one event loop (:mod:`jobd.async_handlers`). A handler
that makes a blocking call (``time.sleep``, a sync HTTP client, a CPU-bound loop) stops every
other async job of the worker until it returns: their awaits do not resume and their timeouts
cannot cancel them, so they time out in turn, and nothing says why. The worker's loop asks
here at each of its turns (at least one a second: its status report): it posts a probe (a
callback) to the event loop, at most every :data:`PROBE_EVERY`, and when a probe has waited
:data:`BLOCKED_AFTER` the loop is blocked, and the task it is running is the culprit (or one
of many that each take long: the one running then is named). So a block is seen 1-2 s after
it began. Pure bookkeeping on the worker's side; the probe is the only thing run on the
loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

# Seconds a probe may wait for the event loop before it counts as blocked: well above a
# busy loop's latency, well below the timeouts that a blocked loop makes expire.
BLOCKED_AFTER = 1.0
# Seconds between probes while the loop answers them.
PROBE_EVERY = 0.5


@dataclass(frozen=True, slots=True)
class Blocked:
    """The event loop has run nothing for ``seconds``; ``job_id`` and ``handler`` name the
    job whose task it is running (None: not one of the jobs, e.g. a callback a handler
    scheduled)."""

    seconds: float
    job_id: int | None
    handler: str | None


@dataclass(frozen=True, slots=True)
class Freed:
    """The event loop ran again after being blocked for at least ``seconds`` (the wait seen at
    the last check before the probe ran)."""

    seconds: float


class LoopWatch:
    """Probes one event loop from another thread (the worker's loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 job_of: Callable[[asyncio.Task[object] | None], tuple[int, str] | None]
                 ) -> None:
        self.loop = loop
        self._job_of = job_of
        # When the probe on its way was posted; None: it has run (set on the event loop).
        self._probe_sent_at: float | None = None
        self._last_probe_at = float("-inf")
        # How long the loop has been blocked, once that was reported; None: not blocked.
        self._blocked_for: float | None = None

    def check(self, now: float) -> Blocked | Freed | None:
        """What changed since the last check: the loop found blocked (once per episode), or
        free again after one; else None. Posts the next probe when one is due."""
        sent_at = self._probe_sent_at
        if sent_at is None:
            blocked_for, self._blocked_for = self._blocked_for, None
            if now - self._last_probe_at >= PROBE_EVERY:
                self._post(now)
            return None if blocked_for is None else Freed(blocked_for)
        waited = now - sent_at
        if self._blocked_for is not None:  # reported already: only how long, so far
            self._blocked_for = waited
            return None
        if waited < BLOCKED_AFTER:
            return None
        self._blocked_for = waited
        # Read from this thread while the loop's thread is stuck in the task: the mapping of
        # the running task per loop is a plain dict, and a stuck task cannot change it.
        job = self._job_of(asyncio.current_task(self.loop))
        job_id, handler = job if job is not None else (None, None)
        return Blocked(waited, job_id, handler)

    def _post(self, now: float) -> None:
        self._probe_sent_at = self._last_probe_at = now
        self.loop.call_soon_threadsafe(self._answered)

    def _answered(self) -> None:
        self._probe_sent_at = None
