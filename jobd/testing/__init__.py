"""Testing helpers for applications that use jobd, in their own pytest suites against their
real database.

- :func:`assert_enqueued`, :func:`refute_enqueued`, :func:`enqueued_jobs`: what the code
  under test enqueued, seen on the test's own connection (its open transaction included);
- :func:`run_jobs`: a lane's due jobs run in the test's process through the queue's real
  claim, complete, fail/backoff and dead-letter statements, transactional handlers in
  their real transaction; returns a :class:`RunSummary`;
- :class:`Clock`: frozen or advanced time for delayed jobs, retries and schedules;
- :func:`materialize_schedules`: one materializer step at that clock.

See docs/testing.md.
"""

from jobd.testing.clock import Clock
from jobd.testing.enqueued import EnqueuedJob, assert_enqueued, enqueued_jobs, refute_enqueued
from jobd.testing.results import HandlerBrokeTransaction, JobFailed, JobRun, RunSummary
from jobd.testing.runner import run_jobs
from jobd.testing.schedules import Fired, materialize_schedules

__all__ = ["Clock", "EnqueuedJob", "Fired", "HandlerBrokeTransaction", "JobFailed", "JobRun",
           "RunSummary", "assert_enqueued", "enqueued_jobs", "materialize_schedules",
           "refute_enqueued", "run_jobs"]
