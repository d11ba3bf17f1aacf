"""Retry delays: exponential backoff with full jitter.

A fixed retry interval makes thousands of jobs that failed together retry together, and the
herd re-saturates the dependency that just failed. Full jitter draws each delay uniformly from
``[0, min(cap, base * 2**(attempt - 1))]``, which spreads the herd over the whole window.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Backoff:
    base: float = 1.0
    cap: float = 300.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base) and math.isfinite(self.cap)):
            raise ValueError("backoff base and cap must be finite numbers")
        if self.base <= 0 or self.cap <= 0:
            raise ValueError("backoff base and cap must be positive")
        if self.cap < self.base:
            raise ValueError("backoff cap must not be smaller than its base")

    def ceiling(self, attempt: int) -> float:
        """The largest delay after failed attempt number ``attempt`` (1-based)."""
        exponent = max(attempt, 1) - 1
        # 2**exponent overflows a float near 1024; the cap is reached long before.
        if exponent >= 64:
            return self.cap
        return min(self.cap, self.base * 2.0**exponent)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A jittered delay in seconds before the retry that follows ``attempt``."""
        draw = (rng or random).random()
        return draw * self.ceiling(attempt)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a lane retries: its backoff, the attempt budget for jobs that set none, and how
    many times a job may kill its worker, running alone, before it is dead-lettered whatever
    attempts it has left (``max_crashes``)."""

    backoff: Backoff = field(default_factory=Backoff)
    max_attempts: int = 8
    max_crashes: int = 2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.max_crashes < 1:
            raise ValueError("max_crashes must be at least 1")
