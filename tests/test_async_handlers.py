"""``async def`` handlers on their event loop: how each way a run can end is recorded, and
the worker's own deadline for a run that does not end at its timeout. Pure: the runner's
thread and event loop, no database."""

from __future__ import annotations

import asyncio
import functools
import gc
import queue
import threading
import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from jobd import handlers, jobs, logs, outcomes, protocol
from jobd.async_handlers import AsyncHandlers
from jobd.claimer import Claimer
from jobd.completer import Completer, Counters
from jobd.config import LaneConfig
from jobd.db import DEFAULT_SCHEMA
from jobd.handler_runner import HandlerRunner
from jobd.loop_watch import BLOCKED_AFTER
from jobd.outcomes import CANCELLED_ERROR, Outcome
from jobd.slots import ASYNC_GRACE, Slots

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def job(job_id: int, lease_token: int = 1) -> jobs.Job:
    return jobs.Job(job_id, lease_token, "default", "h", "{}", 0, NOW, 1, None, None, NOW, NOW)


def stop(runner: AsyncHandlers | None) -> None:
    assert runner is not None
    runner.close()
    assert runner.loop.is_closed()


def run(func: Any, *, timeout: float | None = None, cancel: bool = False,
        cancel_once: threading.Event | None = None) -> Outcome:
    """The outcome of one run of ``func``; cancelled at once with ``cancel``, or once
    ``cancel_once`` is set."""
    delivered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
    runner = AsyncHandlers(timeout, delivered.put)
    the_job = job(7)
    try:
        runner.start(handlers.resolved("h", func), the_job)
        if cancel_once is not None:
            assert cancel_once.wait(10)
        if cancel or cancel_once is not None:
            the_job.request_cancel()
            runner.cancel(the_job.id)
        return delivered.get(timeout=10)
    finally:
        stop(runner)



def test_a_burst_of_starts_runs_every_job_once_on_few_wake_ups_of_the_loop() -> None:
    """Starts are handed to the loop in batches (one wake-up of the loop for all the runs
    handed over before it looks): none may be lost to the race between handing one over
    and the loop emptying the queue, and none may run twice."""
    delivered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
    runner = AsyncHandlers(None, delivered.put)
    wake_ups = 0
    call_soon_threadsafe = runner.loop.call_soon_threadsafe

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal wake_ups
        wake_ups += 1
        return call_soon_threadsafe(*args, **kwargs)

    runner.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    async def noop(_job: jobs.Job) -> None:
        await asyncio.sleep(0)

    resolved = handlers.resolved("h", noop)
    try:
        for job_id in range(1, 20_001):
            runner.start(resolved, job(job_id))
        ids = [delivered.get(timeout=10).job.id for _ in range(20_000)]
        assert sorted(ids) == list(range(1, 20_001))
        assert delivered.empty()
        assert wake_ups < 20_000
    finally:
        stop(runner)

def test_a_run_that_returns_succeeds() -> None:
    async def handler(job: jobs.Job) -> None:
        await asyncio.sleep(0)

    outcome = run(handler)
    assert outcome.error is None and outcome.job.id == 7
    assert outcome.seconds is not None and outcome.seconds >= 0


def test_a_run_that_raises_records_the_headline_and_traceback() -> None:
    async def handler(job: jobs.Job) -> None:
        raise ValueError("no such order")

    outcome = run(handler)
    assert outcome.error is not None
    assert outcome.error.startswith("ValueError: no such order\n")
    assert "Traceback" in outcome.error and not outcome.final


def test_a_run_over_the_lanes_timeout_records_the_deadline_alone() -> None:
    async def handler(job: jobs.Job) -> None:
        await asyncio.sleep(30)

    assert run(handler, timeout=0.05).error == "timed out after 0.05s"


def test_a_handlers_own_timeout_error_is_an_ordinary_failure() -> None:
    async def handler(job: jobs.Job) -> None:
        raise TimeoutError("the upstream API did not answer")

    error = run(handler, timeout=30).error
    assert error is not None
    assert error.startswith("TimeoutError: the upstream API did not answer\n")


def test_a_run_cancelled_before_it_started_records_that_it_was_asked_to_stop() -> None:
    async def handler(job: jobs.Job) -> None:
        await asyncio.sleep(30)

    assert run(handler, cancel=True).error == CANCELLED_ERROR


def test_a_run_cancelled_while_it_awaits_records_that_it_was_asked_to_stop() -> None:
    awaiting = threading.Event()

    async def handler(job: jobs.Job) -> None:
        awaiting.set()
        await asyncio.sleep(30)

    assert run(handler, cancel_once=awaiting).error == CANCELLED_ERROR


def test_a_cancelled_error_nobody_asked_for_is_an_ordinary_failure() -> None:
    async def handler(job: jobs.Job) -> None:
        raise asyncio.CancelledError("a library gave up")

    error = run(handler).error
    assert error is not None and error.startswith("CancelledError: a library gave up\n")


def test_a_run_that_swallows_the_cancel_of_its_timeout_has_timed_out() -> None:
    async def handler(job: jobs.Job) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.01)

    assert run(handler, timeout=0.05).error == "timed out after 0.05s"


def test_a_run_that_blocks_the_event_loop_past_its_timeout_has_timed_out() -> None:
    async def handler(job: jobs.Job) -> None:
        time.sleep(0.2)  # the cancel cannot come while the loop is blocked

    assert run(handler, timeout=0.05).error == "timed out after 0.05s"


def test_a_job_claimed_again_while_its_lost_run_goes_on_gets_both_outcomes() -> None:
    # The lease of run 1 was swept and this worker claimed the job again: the slots keep the
    # outcome of the lease they hold, so each run must deliver its own.
    delivered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
    runner = AsyncHandlers(None, delivered.put)
    release_first = threading.Event()

    async def handler(job: jobs.Job) -> None:
        if job.lease_token == 1:
            while not release_first.is_set():
                await asyncio.sleep(0.005)

    try:
        resolved = handlers.resolved("h", handler)
        runner.start(resolved, job(7, lease_token=1))
        runner.start(resolved, job(7, lease_token=2))
        second = delivered.get(timeout=10)
        release_first.set()
        first = delivered.get(timeout=10)
        assert [(o.job.lease_token, o.error) for o in (second, first)] == [(2, None), (1, None)]
    finally:
        stop(runner)


def test_what_an_async_handler_logs_names_its_job() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(job: jobs.Job) -> None:
        await asyncio.sleep(0)
        seen.append(dict(logs._add_job(None, "info", {"event": "hello"})))

    run(handler)
    assert seen == [{"event": "hello", "job_id": 7, "handler": "h"}]


def test_the_worker_fails_an_async_run_that_has_not_ended_a_grace_after_its_timeout() -> None:
    lane = LaneConfig("default", concurrency=2, timeout=0.05)
    spec = protocol.WorkerSpec(
        worker_id="test-node:default#0:async", lane=lane, handlers={},
        database_url="postgresql:///unused", schema=DEFAULT_SCHEMA, slot=0, generation=1,
        status_fd=-1, wake_fd=-1, shutdown_timeout=1.0)
    running, release = threading.Event(), threading.Event()

    async def handler(job: jobs.Job) -> None:
        running.set()
        release.wait(10)  # blocks the event loop: its own deadline cannot cancel it

    runner = HandlerRunner(spec, {"h": handlers.resolved("h", handler)})
    completer = Completer(lane, Counters.for_spec(spec))
    slots = Slots(lane, runner, Claimer(lane, spec.worker_id), completer)
    try:
        slots.start(job(7))
        assert running.wait(10)
        [run] = slots.inflight.values()
        assert run.started is not None
        slots.expire_timeouts(run.started + 0.05 + ASYNC_GRACE / 2)
        assert not run.abandoned and completer.pending == []
        slots.expire_timeouts(run.started + 0.05 + ASYNC_GRACE)
        assert run.abandoned
        assert [o.error for o in completer.pending] == ["timed out after 0.05s"]
    finally:
        release.set()
        # The run's own outcome, once the loop is free again (the slots would ignore it:
        # abandoned); awaited so that no task is left pending when the loop stops.
        runner.outcomes.get(timeout=10)
        assert runner.async_handlers is not None
        stop(runner.async_handlers)


def async_runner(handler: Any) -> HandlerRunner:
    lane = LaneConfig("default", concurrency=2)
    spec = protocol.WorkerSpec(
        worker_id="test-node:default#0:async", lane=lane, handlers={},
        database_url="postgresql:///unused", schema=DEFAULT_SCHEMA, slot=0, generation=1,
        status_fd=-1, wake_fd=-1, shutdown_timeout=1.0)
    return HandlerRunner(spec, {"h": handlers.resolved("h", handler)})


def blocking_handler(running: threading.Event, release: threading.Event,
                     in_a_child_task: bool) -> Any:
    async def blocks() -> None:
        running.set()
        release.wait(10)  # a blocking call in an async def: nothing else on the loop runs

    async def handler(job: jobs.Job) -> None:
        if in_a_child_task:
            await asyncio.gather(blocks())  # a task of its own, started by the handler's
        else:
            await blocks()

    return handler


@pytest.mark.parametrize("in_a_child_task", [False, True])
def test_a_handler_that_blocks_the_event_loop_is_named_and_so_is_the_end_of_it(
    in_a_child_task: bool,
) -> None:
    running, release = threading.Event(), threading.Event()
    runner = async_runner(blocking_handler(running, release, in_a_child_task))
    assert runner.async_handlers is not None
    try:
        runner.start(SimpleNamespace(job=job(7), started=None, taken_back=False))
        assert running.wait(10)
        now = time.monotonic()
        with capture_logs() as logged:
            runner.watch_event_loop(now)  # posts a probe, which cannot run
            runner.watch_event_loop(now + BLOCKED_AFTER / 2)
            assert logged == []
            runner.watch_event_loop(now + BLOCKED_AFTER)
            runner.watch_event_loop(now + BLOCKED_AFTER + 1)  # said once per episode
        [warning] = logged
        assert warning["log_level"] == "warning"
        assert "an async handler is blocking the event loop" in warning["event"]
        assert (warning["job_id"], warning["handler"], warning["blocked_s"]) == (
            7, "h", BLOCKED_AFTER)
        release.set()
        runner.outcomes.get(timeout=10)
        freed: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10
        # At the last check's instant: a check that comes before the probe has run keeps the
        # wait it sees as the episode's length, so a later instant would lengthen it.
        while not freed and time.monotonic() < deadline:
            with capture_logs() as logged:
                runner.watch_event_loop(now + BLOCKED_AFTER + 1)
            freed = logged
            time.sleep(0.01)
        assert [(e["event"], e["blocked_s"]) for e in freed] == [
            ("the event loop runs again", BLOCKED_AFTER + 1)]
    finally:
        release.set()
        stop(runner.async_handlers)


def test_a_loop_that_answers_is_never_called_blocked() -> None:
    async def handler(job: jobs.Job) -> None:
        await asyncio.sleep(0.5)  # waits without blocking the loop

    runner = async_runner(handler)
    assert runner.async_handlers is not None
    try:
        runner.start(SimpleNamespace(job=job(7), started=None, taken_back=False))
        now = time.monotonic()
        with capture_logs() as logged:
            runner.watch_event_loop(now)
            deadline = time.monotonic() + 10
            while runner.async_handlers.watch._probe_sent_at is not None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            runner.watch_event_loop(now + 5 * BLOCKED_AFTER)
        assert logged == []
        runner.outcomes.get(timeout=10)
    finally:
        stop(runner.async_handlers)


# --- an async function behind a plain decorator ----------------------------------------------


def logged(func: Any) -> Any:
    """A user's decorator that keeps the function it wraps (functools.wraps)."""
    @functools.wraps(func)
    def wrapper(*args: Any) -> Any:
        return func(*args)
    return wrapper


def test_an_async_function_behind_a_decorator_that_kept_it_runs_as_async() -> None:
    ran: list[int] = []

    @logged
    async def handler(job: jobs.Job) -> None:
        await asyncio.sleep(0)
        ran.append(job.id)

    assert handlers.resolved("h", handler).is_async
    assert run(handler).error is None and ran == [7]


def test_a_handler_that_returns_a_coroutine_without_running_it_fails_its_job() -> None:
    # A decorator that hides its async function (no functools.wraps): the call returns a
    # coroutine and nothing runs. Counted done before, with only a "never awaited" warning.
    ran: list[int] = []

    async def body(job: jobs.Job) -> None:
        ran.append(job.id)

    def handler(job: jobs.Job) -> Any:
        return body(job)

    runner = async_runner(handler)
    assert not runner.is_async("h")
    try:
        runner.start(SimpleNamespace(job=job(7), started=None, taken_back=False))
        outcome = runner.outcomes.get(timeout=10)
    finally:
        runner.close()
    assert outcome.error is not None and "returned coroutine instead of running" in outcome.error
    assert ran == []


def test_a_handler_that_raises_generator_exit_fails_its_job() -> None:
    # Let through as if the loop were closing under it: the run delivered nothing, and its
    # job stayed claimed, its lease renewed, for as long as the worker ran.
    async def handler(job: jobs.Job) -> None:
        raise GeneratorExit

    outcome = run(handler)
    assert outcome.error is not None and outcome.error.startswith("GeneratorExit")


def _ends_run_forever(how: str) -> Any:
    async def bad() -> None:
        if how == "stop":
            asyncio.get_running_loop().stop()
        else:
            raise SystemExit(3) if how == "SystemExit" else KeyboardInterrupt

    async def handler(job: jobs.Job) -> None:
        asyncio.get_running_loop().create_task(bad())  # its exception reaches no _run

    return handler


@pytest.mark.parametrize("how", ["SystemExit", "KeyboardInterrupt", "stop"])
def test_a_task_that_ends_the_event_loop_leaves_it_running_for_the_next_jobs(how: str) -> None:
    # asyncio lets SystemExit and KeyboardInterrupt of a task out of run_forever, and
    # loop.stop() returns from it: the event loop's thread ended, and every later async job
    # of the worker waited forever while the worker reported itself healthy.
    delivered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
    runner = AsyncHandlers(None, delivered.put)

    async def fine(job: jobs.Job) -> None:
        await asyncio.sleep(0.01)

    try:
        with capture_logs() as logged:
            runner.start(handlers.resolved("bad", _ends_run_forever(how)), job(1))
            assert delivered.get(timeout=10).error is None  # it returned before its task
            for job_id in (2, 3):
                runner.start(handlers.resolved("fine", fine), job(job_id))
                outcome = delivered.get(timeout=10)
                assert (outcome.job.id, outcome.error) == (job_id, None)
        errors = [entry for entry in logged if entry["log_level"] == "error"]
        assert len(errors) == 1
        if how != "stop":
            assert errors[0]["job_id"] == 1 and errors[0]["error"].startswith(how)
    finally:
        stop(runner)


def test_a_generator_handler_is_refused_and_one_behind_a_wrapper_fails_its_job() -> None:
    # Its body runs only as it is iterated: the job was counted done, nothing having run.
    ran: list[int] = []

    def body(job: jobs.Job) -> Any:
        ran.append(job.id)
        yield

    async def async_body(job: jobs.Job) -> Any:
        ran.append(job.id)
        yield

    for function in (body, async_body):
        with pytest.raises(handlers.HandlerImportError, match="is a generator function"):
            handlers.resolved("h", function)
        with pytest.raises(handlers.HandlerImportError, match="is a generator function"):
            handlers.resolved("h", functools.wraps(function)(lambda job, f=function: f(job)))

        def hidden(job: jobs.Job, function: Any = function) -> Any:
            return function(job)

        runner = async_runner(hidden)
        try:
            runner.start(SimpleNamespace(job=job(7), started=None, taken_back=False))
            outcome = runner.outcomes.get(timeout=10)
        finally:
            runner.close()
        assert outcome.error is not None and "generator instead of running" in outcome.error
    assert ran == []


def test_a_failed_task_group_names_what_failed_in_its_first_line() -> None:
    # The first line is what `jobd jobs show`, `jobs list` and the log print; for a TaskGroup
    # it was "unhandled errors in a TaskGroup (2 sub-exceptions)", naming neither.
    async def handler(job: jobs.Job) -> None:
        async def charge() -> None:
            raise ValueError("card declined")

        async def reserve() -> None:
            raise KeyError("sku-7")

        async with asyncio.TaskGroup() as group:
            group.create_task(charge())
            group.create_task(reserve())

    error = run(handler).error
    assert error is not None
    first = outcomes.first_line_of(error)
    assert first.startswith("ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions)")
    assert "ValueError: card declined" in first and "KeyError: 'sku-7'" in first
    assert "Traceback" in error


def test_a_long_error_message_leaves_the_traceback_its_frames() -> None:
    # An error that carries a response body: the traceback's tail, which is what is kept,
    # was the message over again, and the frames (where it was raised) were lost.
    async def handler(job: jobs.Job) -> None:
        def call_the_api() -> None:
            raise RuntimeError("HTTP 502: " + "<html>" * 2000)

        call_the_api()

    error = run(handler).error
    assert error is not None
    assert error.startswith("RuntimeError: HTTP 502: <html>")
    assert "in call_the_api" in error and 'raise RuntimeError("HTTP 502: "' in error
    assert len(error) <= 2 * outcomes.MAX_ERROR_CHARS + 1


def test_an_error_in_a_task_the_handler_never_awaited_names_the_job() -> None:
    # asyncio reports it ("Task exception was never retrieved") when the task is collected,
    # after the job's own records, and named no job.
    delivered: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
    runner = AsyncHandlers(None, delivered.put)

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise ValueError("lost in a task")

    async def handler(job: jobs.Job) -> None:
        asyncio.get_running_loop().create_task(fails_later())

    try:
        with capture_logs() as logged:
            runner.start(handlers.resolved("spawner", handler), job(5))
            assert delivered.get(timeout=10).error is None
            deadline = time.monotonic() + 10
            while not any(entry.get("job_id") == 5 for entry in logged):
                assert time.monotonic() < deadline, logged
                runner.loop.call_soon_threadsafe(gc.collect)
                time.sleep(0.01)
        [entry] = [entry for entry in logged if entry.get("job_id") == 5]
        assert entry["log_level"] == "error"
        assert entry["event"] == "Task exception was never retrieved"
        assert (entry["handler"], entry["error"]) == ("h", "ValueError: lost in a task")
        assert isinstance(entry["exc_info"], ValueError)
    finally:
        stop(runner)
