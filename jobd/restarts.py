"""When to restart a worker slot: supervisord's state machine with exponential backoff.

A worker that stays up for ``healthy_uptime`` counts as healthy and clears its slot's
failure count. One that dies sooner is a crash loop: the slot waits ``base * 2**(n - 1)``
seconds (capped) before the next spawn, so a poison job that kills every worker cannot make
the supervisor fork as fast as it can. A crash that crash attribution explains by its worker's
jobs does not count: pinned on the one job it ran, that job has spent an attempt (retried
alone after its backoff, or dead); among several, they become suspects, each run alone until
the one that kills its worker is found. The cause is dealt with either way, and a slot that
backed off for it would only keep the lane's other work waiting
(docs/incidents/0001-poison-pill-and-herd.md).
:func:`restart_reason` names why a slot's worker was replaced, for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobd.protocol import EXIT_BOOT_FAILURE, EXIT_OK, EXIT_WEDGED

# Why a slot's worker ended and was replaced (jobd_worker_restarts_total's reason): it
# crashed (a signal, a non-zero exit, or status 0 without its shutdown: os._exit(0) in a
# handler), was killed for silence (timeout), exited because every slot was held by a
# timed-out handler (wedged), could not import a handler (boot_failure), or shut down and
# exited cleanly on its own (exited: a SIGTERM sent to it alone).
RESTART_REASONS = ("crash", "timeout", "wedged", "boot_failure", "exited")


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

    def forgive(self) -> float:
        """The last exit was a crash that crash attribution explained by its worker's jobs
        (pinned on one, or suspects): it does not count toward the backoff. Returns the
        slot's restart delay instead: ``base``, so that a stream of distinct poison jobs
        still cannot make the supervisor fork as fast as it can."""
        self.failures = max(0, self.failures - 1)
        return self.base


def restart_reason(returncode: int, kill_reason: str | None, shut_down: bool = True,
                   booted: bool = False) -> str:
    """Which of :data:`RESTART_REASONS` a slot's worker that ended with ``returncode`` is;
    ``shut_down``: whether it finished its shutdown (its run board's mark); ``booted``:
    whether it reported after loading its handlers (status 3 is then a handler's crash)."""
    if kill_reason is not None:
        return "timeout"
    if returncode == EXIT_BOOT_FAILURE and not booted:
        return "boot_failure"
    if returncode == EXIT_WEDGED:
        return "wedged"
    return "exited" if returncode == EXIT_OK and shut_down else "crash"
