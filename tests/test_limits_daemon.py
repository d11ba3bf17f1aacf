"""Limits across nodes with two daemons on one database: max_running holds however many
slots the nodes have, measured by sampling in SQL; the rate holds over any window, with
generous bounds (this asserts what the token bucket allows, not wall-clock precision)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, make_config, wait_until

import jobd
from jobd.db import connect

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]


class ClaimedSampler:
    """The most jobs of a lane claimed at once, sampled from a connection of its own."""

    def __init__(self, url: str, lane: str) -> None:
        self.url, self.lane = url, lane
        self.most = 0
        self.samples = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with connect(self.url) as conn:
            while not self.stopping.is_set():
                row = conn.execute("SELECT count(*) FROM jobs WHERE state = 'claimed'"
                                   " AND lane = %s", (self.lane,)).fetchone()
                assert row is not None
                self.most = max(self.most, int(row[0]))
                self.samples += 1
                self.stopping.wait(0.005)

    def __enter__(self) -> ClaimedSampler:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stopping.set()
        self.thread.join(10)


def finished(conn: psycopg.Connection, ids: list[int]) -> bool:
    row = conn.execute("SELECT count(*) FROM jobs_archive WHERE id = ANY(%s)",
                       (ids,)).fetchone()
    return row is not None and row[0] == len(ids)


def claimers(conn: psycopg.Connection, nodes: list[Daemon], lane: str) -> set[str]:
    """The daemons whose workers claimed the archived jobs of ``lane``."""
    workers = {e["worker"]: node.config_path.stem for node in nodes
               for e in node.events("worker spawned") if e["lane"] == lane}
    rows = conn.execute("SELECT DISTINCT claimed_by FROM jobs_archive WHERE lane = %s",
                        (lane,)).fetchall()
    return {workers[row[0]] for row in rows}


def two_daemons(daemons: Daemons, lane: str, settings: dict[str, Any]) -> list[Daemon]:
    config = make_config({lane: settings})
    nodes = [daemons(config, name="a"), daemons(config, name="b")]
    for node in nodes:
        node.wait_workers_started(lane, settings["workers"])
    return nodes


def test_max_running_holds_across_nodes(daemons: Daemons, db_url: str,
                                        effects_db: psycopg.Connection) -> None:
    # 2 nodes x 2 workers x 2 slots = 8 slots, at most 5 jobs claimed at once. One node's 4
    # slots cannot hold the whole budget, so both nodes claim under it at the same time (with
    # 8 slots a worker, one node could take every freed slot of the budget in the exchange
    # that freed it, and the other node's claims, retried every 50 ms, never got one).
    nodes = two_daemons(daemons, "capped", {"workers": 2, "concurrency": 2, "max_running": 5})
    jobs, seconds = 60, 0.2
    with ClaimedSampler(db_url, "capped") as sampler:
        ids = jobd.enqueue_many(effects_db, [jobd.JobSpec("slow", {"seconds": seconds},
                                                          lane="capped")
                                             for _ in range(jobs)])
        wait_until(lambda: finished(effects_db, ids), 60,
                   message=lambda: "the capped lane to drain\n" + nodes[0].tail())
    assert sampler.samples > 50
    assert 2 <= sampler.most <= 5, sampler.most
    # Between samples too: 60 jobs of 0.2 s, 5 at a time, take at least 2.4 s.
    row = effects_db.execute("SELECT max(finished_at) - min(claimed_at) FROM jobs_archive"
                             " WHERE lane = 'capped'").fetchone()
    assert row is not None and row[0] >= timedelta(seconds=jobs * seconds / 5 * 0.95)
    assert claimers(effects_db, nodes, "capped") == {"a", "b"}


def test_the_rate_holds_across_nodes(daemons: Daemons, effects_db: psycopg.Connection
                                     ) -> None:
    limit, jobs = 20, 100
    nodes = two_daemons(daemons, "rated", {"workers": 1, "concurrency": 10,
                                           "rate": {"limit": limit, "per": "1s"}})
    ids = jobd.enqueue_many(effects_db, [jobd.JobSpec("ok", lane="rated")
                                         for _ in range(jobs)])
    wait_until(lambda: finished(effects_db, ids), 60,
               message=lambda: "the rated lane to drain\n" + nodes[0].tail())
    claimed = [row[0] for row in effects_db.execute(
        "SELECT extract(epoch FROM claimed_at)::float8 FROM jobs_archive WHERE lane = 'rated'"
        " ORDER BY claimed_at").fetchall()]
    # A bucket of `limit` tokens refilled at `limit` per second allows, in any window of a
    # second, the bucket plus one second's refill; a little slack for the claims' clocks
    # (claimed_at is the claim transaction's start, the bucket reads clock_timestamp()).
    busiest = max(sum(1 for t in claimed if start <= t < start + 1.0) for start in claimed)
    assert busiest <= 2 * limit + 2, busiest
    # And over the whole drain: after the first bucketful, `limit` per second at most.
    assert claimed[-1] - claimed[0] >= (jobs - limit) / limit * 0.95
    assert claimers(effects_db, nodes, "rated") == {"a", "b"}
