"""What a worker tells the outside about itself, once a second: a status line to the
supervisor (busy, capacity, mode, connected, counters) and its process title for ``ps``; the
job failures it counted instead of logging them one by one (``jobd.failure_log``); and, on
its run board, each time it runs out of work (``jobd.run_board``, ``IDLE``).

The report doubles as the worker's liveness signal: a supervisor that hears nothing for long
enough takes the worker for frozen. Writes never block the loop; a report the supervisor has
not read yet is simply skipped, as the next one says the same and more.
"""

from __future__ import annotations

import os
import select

import setproctitle

from jobd.completer import Counters
from jobd.protocol import StatusReport, WorkerMode, WorkerSpec
from jobd.run_board import RunBoard

REPORT_INTERVAL = 1.0  # seconds between liveness reports to the supervisor


class StatusReporter:
    """The once-a-second status line and process title."""

    def __init__(self, spec: WorkerSpec, counters: Counters, board: RunBoard | None) -> None:
        self.spec = spec
        self.counters = counters
        self.board = board
        self.next_at = 0.0  # monotonic: the next report is due then
        self._idle_told = True  # nothing held since the board last counted that

    def report(self, now: float, mode: WorkerMode, running: int, buffered: int,
               capacity: int, connected: bool, force: bool = False) -> None:
        if running + buffered:
            self._idle_told = False
        elif not self._idle_told:
            self._tell_idle()
        if not force and now < self.next_at:
            return
        # The failures counted instead of logged, once their window is over (or the worker
        # stops): with the report, as the loop wakes for it even when idle.
        self.counters.failure_log.flush(now, force)
        self.next_at = now + REPORT_INTERVAL
        lane = self.spec.lane
        title = f"jobd: worker {lane.name}#{self.spec.slot} busy {running}/{lane.concurrency}"
        if buffered:
            title += f" +{buffered} claimed ahead"
        if mode != WorkerMode.RUNNING:
            title += f" {mode}"
        setproctitle.setproctitle(title)
        # Busy and capacity count the buffer: a worker whose buffer is full claims nothing,
        # so waking it would only cost a round trip.
        report = StatusReport(running + buffered, capacity, mode,
                              connected, self.counters.as_dict(), self.counters.work_totals(),
                              self.board.idle_count() if self.board is not None else 0)
        try:
            os.write(self.spec.status_fd, report.to_line())
        except (BlockingIOError, BrokenPipeError):
            pass  # the supervisor reads when it can; a missed report only delays its view

    def _tell_idle(self) -> None:
        """Count on the board that the worker ran out of work, unless a wake-up waits in its
        pipe: the supervisor routed work here during this turn, which the next turn claims,
        and a count now would tell it that work was done. The next turn that ends with
        nothing held counts instead."""
        if self.board is None:
            return
        if select.select([self.spec.wake_fd], [], [], 0)[0]:
            return
        self.board.went_idle()
        self._idle_told = True
