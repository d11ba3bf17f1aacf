"""The lane's pauses as a worker knows them (``jobd.pause``), read from the database when
they may have changed: at start, on a new connection, when the supervisor says so (a
CONTROLS byte), when arming answered 'paused', and at the safety poll while the lane is
paused, since a paused worker claims nothing and would otherwise never look again.

What a pause means for claiming and the buffer is :class:`jobd.claimer.Claimer`'s business;
this only keeps its view current.
"""

from __future__ import annotations

import structlog

from jobd import pauses, queue
from jobd.claimer import Claimer
from jobd.db import ManagedConnection
from jobd.protocol import WorkerSpec
from jobd.worker_timers import Timers

log = structlog.get_logger("jobd.worker")


class Controls:
    """Reads the lane's pauses into the claimer when they may have changed."""

    def __init__(self, spec: WorkerSpec, link: ManagedConnection, claimer: Claimer,
                 timers: Timers) -> None:
        self.spec = spec
        self.link = link
        self.claimer = claimer
        self.timers = timers
        self.stale = True  # the pauses must be read (again)

    def refresh(self, now: float) -> None:
        """Read the lane's pauses when they may have changed. While the lane is paused the
        worker claims nothing, so its safety poll becomes a look at the pauses instead."""
        if self.claimer.lane_paused and now >= self.timers.next_poll:
            self.stale = True
        if not self.stale or self.link.conn is None:
            return
        lane = self.spec.lane.name
        state = self.link.run("queue", lambda conn: pauses.lane_controls(conn, lane))
        if state is None:
            return  # tried again next turn
        self.stale = False
        self.timers.poll_later(now)
        lane_paused, handlers = state
        was_paused = (self.claimer.lane_paused, self.claimer.handlers.paused)
        resumed = self.claimer.set_controls(lane_paused, handlers)
        if (lane_paused, handlers) != was_paused:
            log.info("lane pauses", lane=lane, lane_paused=lane_paused,
                     paused_handlers=sorted(handlers), resumed=resumed)
        # Armed, the worker would make every enqueue into the paused lane notify.
        if (lane_paused and self.claimer.arming.armed and self.link.run(
                "queue", lambda conn: queue.disarm(conn, self.spec.worker_id)) is not None):
            self.claimer.arming.disarmed()
