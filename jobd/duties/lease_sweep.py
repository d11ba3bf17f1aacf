"""The lease-expiry sweep: a job whose lease ran out (its worker died with its node, froze,
or lost the network) counts as a failed attempt, retried after its backoff or dead; every
node sweeps every lease of the lanes it configures, and of lanes no live node configures, so
a dead node's jobs come back without it, on their lane's retry policy. The stale holder's
transactional handler, if it still holds its transaction open, is terminated on the way
(``recovery.expire_leases``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import psycopg
import structlog

from jobd import recovery
from jobd.duties import Periodic, Router
from jobd.head_scans import HeadScans

log = structlog.get_logger("jobd.duties.lease_sweep")


class LeaseSweep(Periodic):
    name = "lease sweep"

    def __init__(self, interval: Callable[[], float], policy_for: recovery.PolicyLookup,
                 router: Router, lanes: Callable[[], Iterable[str]]) -> None:
        super().__init__(interval)
        self.policy_for = policy_for
        self.router = router
        self.lanes = lanes
        # Jobs this node took from expired leases, per lane since it started (the metrics);
        # the last turn's share is taken back if the shared transaction does not commit.
        self.expired: dict[str, int] = {}
        self.last_turn: dict[str, int] = {}
        # Sweeps read the lease index from the head only now and then while that is slow.
        self.head_scans = HeadScans()

    def work(self, conn: psycopg.Connection, now: float) -> None:
        self.last_turn = {}
        look_back = self.head_scans.look_back(now)
        sweep = recovery.sweep_expired_leases(conn, self.policy_for, look_back=look_back,
                                              lanes=list(self.lanes()))
        self.head_scans.ran(now, look_back, sweep.scan_seconds, sweep.complete)
        self.last_turn = sweep.expired_by_lane
        # A new dict, never one changed in place: the loop copies it for the metrics.
        self.expired = {lane: self.expired.get(lane, 0) + sweep.expired_by_lane.get(lane, 0)
                        for lane in self.expired.keys() | sweep.expired_by_lane.keys()}
        outcome = sweep.failed
        self.router.retries_due(outcome.next_retry_by_lane)
        if outcome.retried or outcome.dead:
            # The holders name the node that lost them: usually one that is gone (jobd status).
            log.warning("expired leases swept", lanes=sorted(sweep.expired_by_lane),
                        retried=outcome.retried, dead=outcome.dead, holders=sweep.holders)
            self.router.due_everywhere(self.lanes())

    def rolled_back(self) -> None:
        self.expired = {lane: count - self.last_turn.get(lane, 0)
                        for lane, count in self.expired.items()}
        self.last_turn = {}
        # What that turn swept is still to sweep, below the next turn's look back perhaps.
        self.head_scans.from_head_next()
