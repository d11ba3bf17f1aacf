"""When to restart a worker slot: supervisord's state machine with exponential backoff.

A worker that stays up for ``healthy_uptime`` counts as healthy and clears its slot's
failure count. One that dies sooner is a crash loop: the slot waits ``base * 2**(n - 1)``
seconds (capped) before the next spawn, so a poison job that kills every worker cannot make
the supervisor fork as fast as it can.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SlotBackoff:
    base: float = 1.0
    cap: float = 60.0
    healthy_uptime: float = 30.0
    failures: int = 0

    def record_exit(self, uptime: float) -> float:
        """Record that the slot's worker exited after ``uptime`` s; returns the restart delay."""
        if uptime >= self.healthy_uptime:
            self.failures = 0
            return 0.0
        self.failures += 1
        return min(self.cap, self.base * 2.0 ** min(self.failures - 1, 32))
