"""``async def`` handlers: each job a task on an event loop running on a thread of its own,
its outcome handed back through the runner's ``deliver``. A cancel cancels the task
(CancelledError at the handler's next await); the lane's timeout cancels it too."""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeAlias

import structlog

from jobd import forks, jobs, logs
from jobd.handlers import ResolvedHandler
from jobd.loop_watch import LoopWatch
from jobd.outcomes import CANCELLED_ERROR, Outcome, failed, within_timeout
from jobd.run_board import RunBoard

log = structlog.get_logger("jobd.worker")

# The attribute naming, on a task a handler's task started, the job it belongs to.
_STARTED_BY = "_jobd_started_by"

# What a task factory is handed: before 3.12, asyncio still takes generator-based coroutines.
if sys.version_info >= (3, 12):
    _TaskCoroutine: TypeAlias = Coroutine[Any, Any, Any]
else:
    _TaskCoroutine: TypeAlias = Coroutine[Any, Any, Any] | Generator[Any, None, Any]


class AsyncHandlers:
    def __init__(self, timeout: float | None, deliver: Callable[[Outcome], None],
                 board: RunBoard | None = None) -> None:
        self.timeout = timeout
        self._deliver = deliver
        self.board = board  # the runs in progress, for the supervisor (jobd.run_board)
        # The tasks of running jobs, by job id; touched only on the event loop's thread. A job
        # claimed again while a run whose lease was lost still goes on maps to its new run.
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        # The job each running task runs, the tasks a handler started included, for the watch
        # (read from the worker's thread).
        self._jobs: dict[asyncio.Task[Any], jobs.Job] = {}
        # Runs to start, handed over from the worker's thread; the loop takes them all in one
        # callback, so a batch of starts costs one wake-up of the loop, not one each.
        self._starts: collections.deque[tuple[ResolvedHandler, jobs.Job]] = collections.deque()
        self._starts_scheduled = False
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(self._new_task)
        self.loop.set_exception_handler(self._on_unhandled_error)
        self.watch = LoopWatch(self.loop, self._job_of)
        self._closing = False
        self._thread = threading.Thread(target=self._run_loop, name="jobd-async", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the event loop for good and close it (its unfinished runs are dropped)."""
        self._closing = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def _run_loop(self) -> None:
        """The event loop's thread, for the worker's life. A handler can end ``run_forever``
        under every other async job of the worker: asyncio lets SystemExit and
        KeyboardInterrupt out of the loop when a task raises them (one a handler started
        with ``create_task``, whose exception no ``_run`` catches), and ``loop.stop()``
        returns from it. The thread gone, those jobs would wait forever, their leases still
        renewed and the worker still reporting as healthy; so the loop runs again, where
        its tasks and callbacks wait as they were."""
        while not self._closing:
            try:
                self.loop.run_forever()
            except BaseException as exc:  # the loop must go on, whatever ended it
                job = self._job_that_raised(exc)
                log.error("a task of an async handler raised out of the event loop; it runs on",
                          error=f"{type(exc).__name__}: {exc}",
                          job_id=None if job is None else job.id,
                          handler=None if job is None else job.handler)
            else:
                if not self._closing:
                    log.error("an async handler stopped the event loop (loop.stop()); it "
                              "runs on")

    def _job_that_raised(self, exc: BaseException) -> jobs.Job | None:
        """The job whose task (or a task it started) ended with ``exc``; its done callbacks
        have not run yet, so it is still mapped (on the loop's thread, the loop stopped)."""
        for task, job in list(self._jobs.items()):
            if task.done() and not task.cancelled() and task.exception() is exc:
                return job
        return None

    def _new_task(self, loop: asyncio.AbstractEventLoop, coro: _TaskCoroutine,
                  **kwargs: Any) -> asyncio.Task[Any]:
        """Every task of the loop (its task factory): one that a handler's task starts
        (``asyncio.gather``, ``wait_for``, ``create_task``) belongs to the same job, so that
        the watch names the job when such a task is the one blocking the loop."""
        task = asyncio.Task(coro, loop=loop, **kwargs)
        parent = asyncio.current_task(loop)
        job = None if parent is None else self._jobs.get(parent)
        if job is not None:
            self._jobs[task] = job
            task.add_done_callback(self._forget)
            # Kept on the task past its end: asyncio reports an exception nobody retrieved
            # when the task is collected, after _forget.
            setattr(task, _STARTED_BY, job)
        return task

    def _on_unhandled_error(self, loop: asyncio.AbstractEventLoop,
                            context: dict[str, Any]) -> None:
        """asyncio's report of an error no one awaited: above all a task a handler started
        and never awaited that raised ("Task exception was never retrieved"). asyncio's own
        report names no job, and comes when the task is collected, long after the job's
        records; jobd's names the job whose handler started the task."""
        source = context.get("task") or context.get("future")
        job: jobs.Job | None = getattr(source, _STARTED_BY, None)
        if job is None:
            loop.default_exception_handler(context)
            return
        exc = context.get("exception")
        log.error(str(context.get("message") or "unhandled error in an async handler's task"),
                  job_id=job.id, handler=job.handler,
                  error=None if exc is None else f"{type(exc).__name__}: {exc}",
                  exc_info=exc)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._jobs.pop(task, None)

    def _job_of(self, task: asyncio.Task[Any] | None) -> tuple[int, str] | None:
        job = None if task is None else self._jobs.get(task)
        return None if job is None else (job.id, job.handler)

    def start(self, resolved: ResolvedHandler, job: jobs.Job) -> None:
        """Run the job's handler now (from the worker's thread)."""
        self._starts.append((resolved, job))
        if not self._starts_scheduled:
            self._starts_scheduled = True
            self.loop.call_soon_threadsafe(self._start_handed)

    def _start_handed(self) -> None:
        """On the loop: a task for every run handed over. The flag is cleared before the
        queue is read, so a run handed over meanwhile either is read here or schedules the
        next call."""
        self._starts_scheduled = False
        while self._starts:
            resolved, job = self._starts.popleft()
            self.loop.create_task(self._run(resolved, job))

    def cancel(self, job_id: int) -> None:
        """Cancel the job's task, if it runs (from any thread)."""
        self.loop.call_soon_threadsafe(self._cancel_task, job_id)

    def _cancel_task(self, job_id: int) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    async def _run(self, resolved: ResolvedHandler, job: jobs.Job) -> None:
        # The outcome is decided here, inside the task, not from its future: the future
        # that run_coroutine_threadsafe returns replaces a CancelledError or TimeoutError
        # with a new exception, without the handler's traceback.
        task = asyncio.current_task()
        assert task is not None
        self._tasks[job.id] = task
        self._jobs[task] = job
        logs.bind_task_job(job.id, job.handler)
        started = time.monotonic()
        board_slot = self.board.async_started(job.id) if self.board is not None else None
        try:
            if job.cancelled:  # asked to stop before it started
                raise asyncio.CancelledError
            if self.timeout:
                await within_timeout(resolved.func(job), self.timeout)
            else:
                await resolved.func(job)
            outcome = Outcome(job, None)
        except asyncio.CancelledError as exc:
            outcome = Outcome(job, CANCELLED_ERROR) if job.cancelled else failed(job, exc)
        except GeneratorExit as exc:
            if not _in_a_step():  # the coroutine is closed unfinished (its loop closed)
                raise
            outcome = failed(job, exc)  # the handler raised it: its job fails, as any other
        except BaseException as exc:  # a handler's sys.exit() fails its job, no more
            outcome = failed(job, exc)
        finally:
            forks.leave_if_forked(job)  # before the board, which the parent shares
            if self._tasks.get(job.id) is task:
                del self._tasks[job.id]
            del self._jobs[task]
            if self.board is not None:
                self.board.async_ended(board_slot)
        outcome.seconds = time.monotonic() - started
        self._deliver(outcome)


def _in_a_step() -> bool:
    """Whether a task is being stepped by a running loop on this thread (not a coroutine
    closed from outside, as when its loop is closed with it unfinished)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
