"""``run_jobs``: a lane's due jobs, run in the test's process through the queue's real
statements, one job at a time.

Each job is claimed with the worker's claim (lane pauses and limits included), its handler
called, and its outcome written with the worker's statements: a success completes it (the
archive), a failure records the attempt with the lane's backoff (``failed`` until its retry
is due) or, with its attempts spent, moves it to the dead-letter queue. A ``@jobd.transactional``
handler runs through :func:`jobd.exactly_once.run_transactional`, as on a worker: its writes,
its effect key and the completion commit together. On the test's own connection that
transaction is a savepoint in the test's transaction, so the test sees the handler's writes
and rolls everything back at its end.

A plain handler there runs in a savepoint too (:class:`HandlerSavepoint`): the application
code it calls writes through the test's connection, so a statement of its that fails aborts
the transaction the job's outcome is recorded in, which on a worker, where the handler's
connection is the application's, it never is. Rolled back to the savepoint, the failure is
recorded with the handler's own error; a handler that ended the test's transaction, or left
it aborted and returned, raises :class:`HandlerBrokeTransaction` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jobd import config as config_module
from jobd import exactly_once, handlers, outbox, queue
from jobd.backoff import RetryPolicy
from jobd.config import Config, LaneConfig
from jobd.jobs import Job
from jobd.key_positions import next_key_cursor
from jobd.outcomes import error_text, within_timeout
from jobd.testing.clock import Clock
from jobd.testing.results import HandlerBrokeTransaction, JobFailed, JobRun, RunSummary
from jobd.testing.session import HandlerSavepoint, Session, Target, open_session

HandlerMap = Mapping[str, Callable[..., Any] | str]


# The name claims carry (jobs.claimed_by), so a job a test left claimed is easy to tell.
WORKER_PREFIX = "jobd.testing"


@dataclass(slots=True)
class _Plan:
    lane: LaneConfig
    handlers: dict[str, handlers.ResolvedHandler]
    worker: str
    config: Config | None
    # A fair lane's share cursor (jobd.claimer.next_key_cursor): one job at a time, the keys
    # still take turns.
    key_cursor: str | None = None

    @contextlib.contextmanager
    def outbox(self, schema: str) -> Iterator[None]:
        """The config's outbox senders and lane (without one, none and the default lane),
        and the run's ``schema``, where ``outbox.add`` records entries, as a worker installs
        them; for the run only: the next test may run with another config, or none."""
        config = self.config or Config()
        senders = handlers.resolve_all(config.outbox_senders)
        with outbox.installed({name: r.func for name, r in senders.items()},
                              config.outbox_lane, schema):
            yield


def _config(config: Config | str | Path | None) -> Config | None:
    if config is None or isinstance(config, Config):
        return config
    return config_module.load(config)


def _resolve(name: str, target: Callable[..., Any] | str) -> handlers.ResolvedHandler:
    if isinstance(target, str):
        return handlers.resolve(name, target)
    if not callable(target):
        raise TypeError(f"handler {name!r}: expected a function or a 'module:function' "
                        f"path, not {target!r}")
    return handlers.resolved(name, target)


def _plan(lane: str, given: HandlerMap | None, config: Config | None,
          retry: RetryPolicy | None) -> _Plan:
    # As `jobd enqueue -c` and `jobd pause -c` do: a lane the config does not declare is a
    # typo, or a lane no node with this config serves; run with defaults, the test would
    # pass where the daemon never runs the job.
    if config is not None and config.lanes and lane not in config.lanes:
        raise ValueError(f"unknown lane {lane!r}; the config has: "
                         + ", ".join(sorted(config.lanes)))
    lane_config = (config.lanes.get(lane) if config else None) or LaneConfig(lane)
    if retry is not None:
        lane_config = dataclasses.replace(lane_config, backoff=retry.backoff,
                                          max_attempts=retry.max_attempts)
    resolved = dict(handlers.resolve_all(config.worker_handlers())) if config else {}
    resolved.update({name: _resolve(name, target) for name, target in (given or {}).items()})
    if not resolved:
        raise ValueError("run_jobs needs handlers: handlers={name: function} or a config")
    return _Plan(lane_config, resolved, f"{WORKER_PREFIX}:{os.getpid()}:{lane}", config)


def run_jobs(target: Target, lane: str = "default", *, handlers: HandlerMap | None = None,
             config: Config | str | Path | None = None, limit: int | None = None,
             clock: Clock | None = None, raise_errors: bool = False,
             retry: RetryPolicy | None = None, schema: str | None = None) -> RunSummary:
    """Run the due jobs of ``lane``, one at a time, until none is due (or ``limit`` ran).

    ``target`` is the test's psycopg connection (the jobs its open transaction enqueued
    run inside it) or a database URL (committed jobs; every write commits). ``handlers``
    maps handler names to functions or ``module:function`` paths; ``config`` (a
    :class:`jobd.config.Config` or a YAML path) gives its handler allow-list, outbox
    senders, schema and the lane's settings (backoff, attempts, lease, limits); ``retry``
    overrides the lane's retry policy. ``clock`` decides what is due (default: the
    database clock). A retry that falls due during the call is run again in it, as a worker
    would. With ``raise_errors`` the first failed attempt raises :class:`JobFailed` once the
    failure is recorded.

    On the test's connection a plain handler runs in a savepoint of the test's transaction:
    when a statement of its fails and aborts the transaction, run_jobs rolls back to the
    savepoint (undoing the handler's writes) and records the handler's error, as a worker
    records it (``JobRun.rolled_back``). A handler that ends the test's transaction (COMMIT
    or ROLLBACK on it), or leaves it aborted and returns, raises
    :class:`HandlerBrokeTransaction`, whatever ``raise_errors`` says.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must not be negative, not {limit!r}")
    loaded = _config(config)
    plan = _plan(lane, handlers, loaded, retry)
    clock = clock or Clock()
    summary = RunSummary()
    with open_session(target, schema or (loaded.schema if loaded else None)) as session, \
            plan.outbox(session.schema):
        while limit is None or summary.ran < limit:
            now = clock.parameter(session.conn)
            claimed = _claim_one(session, plan, now)
            if claimed is None:
                break
            run = _run(session, plan, claimed, now)
            summary.runs.append(run)
            if raise_errors and run.error is not None:
                raise JobFailed(run, summary) from run.exception
    return summary


def _claim_one(session: Session, plan: _Plan, now: datetime | None) -> Job | None:
    lane = plan.lane
    with session.jobd_statements() as conn:
        jobs = queue.claim(conn, lane.name, plan.worker, 1, lane.visibility_timeout, now,
                           budget=lane.budget() if lane.limited else None,
                           order=lane.claim_order(plan.key_cursor) if lane.ordered else None)
    if jobs and lane.fair_by != "none":
        plan.key_cursor = next_key_cursor(plan.key_cursor, jobs)
    return _in_utc(jobs[0]) if jobs else None


def _in_utc(job: Job) -> Job:
    """``job`` with its times in UTC, as a worker's session (UTC) reads them: the test's
    connection, or one to the URL, reads them in its own TimeZone."""
    return Job(job.id, job.lease_token, job.lane, job.handler, job.payload_json, job.priority,
               job.run_at.astimezone(UTC), job.attempt, job.max_attempts, job.idempotency_key,
               job.created_at.astimezone(UTC), job.lease_until.astimezone(UTC),
               job.fairness_key)


def _run(session: Session, plan: _Plan, job: Job, now: datetime | None) -> JobRun:
    resolved = plan.handlers.get(job.handler)
    if resolved is None:
        try:
            raise LookupError(f"no handler named {job.handler!r} in run_jobs' handlers "
                              f"(lane {job.lane!r})")
        except LookupError as exc:
            return _failed(session, plan, job, exc, now)
    if resolved.is_transactional:
        return _transactional(session, plan, resolved, job, now)
    return _plain(session, plan, resolved, job, now)


def _plain(session: Session, plan: _Plan, resolved: handlers.ResolvedHandler, job: Job,
           now: datetime | None) -> JobRun:
    """A plain handler's call, in a savepoint of the test's transaction on its connection
    (:class:`HandlerSavepoint`): a statement of the handler's that fails there aborts the
    transaction run_jobs records the outcome in, which on a worker it never could."""
    savepoint = session.handler_savepoint()
    try:
        _call(resolved, job, plan.lane.timeout)
    except BaseException as exc:  # as on a worker: whatever a handler raises fails its job
        savepoint.close()
        _check_transaction(savepoint, job, exc)
        run = _failed(session, plan, job, exc, now, rolled_back=savepoint.rolled_back)
    else:
        savepoint.close()
        _check_transaction(savepoint, job, None)
        run = _completed(session, job, now)
    if savepoint.ended and run.outcome == "lease_lost":
        # A ROLLBACK: the claim went with it, and the test's own work in the transaction.
        raise HandlerBrokeTransaction(_ended(job, run.exception), job) from run.exception
    return _interrupted(run)


def _interrupted(run: JobRun) -> JobRun:
    """``run``, recorded as a worker records it. A KeyboardInterrupt the handler raised
    fails its job as on a worker and then goes on from here: in the test's process it
    cannot be told from Ctrl-C, which must still stop the test run."""
    if isinstance(run.exception, KeyboardInterrupt):
        raise run.exception
    return run


def _check_transaction(savepoint: HandlerSavepoint, job: Job,
                       exc: BaseException | None) -> None:
    """Raise when the handler left nothing the job's outcome can be recorded in as a
    worker would record it; the handler's exception, if any, is the cause."""
    if savepoint.closed:
        raise HandlerBrokeTransaction(_closed(job, exc), job) from exc
    if savepoint.missing is not None:
        raise HandlerBrokeTransaction(_ended(job, exc), job) from exc or savepoint.missing
    if savepoint.rolled_back and exc is None:
        raise HandlerBrokeTransaction(
            f"handler {job.handler!r} (job {job.id}) returned, but left the test's "
            f"transaction aborted: a statement it ran on the test's connection failed and it "
            f"went on without raising the error. On a worker that statement aborts the "
            f"application's own transaction, not the one jobd records the job in, so what a "
            f"worker would record is unknown here: run_jobs rolled the test's transaction "
            f"back to where it stood before the handler's call (undoing the handler's writes "
            f"on it) and recorded nothing; the job stays claimed. Let the error propagate (the "
            f"job then fails and is retried), or run a statement that may fail in a savepoint "
            f"of its own (with conn.transaction(): ...).", job)


def _raised(exc: BaseException | None) -> str:
    return f", then raised {type(exc).__name__} (the cause below)" if exc else ""


def _ended(job: Job, exc: BaseException | None) -> str:
    return (f"handler {job.handler!r} (job {job.id}) ended the test's transaction itself (a "
            f"COMMIT or ROLLBACK on the test's connection){_raised(exc)}. run_jobs claimed "
            f"the job in that transaction and records the attempt's outcome in it: a ROLLBACK took "
            f"the claim away with the test's work, a COMMIT made the test's work permanent, "
            f"and what the handler ran after it is in a transaction run_jobs did not open, so "
            f"the outcome cannot be recorded as a worker would record it. On a worker a "
            f"handler's connection is never the one jobd records the job on. Keep COMMIT and "
            f"ROLLBACK out of code that runs on the test's connection (with conn.transaction(): "
            f"... takes a savepoint, whose rollback undoes a part of the work), or give "
            f"run_jobs a database URL, where its connection and the handler's are separate.")


def _closed(job: Job, exc: BaseException | None) -> str:
    return (f"handler {job.handler!r} (job {job.id}) closed the test's connection "
            f"(conn.close(), or `with conn:` around its work, which commits and closes "
            f"it){_raised(exc)}. The test's transaction, in which run_jobs claimed the job and "
            f"records the attempt's outcome, went with it, so the outcome cannot be recorded "
            f"as a worker would record it. Leave closing the connection to the code that "
            f"opened it (the test's fixture), or give run_jobs a database URL, where its "
            f"connection and the handler's are separate.")


def _ended_transactional(job: Job, marker: HandlerSavepoint) -> str:
    how = ("closed its connection (conn.close())" if marker.closed
           else "ended its transaction itself (a COMMIT or ROLLBACK)")
    return (f"transactional handler {job.handler!r} (job {job.id}) {how}; its connection "
            f"is the test's, so the transaction it ended was the test's, in which run_jobs "
            f"claimed the job: a ROLLBACK or a close took the claim away with the test's "
            f"work, a COMMIT made them permanent (the job stays claimed in the database), and "
            f"the attempt's outcome cannot be recorded as a worker would record it. On a "
            f"worker the attempt fails (the cause below): the transaction it ended was the "
            f"one its writes, its effect key and the job's completion were to commit in. "
            f"Raise an exception to roll the handler's work back (with conn.transaction(): "
            f"... undoes a part of it).")


def _completed(session: Session, job: Job, now: datetime | None) -> JobRun:
    with session.jobd_statements() as conn:
        written = queue.complete(conn, [job.lease], now)
    if not written.applied:
        return JobRun(job, "lease_lost")
    return JobRun(job, "cancelled" if written.cancelled else "done")


def _transactional(session: Session, plan: _Plan, resolved: handlers.ResolvedHandler,
                   job: Job, now: datetime | None) -> JobRun:
    """A transactional run, through the worker's own code. On the test's connection its
    transaction is a savepoint of the test's, and a savepoint of run_jobs' own around it
    tells whether the handler ended the test's transaction (a COMMIT, a ROLLBACK, a close
    on its connection): on a worker that fails the attempt, here it took the claim with
    it, or made the test's work permanent."""
    raised: BaseException | None = None
    result = "done"
    with session.handler_connection() as conn:
        marker = session.handler_savepoint()
        try:
            result = exactly_once.run_transactional(conn, job, resolved.func, session.schema,
                                                    plan.lane.timeout)
        except BaseException as exc:  # as on a worker: whatever a handler raises fails its job
            raised = exc
        marker.close()
    if marker.ended:
        raise HandlerBrokeTransaction(_ended_transactional(job, marker), job) from raised
    if isinstance(raised, exactly_once.LeaseLost):
        return JobRun(job, "lease_lost")
    if raised is not None:
        return _interrupted(_failed(session, plan, job, raised, now))
    return JobRun(job, "cancelled" if result == "cancelled" else "done",
                  replayed=result == "replayed")


def _call(resolved: handlers.ResolvedHandler, job: Job, timeout: float | None) -> None:
    if not resolved.is_async:
        handlers.check_ran(resolved.name, resolved.func(job))
        return
    coroutine: Coroutine[Any, Any, Any] = resolved.func(job)
    if timeout:
        coroutine = within_timeout(coroutine, timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        in_async_code = False
    else:
        in_async_code = True
    if not in_async_code:
        # Outside the except block: the handler's exception must not carry the RuntimeError
        # above as its context (its stored traceback would show it).
        asyncio.run(coroutine)
        return
    # Called from async code (an async test): asyncio.run needs a thread without a loop.
    with concurrent.futures.ThreadPoolExecutor(1, "jobd-testing-async") as executor:
        executor.submit(asyncio.run, coroutine).result()


def _failed(session: Session, plan: _Plan, job: Job, exc: BaseException,
            now: datetime | None, *, rolled_back: bool = False) -> JobRun:
    # Recorded as the worker records it (a timeout: the deadline, no traceback).
    error = error_text(exc)
    policy = plan.lane.retry_policy
    failure = queue.Failure(job.lease, error, policy.backoff.delay(job.attempt),
                            policy.max_attempts, final=job.undecodable)
    with session.jobd_statements() as conn:
        outcome = queue.fail(conn, [failure], now)
    if outcome.retried:
        return JobRun(job, "failed", error, outcome.retry_at.get(job.id), exception=exc,
                      rolled_back=rolled_back)
    kind = "dead" if outcome.dead else "cancelled" if outcome.cancelled else "lease_lost"
    return JobRun(job, kind, error, exception=exc, rolled_back=rolled_back)
