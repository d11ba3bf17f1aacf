"""Outcomes written on a connection of their own, while the worker's loop claims on its link.

On one connection a worker and its backend take turns: the server waits while the loop turns
claimed rows into jobs and hands them out, and the loop waits while the server writes the
last batch's outcomes and claims the next. Here a thread writes each batch of outcomes on a
second connection (one batch at a time, as :class:`jobd.completer.Completer` hands them
over), so the server writes outcomes while the loop claims, and the loop goes on with the
claimed jobs while the outcomes commit: at 1 x 10 the drain ran 13 % faster, in four pairs
of runs out of four; where no core idles (4 x 100 on two cores) 18 % slower, hence the
lane's ``settle_connection: auto`` (``LaneConfig.settles_apart``; docs/performance.md,
"Outcomes on a connection of their own"). River's completer and Graphile Worker's batched
completion work the same way.

Backpressure: while a batch is on its way, once the outcomes waiting behind it reach all the
worker can hold, the loop claims nothing more until the answer comes
(``Exchange._outcomes_backed_up``), so a batch stuck on a lock cannot let unwritten outcomes
pile up. What it does not change: a batch is one transaction, retried with the same leases if it
fails, so what still applies is decided as before; a job whose outcome is on its way stays
in the completer's ``pending`` until the answer is taken, so it is never seen as lost, and a
worker does not exit before it is written or given up. The claims, now always in a
transaction apart from the outcomes, commit asynchronously (``claim_commits_async``): a
claim lost with a crashed server only puts its jobs back.

The thread touches only its connection and the batch's leases; the loop takes the answer
(:meth:`take`) and does the bookkeeping. When the answer is ready the thread pokes a pipe of
its own (``wake_fd``, which the loop watches), so the loop neither polls for it nor sleeps
past it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from jobd import pipes, queue, unanswered
from jobd.completer import Batch
from jobd.db import ManagedConnection, worker_session
from jobd.protocol import WorkerSpec, worker_connection_name
from jobd.unanswered import Written

log = structlog.get_logger("jobd.worker")


# Seconds the loop writes outcomes with its claims again after a batch here failed (the
# connection was lost or a statement failed): the link's own retry pause, so a broken
# connection cannot leave outcomes waiting, nor the loop resubmitting in a spin.
FALLBACK = 1.0


class Settler:
    """One background thread and its connection; at most one batch on its way."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.worker_id = spec.worker_id
        self.link = ManagedConnection(
            spec.database_url, spec.schema,
            # The worker's prefix: crash attribution ends this connection with the others.
            worker_connection_name(spec, "settle"),
            pause_after_failure=FALLBACK, session=worker_session(spec.session),
            label="outcomes connection")
        self.wake_fd, self._wake_w = os.pipe()
        for fd in (self.wake_fd, self._wake_w):
            os.set_blocking(fd, False)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="jobd-settle")
        self._on_the_way: tuple[Batch, Future[Written | None]] | None = None
        self._failed_at = -FALLBACK
        self._closed = False
        # Connected at start, as the link is: a node's connections are all there to count
        # in pg_stat_activity, and a refused one is logged before the first job ends.
        self._thread.submit(self.link.ensure).add_done_callback(_log_unexpected)

    @property
    def busy(self) -> bool:
        """A batch is on its way (its answer not taken yet)."""
        return self._on_the_way is not None

    def usable(self, now: float) -> bool:
        """Whether the next batch may go here: not after a failure, for ``FALLBACK``."""
        return not self.busy and now >= self._failed_at + FALLBACK

    def submit(self, batch: Batch) -> None:
        assert self._on_the_way is None, "one batch at a time"
        future = self._thread.submit(self._write, batch)
        # Once the answer is set (a poke from _write itself could wake the loop before it
        # is, and the loop would go back to sleep without it).
        future.add_done_callback(lambda _done: pipes.poke(self._wake_w))
        self._on_the_way = (batch, future)

    def take(self, wait: bool = False) -> tuple[Batch, Written | None] | None:
        """The batch on its way and its answer (None: not written) once it has one; None
        while it is still on its way (``wait``: block until it has one)."""
        if self._on_the_way is None:
            return None
        batch, future = self._on_the_way
        if not wait and not future.done():
            return None
        self._on_the_way = None
        written = future.result()
        if written is None:
            self._failed_at = time.monotonic()
        return batch, written

    def close(self) -> None:
        """After the last :meth:`take`: end the thread, the connection and the pipe (once;
        later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._thread.shutdown(wait=True)
        self.link.close()
        os.close(self.wake_fd)
        os.close(self._wake_w)

    def _write(self, batch: Batch) -> Written | None:
        self.link.ensure()
        return self.link.run("queue", _settle(batch, self.worker_id))


def settles_apart(spec: WorkerSpec) -> bool:
    """Whether this worker writes its outcomes on a connection of its own: as the spec
    says, else as the lane's ``settle_connection`` decides for this machine's cores."""
    if spec.settles_apart is not None:
        return spec.settles_apart
    return spec.lane.settles_apart(len(os.sched_getaffinity(0)), spec.lane.workers)


def _log_unexpected(connected: Future[bool]) -> None:
    """The connection at start has no caller to raise to: a failure ensure() does not
    handle itself (it logs a refused connection) is a bug, logged rather than lost."""
    error = connected.exception()
    if error is not None:
        log.error("opening the outcomes connection failed", error=repr(error))


def _settle(batch: Batch, worker: str) -> Callable[..., Written]:
    return lambda conn: unanswered.recheck(conn, worker, batch.unanswered, queue.settle_and_claim(
        conn, batch.successes, batch.failures, None))
