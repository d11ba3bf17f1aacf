"""Crash attribution: the jobs of a worker process that exited are settled at once, so
nobody waits for a lease to expire.

A worker that crashed: the job it was running alone killed it and spends an attempt; several
running together become suspects, run alone one at a time; the jobs it held unstarted are
given back unharmed (``recovery.settle_crashed_worker``, by the worker's run board,
``jobd.run_board``). A worker we stopped (killed at the drain deadline): its jobs are given
back unharmed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psycopg
import structlog

from jobd import jobs, queue, recovery
from jobd.duties import NEVER, Duty, Router
from jobd.queries import query
from jobd.run_board import Running

# What a settlement ended, for the node's counters: handler -> outcome -> jobs, the outcomes
# named as the workers count them (jobd.worker_metrics.OUTCOMES).
OutcomeCounts = dict[str, dict[str, int]]

log = structlog.get_logger("jobd.duties.crash_attribution")

RETRY_AFTER = 1.0  # seconds before a failed settlement is tried again
# How long the jobs a crash gave back as unstarted stay under suspicion: a worker that dies
# holding one of them again is settled as if it had no run board (recovery).
GIVEN_BACK_MEMORY = 60.0


@dataclass(frozen=True, slots=True)
class Attribution:
    """A worker that exited with jobs possibly still claimed in its name, to settle."""

    worker_id: str
    lane: str
    reason: str
    release: bool  # stopped by us: give its jobs back; else it crashed
    running: Running | None = None  # its run board: the jobs it was running; None: unknown


class CrashAttribution(Duty):
    name = "crash attribution"
    alone = True

    def __init__(self, policy_for: recovery.PolicyLookup, router: Router,
                 lanes: Callable[[], Iterable[str]],
                 pinned: Callable[[str], None] = lambda _worker: None,
                 counted: Callable[[str, OutcomeCounts], None] = lambda _lane, _counts: None
                 ) -> None:
        super().__init__()
        self.policy_for = policy_for
        # Told the worker id when its crash is explained by its jobs: pinned on the one it
        # was running, or one of the several it was running, now suspects run alone. Its
        # slot restarts after the base delay: the crash's cause is being dealt with, and a
        # slot that backed off for it kept the lane's other work waiting. Before, a crash
        # among several jobs grew the slot's delay: with a poison arriving every 2 s in a
        # fair lane (a share of every claim, so each first crashed beside other jobs) the
        # slots waited up to a minute each time, and the lane did almost nothing else.
        self.pinned = pinned
        # Told the lane and the outcomes of the jobs a crash failed: the dead worker cannot
        # count them, and without them a crash loop showed no failures in `jobd status`,
        # `jobd top` or jobd_jobs_completed_total while its jobs filled the DLQ.
        self.counted = counted
        self.router = router
        self.lanes = lanes
        self.pending: list[Attribution] = []
        self.next_at = NEVER
        self.given_back: dict[int, float] = {}  # job id -> when a crash gave it back

    def add(self, attribution: Attribution) -> None:
        self.pending.append(attribution)
        self.next_at = 0.0

    def run(self, conn: psycopg.Connection, now: float) -> None:
        self.next_at = now + RETRY_AFTER  # kept if a settlement fails
        while self.pending:
            attribution = self.pending[0]
            if attribution.release:
                self._release(conn, attribution.worker_id)
            else:
                self._settle_crash(conn, attribution)
            self.pending.pop(0)
        self.next_at = NEVER

    def _release(self, conn: psycopg.Connection, worker_id: str) -> None:
        rows = conn.execute(query("jobs_held_by"), {"worker": worker_id}).fetchall()
        released = queue.release(conn, [jobs.Lease(r[0], r[1]) for r in rows])
        if released.applied:
            log.info("released the jobs of a stopped worker", worker=worker_id,
                     job_ids=released.applied)
            self.router.due_everywhere(self.lanes())
        if any(r[5] for r in rows):  # asked to stop: not given back, but ended
            recovery.finish_cancelled(conn, worker_id, "cancelled: its worker stopped first",
                                      self.policy_for)

    def _settle_crash(self, conn: psycopg.Connection, attribution: Attribution) -> None:
        worker_id, reason = attribution.worker_id, attribution.reason
        now = time.monotonic()
        self.given_back = {job_id: at for job_id, at in self.given_back.items()
                           if at > now - GIVEN_BACK_MEMORY}
        outcome = recovery.settle_crashed_worker(conn, worker_id, reason, self.policy_for,
                                                 running=attribution.running,
                                                 given_back_before=self.given_back.keys())
        self.given_back.update(dict.fromkeys(outcome.given_back, now))
        counts = outcome_counts(outcome)
        if counts:
            self.counted(attribution.lane, counts)
        self.router.retries_due(outcome.failed.next_retry_by_lane)
        if outcome.given_back:
            log.info("gave back the jobs a dead worker held but had not started",
                     worker=worker_id, job_ids=outcome.given_back)
            self.router.due_everywhere(self.lanes())
        # A worker only claims from its own lane: that is where the suspects are. Suspects
        # are claimed only by workers told to look: now, and when a suspect's retry is due.
        if outcome.suspects:
            self.router.suspects_due(attribution.lane)
        for run_at in outcome.failed.retry_at.values():
            self.router.suspects_due(attribution.lane, run_at.timestamp())
        if outcome.suspects:
            log.warning("a worker died running several jobs; each runs alone next, to find "
                        "the one that killed it (their attempts are given back)",
                        lane=attribution.lane, worker=worker_id, reason=reason,
                        suspect_job_ids=outcome.suspects, handlers=outcome.handlers)
            self.pinned(worker_id)
        elif outcome.failed.retried or outcome.failed.dead:
            # A job dead-lettered is an error, as the worker logs its own dead jobs
            # (docs/operations.md, "Reading the log"); a retry is worth a look.
            (log.error if outcome.failed.dead else log.warning)(
                "failed the job that killed its worker", lane=attribution.lane,
                worker=worker_id, reason=reason, handlers=outcome.handlers,
                retried_job_ids=outcome.failed.retried, dead_job_ids=outcome.failed.dead)
            self.pinned(worker_id)


def outcome_counts(outcome: recovery.CrashOutcome) -> OutcomeCounts:
    """Per handler, how many of the jobs ``outcome`` failed were retried, dead-lettered or
    ended as cancelled (suspects and jobs given back ended nothing: they run again)."""
    counts: OutcomeCounts = {}
    failed = outcome.failed
    for name, ids in (("failed", failed.retried), ("dead", failed.dead),
                      ("cancelled", failed.cancelled)):
        for job_id in ids:
            handler = outcome.handler_of.get(job_id)
            if handler is not None:
                by_outcome = counts.setdefault(handler, {})
                by_outcome[name] = by_outcome.get(name, 0) + 1
    return counts
