"""The lease-expiry sweep: a job whose lease ran out (its worker died with its node, froze,
or lost the network) counts as a failed attempt, retried after its backoff or dead; every
node sweeps every lease, so a dead node's jobs come back without it. The stale holder's
transactional handler, if it still holds its transaction open, is terminated on the way
(``recovery.expire_leases``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import psycopg
import structlog

from jobd import recovery
from jobd.duties import Periodic
from jobd.wake_routing import WakeRouter

log = structlog.get_logger("jobd.duties.lease_sweep")


class LeaseSweep(Periodic):
    name = "lease sweep"

    def __init__(self, interval: Callable[[], float], policy_for: recovery.PolicyLookup,
                 router: WakeRouter, lanes: Callable[[], Iterable[str]]) -> None:
        super().__init__(interval)
        self.policy_for = policy_for
        self.router = router
        self.lanes = lanes

    def work(self, conn: psycopg.Connection) -> None:
        outcome = recovery.expire_leases(conn, self.policy_for)
        self.router.retries_due(outcome.next_retry_by_lane)
        if outcome.retried or outcome.dead:
            log.warning("expired leases swept", retried=outcome.retried, dead=outcome.dead)
            self.router.due_everywhere(self.lanes())
