"""Running handlers: sync ones on long-lived threads (one per slot of the lane's
``concurrency``), ``async def`` ones on an event-loop thread, transactional ones on a
connection of their own (:mod:`jobd.exactly_once`). Each run ends in an :class:`Outcome`,
handed to the worker's loop through a queue and one pipe wake-up per batch.

Sync jobs may be handed over ahead of a free thread (``jobd.slots``, the deck): they wait in
the threads' queue, and a thread that finishes takes the next one itself, without a turn of
the worker's loop between them. A run's start is the moment its thread takes it
(:class:`Start`); until then the loop may take it back (:meth:`HandlerRunner.take_back`),
and a thread that reaches a job taken back skips it."""

from __future__ import annotations

import contextlib
import os
import queue as stdlib_queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, TypeVar

import psycopg
import structlog
from psycopg_pool import ConnectionPool, PoolTimeout

from jobd import exactly_once, forks, jobs, logs, pipes
from jobd import handlers as handler_registry
from jobd.async_handlers import AsyncHandlers
from jobd.db import conninfo, users_connection_reset, users_connection_setup
from jobd.loop_watch import Blocked, Freed
from jobd.outcomes import Outcome, failed
from jobd.protocol import WorkerSpec, worker_connection_name
from jobd.run_board import RunBoard

log = structlog.get_logger("jobd.worker")

# How long a transactional run waits for a handler connection before its job fails (the
# pool's default), in slices: each slice that finds the pool empty has it start a connection
# attempt. The pool's own attempts give up after POOL_RECONNECT_TIMEOUT: left to themselves
# they retry for five minutes, their waits doubling, and a pool whose connections were all
# lost in an outage stayed empty, its jobs failing for want of a connection, for up to as
# long again as the outage had lasted. Now it connects within a slice of the database's
# return.
HANDLER_CONNECTION_WAIT = 30.0
HANDLER_CONNECTION_SLICE = 1.0
POOL_RECONNECT_TIMEOUT = 1.0


class Start(Protocol):
    """A job handed to the runner, and when its run started (monotonic; None while it waits
    in the threads' queue). ``taken_back``: the loop took it back before a thread did."""

    job: jobs.Job
    started: float | None
    taken_back: bool


# The runs handed over come back as the caller's own kind (jobd.slots' Running).
S = TypeVar("S", bound=Start)


class HandlerRunner:
    def __init__(self, spec: WorkerSpec,
                 resolved: dict[str, handler_registry.ResolvedHandler]) -> None:
        self.spec = spec
        self.lane = spec.lane
        self.handlers = resolved
        # What the supervisor reads if this process dies: the jobs whose handlers run.
        self.board = (RunBoard(spec.board_fd, spec.lane.concurrency) if spec.board_fd >= 0
                      else None)
        self.outcomes: stdlib_queue.SimpleQueue[Outcome] = stdlib_queue.SimpleQueue()
        self.handler_queue: stdlib_queue.SimpleQueue[
            tuple[handler_registry.ResolvedHandler, Start]] = stdlib_queue.SimpleQueue()
        self.handler_threads: list[threading.Thread] = []
        # Held while a thread marks a run started, or the loop takes waiting runs back: a
        # run is one or the other, never both.
        self._starting = threading.Lock()
        self._poked = False
        self.tx_pool: ConnectionPool | None = None
        if any(h.is_transactional for h in resolved.values()):
            # Handler connections: one per concurrent transactional job, opened on demand.
            # The user's search_path, not jobd's: a handler's statements resolve as on any
            # other connection of its role; jobd's own statements there are qualified.
            self.tx_pool = ConnectionPool(
                conninfo(spec.database_url, None,
                         worker_connection_name(spec, "handler")),
                min_size=0, max_size=spec.lane.concurrency, open=True,
                reconnect_timeout=POOL_RECONNECT_TIMEOUT,
                kwargs={"autocommit": True}, name=f"jobd-{spec.lane.name}-handlers",
                configure=users_connection_setup(spec.database_url, spec.session),
                reset=users_connection_reset(spec.database_url, spec.session))
        self.async_handlers = (AsyncHandlers(spec.lane.timeout, self._deliver, self.board)
                               if any(h.is_async for h in resolved.values()) else None)
        self.results_r, self._results_w = os.pipe()
        for fd in (self.results_r, self._results_w):
            os.set_blocking(fd, False)

    def is_async(self, handler: str) -> bool:
        resolved = self.handlers.get(handler)
        return resolved is not None and resolved.is_async

    def is_transactional(self, handler: str) -> bool:
        resolved = self.handlers.get(handler)
        return resolved is not None and resolved.is_transactional

    @property
    def threads_only(self) -> bool:
        """Every handler of the lane runs on the threads: none is ``async def``."""
        return self.async_handlers is None

    def start(self, start: Start) -> None:
        """Run ``start.job``: at once on the event loop (async), or when a thread is free
        (sync; ``start.started`` is set then)."""
        job = start.job
        resolved = self.handlers.get(job.handler)
        if resolved is None or resolved.is_async:
            start.started = time.monotonic()
        if resolved is None:
            # The claimer gives such jobs back before they start (handlers the node lacks);
            # this stays the answer should one get here all the same.
            self._deliver(Outcome(job, f"LookupError: no handler named {job.handler!r} on this "
                                       f"worker (lane {job.lane!r})", seconds=0.0))
        elif resolved.is_async:
            assert self.async_handlers is not None
            self.async_handlers.start(resolved, job)
        else:
            self._ensure_handler_threads()
            self.handler_queue.put((resolved, start))

    def take_back(self, handed: Sequence[S]) -> list[S]:
        """Of the runs ``handed`` over, the ones no thread has started: taken back, so none
        ever will (from the loop's thread)."""
        with self._starting:
            waiting = [s for s in handed if s.started is None and not s.taken_back]
            for start in waiting:
                start.taken_back = True
        return waiting

    def _ensure_handler_threads(self) -> None:
        # A plain queue and long-lived threads: cheaper per job than an executor's futures
        # and callbacks, which matters when jobs take microseconds.
        while len(self.handler_threads) < self.lane.concurrency:
            index = len(self.handler_threads)
            thread = threading.Thread(target=self._handler_thread, args=(index,), daemon=True,
                                      name=f"jobd-{self.lane.name}-{index}")
            thread.start()
            self.handler_threads.append(thread)

    def cancel(self, job: jobs.Job) -> None:
        """The job was asked to stop: sync handlers see ``job.cancelled``; an async handler's
        task is cancelled (CancelledError at its next await). Its outcome arrives as any
        other when the run ends."""
        job.request_cancel()
        if self.async_handlers is not None and self.is_async(job.handler):
            self.async_handlers.cancel(job.id)

    def _handler_thread(self, index: int) -> None:
        while True:
            resolved, start = self.handler_queue.get()
            with self._starting:
                if start.taken_back:
                    continue
                start.started = started = time.monotonic()
            if self.lane.timeout:
                # The loop may have set its sleep before this start: wake it, so it watches
                # the run's deadline from now (one poke per batch, as for outcomes).
                self._wake_loop()
            job = start.job
            logs.bind_job(job.id, job.handler)
            if self.board is not None:
                self.board.thread_started(index, job.id)
            try:
                if resolved.is_transactional:
                    result = self._run_transactional(resolved, job)
                    outcome = Outcome(job, None, committed=True,
                                      cancelled=result == "cancelled")
                else:
                    handler_registry.check_ran(resolved.name, forks.call(resolved.func, job))
                    outcome = Outcome(job, None)
            except exactly_once.LeaseLost:
                outcome = Outcome(job, None, lease_lost=True)
            except BaseException as exc:  # a handler's sys.exit() fails its job, no more
                outcome = failed(job, exc)
            finally:
                logs.unbind_job()
                if self.board is not None:
                    self.board.thread_ended(index, job.id)
            outcome.seconds = time.monotonic() - started
            self._deliver(outcome)

    def _run_transactional(self, resolved: handler_registry.ResolvedHandler,
                           job: jobs.Job) -> str:
        # After a restart of the server every idle connection of the pool is dead, and each
        # fails at its BEGIN: the run takes another rather than failing its job for it. The
        # pool drops each dead one, so at most its size are met.
        for _ in range(self.lane.concurrency):
            try:
                return self._run_transactional_once(resolved, job)
            except exactly_once.ConnectionGone:
                continue
        return self._run_transactional_once(resolved, job)

    def _run_transactional_once(self, resolved: handler_registry.ResolvedHandler,
                                job: jobs.Job) -> str:
        lost = False
        try:
            with self._handler_connection() as conn:
                try:
                    return exactly_once.run_transactional(conn, job, resolved.func,
                                                          self.spec.schema, self.lane.timeout)
                except exactly_once.ConnectionGone:
                    raise  # no transaction began: nothing to end
                except BaseException:
                    lost = conn.broken
                    raise
        finally:
            # Once the lost connection is back in the pool (which drops it): the pool may
            # hold no other.
            if lost:
                self._end_abandoned(job)

    @contextlib.contextmanager
    def _handler_connection(self) -> Iterator[psycopg.Connection]:
        """A connection of the pool, as ``ConnectionPool.connection()`` gives it, waited for
        in slices (HANDLER_CONNECTION_SLICE) up to HANDLER_CONNECTION_WAIT."""
        assert self.tx_pool is not None
        deadline = time.monotonic() + HANDLER_CONNECTION_WAIT
        while True:
            left = deadline - time.monotonic()
            try:
                conn = self.tx_pool.getconn(timeout=max(min(HANDLER_CONNECTION_SLICE, left),
                                                        0.001))
                break
            except PoolTimeout:
                if left <= HANDLER_CONNECTION_SLICE:
                    raise PoolTimeout(f"no database connection for the handler within "
                                      f"{HANDLER_CONNECTION_WAIT:.0f} s") from None
        try:
            with conn:  # commits or rolls back what the block left open, as connection() does
                yield conn
        finally:
            self.tx_pool.putconn(conn)

    def _end_abandoned(self, job: jobs.Job) -> None:
        """The handler's connection was lost mid-transaction: end what the server may
        still hold of it before the failure is written (exactly_once.end_abandoned), on
        another of the pool's connections. If that fails too, the lease sweep ends it."""
        assert self.tx_pool is not None
        try:
            with self.tx_pool.connection(timeout=5.0) as other:
                ended = exactly_once.end_abandoned(other, job)
        except (psycopg.Error, PoolTimeout) as exc:
            log.warning("could not end the transaction of a lost handler connection",
                        job_id=job.id, error=str(exc).strip())
            return
        if ended:
            log.info("ended the transaction of a lost handler connection", job_id=job.id)

    def _deliver(self, outcome: Outcome) -> None:
        """From any thread: hand an outcome to the loop, waking it if it may be asleep.

        One wake-up per batch: the loop clears ``_poked`` before it drains the queue, so an
        outcome queued after the drain started always finds it clear and pokes again.
        """
        self.outcomes.put(outcome)
        self._wake_loop()

    def _wake_loop(self) -> None:
        if not self._poked:
            self._poked = True
            pipes.poke(self._results_w)

    def collect(self) -> list[Outcome]:
        """The outcomes delivered since the last call (from the loop's thread)."""
        self._poked = False
        collected = []
        while True:
            try:
                collected.append(self.outcomes.get_nowait())
            except stdlib_queue.Empty:
                return collected

    def watch_event_loop(self, now: float) -> None:
        """Say when an ``async def`` handler blocks the event loop (every other async job of
        the worker waits, and times out, until it returns), naming it; and when it is free
        again (from the loop's thread, each turn)."""
        if self.async_handlers is None:
            return
        change = self.async_handlers.watch.check(now)
        if isinstance(change, Blocked):
            log.warning("an async handler is blocking the event loop: no other async job of "
                        "this worker runs until it returns (await instead, or run the "
                        "blocking call with asyncio.to_thread)", lane=self.lane.name,
                        job_id=change.job_id, handler=change.handler,
                        blocked_s=round(change.seconds, 1))
        elif isinstance(change, Freed):
            log.info("the event loop runs again", lane=self.lane.name,
                     blocked_s=round(change.seconds, 1))

    def close(self) -> None:
        if self.tx_pool is not None:
            self.tx_pool.close(timeout=1.0)
