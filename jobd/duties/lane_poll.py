"""The fallback poll: one statement tells, per lane, whether work is due or when, whether a
suspect is due, and what is paused. Notifications are the fast path; this catches what they
miss (the LISTEN connection was down, another node retried a job, a timer was lost in a
reload, a pause or resume happened while this node was not listening). Before it, the
(lane, priority) pairs that enqueues recorded as wanted are merged into the lane's
priorities (``merge_wanted_priorities``, migration 0046), so their jobs are seen."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import psycopg

from jobd.config import Config
from jobd.duties import NEVER, Duty, Router
from jobd.head_scans import HeadScans
from jobd.queries import query


class LanePoll(Duty):
    name = "lane poll"
    alone = True

    def __init__(self, config: Callable[[], Config], router: Router) -> None:
        super().__init__()
        self.config = config
        self.router = router
        self.pauses: dict[str, str] = {}  # lane -> its pauses as lane_heads names them
        # Polls read the claim index from the head only now and then while that is slow.
        self.head_scans = HeadScans()

    def poll_now(self) -> None:
        """Poll at once, from the head: after a reload (lanes new to this node may hold jobs
        due long ago) or a LISTEN reconnect (notifications were lost meanwhile)."""
        self.next_at = 0.0
        self.head_scans.from_head_next()

    def run(self, conn: psycopg.Connection, now: float) -> None:
        lanes = self.config().lanes
        if not lanes:
            self.next_at = NEVER  # a reload that adds lanes polls at once
            return
        interval = min(lane.poll_interval for lane in lanes.values())
        # Jitter keeps the supervisors of a fleet from polling in lockstep.
        self.next_at = now + interval * random.uniform(0.8, 1.2)
        # A job whose enqueue met its (lane, priority) being inserted by another transaction
        # that then rolled back is invisible to claims until its pair is listed.
        conn.execute(query("merge_wanted_priorities"))
        look_back = self.head_scans.look_back(now)
        started = time.perf_counter()
        rows = conn.execute(query("lane_heads"), {"lanes": list(lanes), "now": None,
                                                  "look_back": look_back}).fetchall()
        self.head_scans.ran(now, look_back, time.perf_counter() - started)
        for lane, head, db_now, suspects, pauses in rows:
            if pauses != self.pauses.get(lane, ""):
                # Workers read their lane's pauses when they start; a change since that no
                # notification announced reaches them this way.
                self.router.controls_changed(lane)
                self.pauses[lane] = pauses
            if suspects:
                self.router.suspects_due(lane)
            if head is None:
                continue
            if head <= db_now:
                self.router.due_now(lane)
            else:
                self.router.due_at(lane, head)
