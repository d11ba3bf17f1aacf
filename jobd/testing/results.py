"""What ``run_jobs`` reports: one :class:`JobRun` per job it ran, in a :class:`RunSummary`,
and :class:`JobFailed`, raised under ``raise_errors``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from jobd.jobs import Job
from jobd.outcomes import first_line_of


@dataclass(frozen=True, slots=True)
class JobRun:
    """One job that :func:`run_jobs` ran, and how its attempt ended: ``done``, ``failed``
    (to be retried at ``retry_at``), ``dead`` (moved to the dead-letter queue),
    ``cancelled`` (asked to stop) or ``lease_lost``."""

    job: Job
    outcome: str
    error: str | None = None  # the stored error text: its headline, then the traceback
    retry_at: datetime | None = None
    # A transactional job whose effect key had already committed: the handler was skipped
    # and the job completed (jobd.exactly_once).
    replayed: bool = False
    # What the handler raised (JobFailed's __cause__).
    exception: BaseException | None = field(default=None, repr=False, compare=False)
    # A plain handler's statement on the test's connection failed and aborted the test's
    # transaction: run_jobs rolled it back to where it stood before the handler's call (the
    # handler's writes on it undone) and recorded the failure.
    rolled_back: bool = False

    @property
    def id(self) -> int:
        return self.job.id

    @property
    def handler(self) -> str:
        return self.job.handler


@dataclass(slots=True)
class RunSummary:
    """What one :func:`run_jobs` call did, in the order the jobs ran."""

    runs: list[JobRun] = field(default_factory=list)

    def _count(self, outcome: str) -> int:
        return sum(1 for run in self.runs if run.outcome == outcome)

    @property
    def ran(self) -> int:
        return len(self.runs)

    @property
    def done(self) -> int:
        return self._count("done")

    @property
    def failed(self) -> int:
        """Failed attempts that will be retried."""
        return self._count("failed")

    @property
    def dead(self) -> int:
        return self._count("dead")

    @property
    def cancelled(self) -> int:
        return self._count("cancelled")

    @property
    def errors(self) -> list[str]:
        """The error text (headline and traceback) of every failed attempt."""
        return [run.error for run in self.runs if run.error is not None]

    def __str__(self) -> str:
        counts = ", ".join(f"{self._count(o)} {o}" for o in
                           ("done", "failed", "dead", "cancelled", "lease_lost") if self._count(o))
        lines = [f"ran {self.ran} job(s)" + (f": {counts}" if counts else "")]
        lines += [f"  job {run.id} {run.handler!r} attempt {run.job.attempt}: "
                  f"{first_line_of(run.error)}" + (_ROLLED_BACK if run.rolled_back else "")
                  for run in self.runs if run.error]
        return "\n".join(lines)


_ROLLED_BACK = " (it aborted the test's transaction: its writes were rolled back)"

# What became of a job whose attempt failed, by the attempt's outcome.
_AFTER_A_FAILURE = {
    "failed": "will be retried",
    "dead": "is dead (in the dead-letter queue)",
    "cancelled": "was cancelled",
    "lease_lost": "had lost its lease",
}


class JobFailed(Exception):
    """A job's attempt failed under ``run_jobs(..., raise_errors=True)``. The failure is
    recorded in the database first; the handler's exception is the ``__cause__``."""

    def __init__(self, run: JobRun, summary: RunSummary) -> None:
        assert run.error is not None
        what_now = _AFTER_A_FAILURE.get(run.outcome, f"is {run.outcome}")
        rolled_back = ("\nA statement of the handler's on the test's connection aborted the "
                       "test's transaction: run_jobs rolled the transaction back to where it "
                       "stood before the handler's call, undoing the handler's writes on it, "
                       "and recorded the failure there." if run.rolled_back else "")
        super().__init__(f"job {run.id} ({run.handler!r}, attempt {run.job.attempt}) "
                         f"failed and {what_now}:\n{run.error}{rolled_back}")
        self.run = run
        self.summary = summary


class HandlerBrokeTransaction(Exception):
    """A handler run on the test's connection left its transaction in a state
    ``run_jobs`` cannot go on from as a worker would: it ended the transaction the job was
    claimed in (a COMMIT or ROLLBACK on the test's connection, or closed it), or, a plain
    handler, left it aborted and returned as if it had succeeded. The handler's exception,
    if it raised one, is the ``__cause__``."""

    def __init__(self, message: str, job: Job) -> None:
        super().__init__(message)
        self.job = job
