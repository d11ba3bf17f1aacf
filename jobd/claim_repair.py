"""The repair after a claim whose rows never reached the worker.

A claim can commit on the server while its answer is lost: the connection broke, or the
rows could not be loaded. Those jobs are claimed in this worker's name and held by nobody;
left alone they would wait for their lease to expire. :class:`ClaimRepair` remembers that
such a claim may exist (``claims_unknown``) and, once the server is reachable and no lost
connection's backend can still commit one, repairs the jobs claimed in our name that the
worker does not hold. None of them started. After a lost connection they go back to the
queue with their attempt unspent, as a dead worker's unstarted jobs do: a network blip
during a claim of 500 jobs must not spend 500 attempts, delay them by their backoff and
dead-letter the ones on their last attempt unrun. A job this worker already gave back so
fails the second time, as does every job of a claim whose statement failed or whose rows
could not be loaded: a claim that fails the same way every time must end in the
dead-letter queue, not loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict

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
# How many job ids a worker remembers having given back after a lost connection: a job seen
# again in a lost claim fails instead. Bounded so that a worker running for months does not
# grow; a job forgotten gets one more attempt for free, once per this many.
GIVEN_BACK_REMEMBERED = 10_000


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
        # Whether a connection was lost since the last repair: the claim's rows then never
        # reached the process, rather than failing to load in it.
        self.connection_was_lost = False
        self.given_back: OrderedDict[int, None] = OrderedDict()  # see GIVEN_BACK_REMEMBERED
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
        self.connection_was_lost = True
        if self.backend_pid is not None:
            self.lost_backends.append(self.backend_pid)
            self.backend_pid = None

    def repair_lost_claims(self) -> None:
        """Give back or fail the jobs claimed under this worker's name that it does not
        hold: claims whose rows never reached it (see the module's docstring). Without this
        they would wait for their lease to expire. Only once the backends of lost
        connections have ended: a claim still running on one would commit after the look
        and escape it."""
        if self.lost_backends and not self._lost_backends_ended():
            return  # the flag stays and the loop looks again
        held = self.slots.all_leases()
        held += [o.job.lease for o in self.completer.pending]
        held += self.claimer.buffer.leases()
        # Their release may not have applied: until it is answered they may still be ours.
        held += [job.lease for job in self.claimer.releasing]
        policy = self.spec.lane.retry_policy
        give_back = self._may_give_back if self.connection_was_lost else _never
        outcome = self.link.run("queue", lambda conn: recovery.repair_claims_not_held(
            conn, self.spec.worker_id, held, give_back,
            "claimed, but the claim's result never reached the worker", lambda _lane: policy))
        if outcome is None:
            return  # the database failed again; the flag stays and the loop tries again
        self.claims_unknown = self.connection_was_lost = False
        self._remember(outcome.given_back)
        if outcome.given_back:
            # The release wakes the lanes' workers, this one among them.
            log.warning("gave back jobs claimed without reaching this worker (the connection"
                        " was lost), their attempt unspent", job_ids=outcome.given_back)
        failed = outcome.failed.retried + outcome.failed.dead
        if failed:
            # Their retries wake a worker like any other: the jobs table's trigger announces
            # the new run_at and the supervisor sets a timer for it.
            log.warning("failed jobs claimed without reaching this worker", job_ids=failed,
                        dead=outcome.failed.dead)

    def _may_give_back(self, job_id: int) -> bool:
        return job_id not in self.given_back

    def _remember(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            self.given_back[job_id] = None
        while len(self.given_back) > GIVEN_BACK_REMEMBERED:
            self.given_back.popitem(last=False)

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


def _never(_job_id: int) -> bool:
    return False
