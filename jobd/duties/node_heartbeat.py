"""The node heartbeat: this supervisor's row in ``jobd.nodes`` (live workers and counters
per lane, for `jobd status`, and how often it beats, so others can tell when it is gone), and
the offset of the database clock from the node's, which turns database instants into timers.

The row is this process's alone: it is keyed by the supervisor's instance (node name, pid and
a random suffix), so two daemons given the same ``node.name`` never share one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
import structlog
from psycopg.types.json import Jsonb

from jobd import views
from jobd.duties import Periodic, Router
from jobd.queries import query

log = structlog.get_logger("jobd.duties.node_heartbeat")

# (live workers per lane, counters per lane)
Snapshot = tuple[dict[str, int], dict[str, dict[str, int]]]


class NodeHeartbeat(Periodic):
    name = "node heartbeat"

    def __init__(self, interval: Callable[[], float], instance: str,
                 node_name: Callable[[], str], snapshot: Callable[[], Snapshot],
                 router: Router, lanes: Callable[[], Iterable[str]] = tuple,
                 listening: Callable[[], bool] = lambda: True,
                 retention: Callable[[], float | None] = lambda: None,
                 lane_settings: Callable[[], dict[str, dict[str, Any]]] = dict) -> None:
        super().__init__(interval)
        # Per lane, what every node of it should share (LaneConfig.fleet_settings).
        self.lane_settings = lane_settings
        # The disagreements last logged, per lane: each is logged when it appears or changes.
        self.reported: views.Disagreements = {}
        self.listening = listening  # whether notifications reach this node (LISTEN)
        self.retention = retention  # archive.retention: other nodes' passes keep as much
        self.instance = instance
        self.lanes = lanes
        self.node_name = node_name
        self.snapshot = snapshot
        self.router = router
        self.taken: Snapshot = ({}, {})

    def prepare(self) -> None:
        # The worker pool is the loop's: read on the loop, not while it reaps or spawns.
        self.taken = self.snapshot()

    def work(self, conn: psycopg.Connection, now: float) -> None:
        live, counters = self.taken
        # Every configured lane is listed, with 0 while none of its workers runs (restarting,
        # or unable to start), so status shows what the node serves, not only what is up.
        workers = {lane: 0 for lane in self.lanes()} | live
        row = conn.execute(query("node_heartbeat"), {
            "instance": self.instance, "node": self.node_name(), "pid": os.getpid(),
            "workers": Jsonb(workers), "counters": Jsonb(counters),
            "interval": self.interval(),
            "listening": self.listening(),
            "archive_retention": self.retention(),
            "lane_settings": Jsonb(self.lane_settings())}).fetchone()
        if row is not None:
            self.router.measured_db_clock(float(row[0]))
        self.compare_lanes(conn)

    def compare_lanes(self, conn: psycopg.Connection) -> None:
        """Warn when another live node configures one of this node's lanes differently:
        each node applies its own settings to the jobs it claims, so a job's attempts,
        timeout or backoff would depend on which node took it."""
        mine = set(self.lane_settings())
        found = {lane: differing
                 for lane, differing in views.lane_disagreements(views.node_status(conn)).items()
                 if lane in mine}
        for lane, differing in sorted(found.items()):
            if self.reported.get(lane) != differing:
                log.warning("live nodes configure this lane differently: each applies its own "
                            "settings to the jobs it claims; give every node the same",
                            lane=lane, settings=differing)
        for lane in sorted(set(self.reported) - set(found)):
            log.info("live nodes configure this lane alike again", lane=lane)
        self.reported = found

    def stop(self, conn: psycopg.Connection) -> None:
        conn.execute(query("node_leave"), {"instance": self.instance})
