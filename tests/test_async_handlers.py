"""``async def`` handlers on their event loop: how each way a run can end is recorded.
Pure: the runner's thread and event loop, no database."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from datetime import UTC, datetime
from typing import Any

from jobd import handlers, jobs
from jobd.async_handlers import AsyncHandlers
from jobd.outcomes import CANCELLED_ERROR, Outcome

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def job(job_id: int) -> jobs.Job:
    return jobs.Job(job_id, 1, "default", "h", "{}", 0, NOW, 1, None, None, NOW, NOW)


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
        runner.loop.call_soon_threadsafe(runner.loop.stop)
        deadline = time.monotonic() + 10
        while runner.loop.is_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        runner.loop.close()


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
