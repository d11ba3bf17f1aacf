"""Lease renewal for a worker: one heartbeat statement every ``heartbeat`` seconds renews the
leases of the jobs it runs and holds in its buffer, and its answer carries the news a worker
only learns from the database: leases lost (expired and swept, or claimed again), and jobs
asked to stop (``jobd.cancel``).

A cancel is also a reason to renew at once: the supervisor sends a CANCELS byte, and the
worker calls :meth:`LeaseKeeper.renew_now` so the handler is told without waiting for the
next heartbeat.
"""

from __future__ import annotations

import structlog

from jobd import queue
from jobd.claimer import Claimer
from jobd.completer import Completer
from jobd.config import LaneConfig
from jobd.db import ManagedConnection
from jobd.outcomes import Outcome
from jobd.slots import Slots

log = structlog.get_logger("jobd.worker")

# Seconds before a heartbeat that could not be sent (the database unreachable, a statement
# failed) is tried again: a whole heartbeat later, two missed in a row would leave the next
# one at the leases' end. The link's own pause after a failure is as long.
RETRY_AFTER_FAILURE = 1.0


class LeaseKeeper:
    """The heartbeat of the jobs a worker holds, running or buffered."""

    def __init__(self, lane: LaneConfig, link: ManagedConnection, slots: Slots,
                 claimer: Claimer, completer: Completer) -> None:
        self.lane = lane
        self.link = link
        self.slots = slots
        self.claimer = claimer
        self.completer = completer
        self.next_at = 0.0  # monotonic: the next heartbeat is due then

    def start(self, now: float) -> None:
        """The first heartbeat: a fresh claim's lease is good for a while."""
        self.next_at = now + self.lane.heartbeat

    def renew_now(self) -> None:
        """At the next turn: a cancel to learn of, or a new connection after a loss (the
        heartbeats missed meanwhile brought the leases nearer their end)."""
        self.next_at = 0.0

    def renew(self, now: float) -> None:
        """Renew the held leases when the heartbeat is due; act on what the answer says."""
        if now < self.next_at:
            return
        self.next_at = now + self.lane.heartbeat
        held = self.slots.renewable_leases() + self.claimer.buffer.leases()
        if self.claimer.releasing:
            # Their release went unanswered: until one answers they may still be ours.
            held += [job.lease for job in self.claimer.releasing]
        if not held:
            return
        renewed = self.link.run("queue", lambda conn: queue.heartbeat(
            conn, held, self.lane.visibility_timeout))
        if renewed is None:
            self.next_at = now + min(RETRY_AFTER_FAILURE, self.lane.heartbeat)
            return
        reported = {*renewed.lease_lost, *renewed.cancelled}
        if any(job.id in reported for job, _claimed in self.slots.on_deck()):
            # Not started yet, the jobs on deck are handled as the buffered ones they are.
            self.slots.take_back_deck()
        # Buffered and swept (a worker too slow to renew): never started, just dropped.
        self.claimer.buffer.drop(set(renewed.lease_lost))
        if renewed.cancelled:
            self.stop_cancelled(set(renewed.cancelled))
        lost = self.slots.lost_leases(renewed.lease_lost)
        if lost:
            log.warning("lease lost while running (expired and swept?)", job_ids=lost)

    def stop_cancelled(self, ids: set[int]) -> None:
        """Jobs asked to stop (jobd.cancel): a buffered one is finished unstarted (its
        completion archives it as cancelled), a running one's handler is told."""
        for job in self.claimer.buffer.take(ids):
            self.completer.add(Outcome(job, None))
        told = self.slots.tell_cancel(ids)
        if told:
            log.info("asked handlers to stop (cancel requested)", job_ids=told)
