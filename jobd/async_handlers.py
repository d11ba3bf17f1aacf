"""``async def`` handlers: each job a task on an event loop running on a thread of its own,
its outcome handed back through the runner's ``deliver``. A cancel cancels the task
(CancelledError at the handler's next await); the lane's timeout cancels it too."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from jobd import jobs, logs
from jobd.handlers import ResolvedHandler
from jobd.loop_watch import LoopWatch
from jobd.outcomes import CANCELLED_ERROR, Outcome, failed, within_timeout
from jobd.run_board import RunBoard


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
        self.watch = LoopWatch(self.loop, self._job_of)
        threading.Thread(target=self.loop.run_forever, name="jobd-async", daemon=True).start()

    def _new_task(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
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
        return task

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
        except GeneratorExit:  # the event loop is being closed with the task unfinished
            raise
        except BaseException as exc:  # a handler's sys.exit() fails its job, no more
            outcome = failed(job, exc)
        finally:
            if self._tasks.get(job.id) is task:
                del self._tasks[job.id]
            del self._jobs[task]
            if self.board is not None:
                self.board.async_ended(board_slot)
        outcome.seconds = time.monotonic() - started
        self._deliver(outcome)
