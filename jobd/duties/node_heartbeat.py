"""The node heartbeat: this supervisor's row in ``jobd.nodes`` (live workers and counters
per lane, for `jobd status`), and the offset of the database clock from the node's, which
turns database instants into timers."""

from __future__ import annotations

import os
from collections.abc import Callable

import psycopg
from psycopg.types.json import Jsonb

from jobd.duties import Periodic
from jobd.queries import query
from jobd.wake_routing import WakeRouter

# (live workers per lane, counters per lane)
Snapshot = tuple[dict[str, int], dict[str, dict[str, int]]]


class NodeHeartbeat(Periodic):
    name = "node heartbeat"

    def __init__(self, interval: Callable[[], float], instance: str,
                 node_name: Callable[[], str], snapshot: Callable[[], Snapshot],
                 router: WakeRouter) -> None:
        super().__init__(interval)
        self.instance = instance
        self.node_name = node_name
        self.snapshot = snapshot
        self.router = router

    def work(self, conn: psycopg.Connection) -> None:
        workers, counters = self.snapshot()
        row = conn.execute(query("node_heartbeat"), {
            "instance": self.instance, "node": self.node_name(), "pid": os.getpid(),
            "workers": Jsonb(workers), "counters": Jsonb(counters)}).fetchone()
        if row is not None:
            self.router.measured_db_clock(float(row[0]))

    def stop(self, conn: psycopg.Connection) -> None:
        conn.execute(query("node_leave"), {"instance": self.instance})
