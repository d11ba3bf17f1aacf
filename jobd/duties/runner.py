"""Runs the due duties on a thread of their own, so that the supervisor's loop waits on its
``select`` alone: a duty's statement that waits (for a lock, a slow scan under a held
horizon, a pooler's queue, a connection attempt) must not hold up the wake-ups the loop
relays, its reaping of workers or its signals.

The loop hands a batch of due duties over (:meth:`DutyRunner.dispatch`) and takes it back when
the thread is done, told by a byte on a pipe its ``select`` watches. In between, the loop
touches neither the duties nor their connection: what a duty asks of the loop (wake-ups, a
crash pinned on a job) is recorded in :class:`LoopCalls` and carried out on the loop when the
batch comes back, and what the loop asks of a duty (a dead worker to settle, a poll after a
reload) waits until then (:meth:`DutyRunner.when_idle`). One batch at a time: the duties
share one connection.
"""

from __future__ import annotations

import math
import os
import queue
import select
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import partial

import psycopg

from jobd import pipes
from jobd.db import ManagedConnection
from jobd.duties import Duty
from jobd.eventloop import SelectLoop
from jobd.wake_routing import WakeRouter


class LoopCalls:
    """Calls made for the loop on the duties' thread, carried out when the batch comes back."""

    def __init__(self) -> None:
        self._calls: list[Callable[[], object]] = []

    def later(self, call: Callable[[], object]) -> None:
        self._calls.append(call)

    def take(self) -> list[Callable[[], object]]:
        calls, self._calls = self._calls, []
        return calls


class DeferredRouter:
    """The wake router as the duties see it: what they route waits for the loop; the
    database clock is read at once (the loop only reads it too)."""

    def __init__(self, router: WakeRouter, calls: LoopCalls) -> None:
        self.router = router
        self.calls = calls

    def measured_db_clock(self, db_epoch: float) -> None:
        self.calls.later(partial(self.router.measured_db_clock, db_epoch, time.monotonic()))

    def db_epoch(self, now: float | None = None) -> float:
        return self.router.db_epoch(now)

    def due_now(self, lane: str, count: int | None = None) -> None:
        self.calls.later(partial(self.router.due_now, lane, count))

    def due_everywhere(self, lanes: Iterable[str]) -> None:
        self.calls.later(partial(self.router.due_everywhere, list(lanes)))

    def due_at(self, lane: str, at_epoch: float) -> None:
        self.calls.later(partial(self.router.due_at, lane, at_epoch))

    def retries_due(self, next_retry_by_lane: Mapping[str, datetime]) -> None:
        self.calls.later(partial(self.router.retries_due, dict(next_retry_by_lane)))

    def suspects_due(self, lane: str, at_epoch: float | None = None) -> None:
        self.calls.later(partial(self.router.suspects_due, lane, at_epoch))

    def controls_changed(self, lane: str) -> None:
        self.calls.later(partial(self.router.controls_changed, lane))


class DutyRunner:
    def __init__(self, duties: Sequence[Duty], link: ManagedConnection, loop: SelectLoop,
                 calls: LoopCalls) -> None:
        self.duties = list(duties)
        self.link = link
        self.calls = calls
        self._in_flight_since: float | None = None  # monotonic; None: the thread is idle
        self._failure: BaseException | None = None
        self._waiting: list[Callable[[], object]] = []  # the loop's requests, for when idle
        self._batches: queue.SimpleQueue[tuple[list[Duty], float] | None] = queue.SimpleQueue()
        self._done_r, self._done_w = os.pipe()
        for fd in (self._done_r, self._done_w):
            os.set_blocking(fd, False)
        loop.register(self._done_r, self._came_back)
        self._thread: threading.Thread | None = None

    # --- on the loop ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._in_flight_since is not None

    def in_flight_for(self, now: float) -> float:
        """How long the batch on the thread has taken so far (0: none)."""
        return 0.0 if self._in_flight_since is None else now - self._in_flight_since

    def next_at(self) -> float:
        """When a duty is next due (monotonic); while a batch runs, its return wakes the loop."""
        if self.busy:
            return math.inf
        return min((duty.next_at for duty in self.duties), default=math.inf)

    def when_idle(self, request: Callable[[], object]) -> None:
        """Run ``request`` (a change to a duty's state) now, or when the batch comes back."""
        if self.busy:
            self._waiting.append(request)
        else:
            request()

    def dispatch(self, now: float | None = None) -> None:
        """Hand the due duties to the thread, unless a batch is on it or the connection is
        waiting out a failure."""
        now = time.monotonic() if now is None else now
        if self.busy or now < self.link.ready_at():
            return
        due = [duty for duty in self.duties if duty.due(now)]
        if not due:
            return
        for duty in due:
            duty.prepare()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="jobd-duties",
                                            daemon=True)
            self._thread.start()
        self._in_flight_since = now
        self._batches.put((due, now))

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the batch on the thread (the supervisor is
        leaving, its loop done) and take it back; False if it is still running."""
        if self.busy:
            ready, _, _ = select.select([self._done_r], [], [], timeout)
            if not ready:
                return False
            self._came_back(self._done_r)
        return True

    def stop(self) -> None:
        """The supervisor is leaving, its loop done and the thread idle (:meth:`settle`): run
        each duty's ``stop`` here, then end the thread."""
        assert not self.busy
        for duty in self.duties:
            self.link.run(f"{duty.name} (stop)", duty.stop)
        if self._thread is not None:
            self._batches.put(None)

    def _came_back(self, fd: int) -> None:
        pipes.drain(fd)
        if not self.busy:
            return
        self._in_flight_since = None
        failure, self._failure = self._failure, None
        for call in self.calls.take():
            call()
        waiting, self._waiting = self._waiting, []
        for request in waiting:
            request()
        if failure is not None:
            # A defect, not a database error (the link handles those): end the supervisor
            # as it would have ended had the duty run on its loop.
            raise failure

    # --- on the thread --------------------------------------------------------------------

    def _serve(self) -> None:
        while (batch := self._batches.get()) is not None:
            due, now = batch
            try:
                self._run(due, now)
            except BaseException as exc:  # carried to the loop, raised there
                self._failure = exc
            pipes.poke(self._done_w)

    def _run(self, due: list[Duty], now: float) -> None:
        """The shared duties in one transaction, each ``alone`` one apart. A failure is logged
        by ``link`` and the duty tries again on its next turn."""
        self.link.ensure()
        if self.link.conn is None:
            return
        shared = [duty for duty in due if not duty.alone]
        if shared:
            self.link.run(", ".join(duty.name for duty in shared),
                          lambda conn: self._together(conn, shared, now))
        for duty in due:
            if duty.alone:
                self.link.run(duty.name, partial(duty.run, now=now))

    @staticmethod
    def _together(conn: psycopg.Connection, duties: Sequence[Duty], now: float) -> None:
        try:
            with conn.transaction():
                for duty in duties:
                    duty.run(conn, now)
        except BaseException:
            for duty in duties:
                duty.rolled_back()
            raise
