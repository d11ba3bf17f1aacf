"""The completion side of a worker: outcomes of finished jobs, gathered and written in
batches, and what their writing tells (counters, log lines, retry timers).

Outcomes ride along with the next claim when there is one. Without one they wait up to
:data:`SETTLE_DELAY` for company, or until a batch of all the worker can hold (``concurrency``
plus the buffer), unless nothing else runs: a worker that wrote every ``concurrency`` outcomes
on their own paid a commit per slotful of jobs; waiting (never longer than
:data:`SETTLE_DELAY`) lets the buffer's next jobs run first, and their outcomes share the
commit. While a batch is being written the slots keep turning over (``Slots.turn_over``):
outcomes that arrive then stay pending for the next batch. A batch may also be handed over
to be written on a connection of its own (:mod:`jobd.settler`): until its answer is taken
its outcomes stay pending, and no other batch is made. A job whose outcome waits is not
lost: its lease is the worker's until the outcome is written, and the fenced write decides
what still applies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from jobd import jobs, queue
from jobd.config import LaneConfig
from jobd.db import mask_passwords_in_text
from jobd.failure_log import FailureLog
from jobd.outcomes import Outcome, first_line_of
from jobd.protocol import WorkerSpec
from jobd.worker_metrics import (
    CANCELLED,
    DEAD,
    DONE,
    FAILED,
    LEASE_LOST,
    WorkObserver,
    WorkTotals,
)

SETTLE_DELAY = 0.002  # seconds an outcome waits for company when no claim goes out

log = structlog.get_logger("jobd.completer")


@dataclass(slots=True)
class Counters:
    """Totals since the worker started, reported to the supervisor; with ``work``, also per
    handler for the node's metrics (``jobd.worker_metrics``). ``failure_log``: the failures
    counted instead of logged one by one, written with the reports (``jobd.failure_log``)."""

    claimed: int = 0
    completed: int = 0
    failed: int = 0
    dead: int = 0
    lease_lost: int = 0
    released: int = 0  # claimed into the buffer, then given back unstarted
    cancelled: int = 0  # asked to stop (jobd.cancel), archived as cancelled however they ended
    work: WorkObserver | None = None
    failure_log: FailureLog = field(default_factory=FailureLog)

    @classmethod
    def for_spec(cls, spec: WorkerSpec) -> Counters:
        if not spec.metrics:
            return cls()
        return cls(work=WorkObserver(spec.handlers, spec.lane.visibility_timeout))

    def as_dict(self) -> dict[str, int]:
        return {"claimed": self.claimed, "completed": self.completed, "failed": self.failed,
                "dead": self.dead, "lease_lost": self.lease_lost, "released": self.released,
                "cancelled": self.cancelled}

    def count_claimed(self, taken: list[jobs.Job]) -> None:
        self.claimed += len(taken)
        if self.work is not None:
            self.work.claimed(taken)

    def count_released(self, given_back: list[jobs.Job]) -> None:
        """Buffered jobs given back unstarted."""
        self.released += len(given_back)
        if self.work is not None:
            self.work.released(given_back)

    def work_totals(self) -> WorkTotals | None:
        return None if self.work is None else self.work.totals


@dataclass(slots=True)
class Batch:
    """Pending outcomes, sorted into what each statement needs."""

    successes: list[jobs.Lease] = field(default_factory=list)
    failures: list[queue.Failure] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)  # transactional: completed already
    committed_cancelled: list[int] = field(default_factory=list)  # ... and archived cancelled
    lost: list[int] = field(default_factory=list)  # transactional: lease lost at commit
    failed_jobs: dict[int, Outcome] = field(default_factory=dict)
    size: int = 0  # the pending outcomes it holds: the first ``size``, in order
    # Outcomes sent before in a write whose answer never came, by job id: (attempt, error;
    # None: a success). Refused by the fence now, they are looked up (jobd.unanswered).
    unanswered: dict[int, tuple[int, str | None]] = field(default_factory=dict)


class Completer:
    def __init__(self, lane: LaneConfig, counters: Counters) -> None:
        self.lane = lane
        self.counters = counters
        self.pending: list[Outcome] = []
        self.since: float | None = None  # when the oldest pending outcome arrived
        self.handed_over = False  # a batch is being written elsewhere (jobd.settler)
        # Jobs whose outcome went out in a write whose answer never came: it may have
        # committed (jobd.unanswered).
        self.unanswered: set[int] = set()

    def add(self, outcome: Outcome) -> None:
        if not self.pending:
            self.since = time.monotonic()
        self.pending.append(outcome)

    def due_at(self) -> float | None:
        if self.handed_over or self.since is None:
            return None
        return self.since + SETTLE_DELAY

    def due(self, busy: bool, capacity: int) -> bool:
        """Whether pending outcomes with no claim to ride along should be written now;
        ``busy``: other jobs are running or waiting, so more outcomes will come soon;
        ``capacity``: all the worker can hold (slots and buffer), so no more can come."""
        if not self.pending or self.handed_over:
            return False
        if not busy or len(self.pending) >= capacity:
            return True
        return self.since is not None and time.monotonic() >= self.since + SETTLE_DELAY

    def hand_over(self) -> Batch:
        """The pending outcomes as a batch written elsewhere; until :meth:`written` or
        :meth:`not_written`, no other batch is made."""
        batch = self.batch()
        self.handed_over = True
        return batch

    def not_written(self, batch: Batch) -> None:
        """The batch handed over was not written: its outcomes go in the next one."""
        self.went_unanswered(batch)
        self.handed_over = False
        self.since = time.monotonic() if self.pending else None

    def went_unanswered(self, batch: Batch) -> None:
        """``batch`` was sent and no answer came: written or not, its outcomes stay pending,
        and the next batch says which of them may have been written already."""
        self.unanswered.update(outcome.job.id for outcome in self.pending[:batch.size])

    def batch(self) -> Batch:
        assert not self.handed_over, "a batch is being written elsewhere"
        batch = Batch(size=len(self.pending))
        for outcome in self.pending:
            if outcome.committed:
                batch.committed.append(outcome.job.id)
                if outcome.cancelled:
                    batch.committed_cancelled.append(outcome.job.id)
            elif outcome.lease_lost:
                batch.lost.append(outcome.job.id)
            elif outcome.error is None:
                batch.successes.append(outcome.job.lease)
            else:
                batch.failed_jobs[outcome.job.id] = outcome
                batch.failures.append(queue.Failure(
                    outcome.job.lease, outcome.error,
                    self.lane.backoff.delay(outcome.job.attempt), self.lane.max_attempts,
                    final=outcome.final))
        if self.unanswered:
            self._add_unanswered(batch)
        return batch

    def _add_unanswered(self, batch: Batch) -> None:
        errors = {failure.lease.id: failure.error for failure in batch.failures}
        for outcome in self.pending:
            job = outcome.job
            if job.id in self.unanswered and not (outcome.committed or outcome.lease_lost):
                batch.unanswered[job.id] = (job.attempt, errors.get(job.id))

    def written(self, batch: Batch, completed: queue.WriteOutcome,
                failed: queue.FailOutcome) -> list[float]:
        """The batch is written: count and log it; returns when its retries fall due
        (monotonic), for the worker's own timers. Outcomes that arrived while it was being
        written stay pending, for the next batch."""
        written, self.pending = self.pending[:batch.size], self.pending[batch.size:]
        self.handed_over = False
        if self.unanswered:
            self.unanswered.difference_update(outcome.job.id for outcome in written)
        # Their arrival is not kept per outcome; from now, they wait SETTLE_DELAY at most.
        self.since = time.monotonic() if self.pending else None
        cancelled = completed.cancelled + failed.cancelled + batch.committed_cancelled
        self.counters.completed += (len(completed.applied) + len(batch.committed)
                                    - len(completed.cancelled) - len(batch.committed_cancelled))
        self.counters.failed += len(failed.retried)
        self.counters.dead += len(failed.dead)
        self.counters.cancelled += len(cancelled)
        if cancelled:
            log.info("jobs cancelled", job_ids=sorted(cancelled), lane=self.lane.name)
        lease_lost = completed.lease_lost + failed.lease_lost + batch.lost
        self.counters.lease_lost += len(lease_lost)
        if self.counters.work is not None:
            self._observe(self.counters.work, written, failed, lease_lost, cancelled)
        if lease_lost:
            log.warning("lost the lease before finishing; result discarded", job_ids=lease_lost,
                        lane=self.lane.name)
        self._log_failures(batch, failed)
        now = time.monotonic()
        retried = set(failed.retried)
        return [now + f.retry_delay for f in batch.failures if f.lease.id in retried]

    def _observe(self, work: WorkObserver, written: list[Outcome], failed: queue.FailOutcome,
                 lease_lost: list[int], cancelled: list[int]) -> None:
        """Each written outcome with its run time, per handler; one pass, as the batch's
        outcomes are mostly successes."""
        lost, dead, stopped = set(lease_lost), set(failed.dead), set(cancelled)
        # No measured time: the worker gave up on the run at the lane's timeout.
        timeout = self.lane.timeout or 0.0
        for outcome in written:
            job_id = outcome.job.id
            if job_id in lost:
                kind = LEASE_LOST
            elif job_id in stopped:
                kind = CANCELLED
            elif outcome.error is None:
                kind = DONE
            else:
                kind = DEAD if job_id in dead else FAILED
            seconds = outcome.seconds
            work.finished(outcome.job.handler, kind, timeout if seconds is None else seconds)
        # The fence refused these writes: the lease had passed to another run (or expired).
        work.totals.stale_completions += len(lost)

    def _log_failures(self, batch: Batch, failed: queue.FailOutcome) -> None:
        """One line per failed attempt and per dead job: what an operator needs without a
        query (never the payload); beyond the log's budget, counted (jobd.failure_log)."""
        retried, dead = set(failed.retried), set(failed.dead)
        budget_log, now = self.counters.failure_log, time.monotonic()
        for failure in batch.failures:
            is_dead = failure.lease.id in dead
            if not is_dead and failure.lease.id not in retried:
                continue  # its lease was lost: logged with the batch
            job = batch.failed_jobs[failure.lease.id].job
            # The handler's own words, which may quote a connection string it used.
            error = mask_passwords_in_text(first_line_of(failure.error))
            if not budget_log.admit(now):
                budget_log.hold(job.lane, job.handler, is_dead, error)
                continue
            fields = {"job_id": job.id, "handler": job.handler, "lane": job.lane,
                      "attempt": job.attempt,
                      "max_attempts": job.max_attempts or self.lane.max_attempts,
                      "error": error}
            if is_dead:
                log.error("job dead-lettered", **fields,
                          reason="payload cannot be decoded" if failure.final
                          else "attempts spent")
            else:
                # Seconds, a number, as every retry_in of the log.
                log.warning("job failed; will retry", **fields,
                            retry_in=round(failure.retry_delay, 1))
