"""The repair after a claim whose rows never reached the worker.

A claim can commit on the server while its answer is lost: the connection broke, or the
rows could not be loaded. Those jobs are claimed in this worker's name and held by nobody;
left alone they would wait for their lease to expire. :class:`ClaimRepair` remembers that
such a claim may exist (``claims_unknown``) and, once the server is reachable and no lost
connection's backend can still commit one, fails the jobs claimed in our name that the
worker does not hold.
"""

from __future__ import annotations

import time

import structlog

from jobd import queue, recovery
from jobd.claimer import Claimer
from jobd.completer import Completer
from jobd.db import ManagedConnection, is_pooled
from jobd.protocol import WorkerSpec
from jobd.slots import Slots

log = structlog.get_logger("jobd.worker")

# How long the look for lost claims waits for the backend of a lost connection to exit once
# told to (milliseconds), and how long it waits before telling again if it did not.
BACKEND_EXIT_WAIT_MS = 1000
BACKEND_RETRY = 1.0


class ClaimRepair:
    """What a lost claim left to repair, and the repair."""

    def __init__(self, spec: WorkerSpec, link: ManagedConnection, claimer: Claimer,
                 completer: Completer, slots: Slots) -> None:
        self.spec = spec
        self.link = link
        self.claimer = claimer
        self.completer = completer
        self.slots = slots
        # Set when a claim may have taken jobs whose rows never reached us (the connection
        # broke, or the rows could not be loaded): the loop then checks the jobs claimed in
        # our name against the ones it holds.
        self.claims_unknown = False
        # The server backend of the link's connection (None through a pooler), and those of
        # lost connections not yet known to have exited: a claim sent on one may still run
        # there, and commit after the repair looked (fail_claims_not_held).
        self.backend_pid: int | None = None
        self.lost_backends: list[int] = []
        self.backends_retry_at = 0.0  # monotonic: no try to end them before

    def connected(self) -> None:
        """The link has a new connection: remember its server backend, to end it should the
        connection be lost (not through a pooler, whose backend pid is not the server's)."""
        conn = self.link.conn
        self.backend_pid = None if conn is None or is_pooled(conn) else conn.info.backend_pid

    def connection_lost(self) -> None:
        """The server may have run a claim whose result we never read, and its backend,
        not having noticed the loss yet, may still be running one."""
        self.claims_unknown = True
        if self.backend_pid is not None:
            self.lost_backends.append(self.backend_pid)
            self.backend_pid = None

    def fail_claims_not_held(self) -> None:
        """Fail the jobs claimed under this worker's name that it does not hold: a claim whose
        rows never reached it. Without this they would wait for their lease to expire. They
        count as a failed attempt (retried after the backoff, dead when the budget is
        spent), so a job whose claim fails the same way every time cannot loop forever.
        Only once the backends of lost connections have ended: a claim still running on
        one would commit after the look and escape it."""
        if self.lost_backends and not self._lost_backends_ended():
            return  # the flag stays and the loop looks again
        held = self.slots.all_leases()
        held += [o.job.lease for o in self.completer.pending]
        held += self.claimer.buffer.leases()
        # Their release may not have applied: until it is answered they may still be ours.
        held += [job.lease for job in self.claimer.releasing]
        policy = self.spec.lane.retry_policy
        outcome = self.link.run("queue", lambda conn: recovery.fail_claims_not_held(
            conn, self.spec.worker_id, held,
            "claimed, but the claim's result never reached the worker", lambda _lane: policy))
        if outcome is None:
            return  # the database failed again; the flag stays and the loop tries again
        self.claims_unknown = False
        orphans = outcome.retried + outcome.dead
        if orphans:
            # Their retries wake a worker like any other: the jobs table's trigger announces
            # the new run_at and the supervisor sets a timer for it.
            log.warning("failed jobs claimed without reaching this worker", job_ids=orphans,
                        dead=outcome.dead)

    def _lost_backends_ended(self) -> bool:
        """End the backends of the lost connections and say whether all of them have
        exited (waiting up to :data:`BACKEND_EXIT_WAIT_MS` for each). One that has not, or a
        database that failed again, is tried again no sooner than :data:`BACKEND_RETRY`
        later: each try may block the loop for the wait."""
        if time.monotonic() < self.backends_retry_at:
            return False
        pids = list(self.lost_backends)
        left = self.link.run("queue", lambda conn: queue.end_backends(
            conn, pids, BACKEND_EXIT_WAIT_MS))
        if left is not None:
            self.lost_backends = left
        if left is None or left:
            self.backends_retry_at = time.monotonic() + BACKEND_RETRY
        if left:
            log.warning("a backend of a lost connection has not exited yet; claims whose rows"
                        " never arrived are looked for once it has", pids=left)
        return left == []

    def due_at(self) -> float | None:
        """When the loop should try again to end the lost connections' backends, if it is
        waiting for that; the other retries wait for the database to be usable again."""
        return self.backends_retry_at if self.lost_backends else None
