"""Nodes of one lane with different handlers (a rolling deploy that adds one, a second node's
own config): a worker leaves the jobs of handlers its node does not have to the nodes that
have them, without spending their attempts, and does not spin on them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import HANDLERS, Daemon, job_row, make_config, wait_until

import jobd
from jobd import queue
from jobd.claim_floors import full_scan_params
from jobd.claimer import Claimer
from jobd.config import LaneConfig
from jobd.jobs import Job
from jobd.protocol import WorkerMode
from jobd.queue import ClaimRequest

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

LANE = "default"


def request(limit: int = 10, *, lacking: tuple[str, ...] = (), suspect_first: bool = False,
            order: dict[str, Any] | None = None) -> ClaimRequest:
    return ClaimRequest(LANE, "w1", limit, 30, suspect_first=suspect_first,
                        floors=full_scan_params(), order=order, lacking_handlers=lacking)


def claim(conn: psycopg.Connection, req: ClaimRequest) -> queue.Claimed:
    return queue.settle_and_claim(conn, [], [], req)[2]


def test_the_claims_and_the_arming_probe_step_over_the_handlers_a_node_lacks(
    conn: psycopg.Connection,
) -> None:
    for handler in ("new", "old", "new", "old"):
        jobd.enqueue(conn, handler)
    fair = LaneConfig(name=LANE, fair_by="handler").claim_order(None)
    ordered = claim(conn, request(lacking=("new",), order=fair)).jobs
    assert sorted(job.handler for job in ordered) == ["old", "old"]
    for _ in range(2):
        jobd.enqueue(conn, "old")
    taken = claim(conn, request(lacking=("new",))).jobs
    assert sorted(job.handler for job in taken) == ["old", "old"]
    # Only jobs this worker cannot run are due: no reason to stay awake ...
    assert queue.arm(conn, LANE, "w1", full_scan_params(), ("new",)) == "armed"
    # ... while a worker that has the handler finds them.
    assert queue.arm(conn, LANE, "w2", full_scan_params()) == "work"
    assert sorted(job.handler for job in claim(conn, request()).jobs) == ["new", "new"]


def test_a_suspect_of_a_lacking_handler_is_left_for_a_node_that_has_it(
    conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "new")
    conn.execute("UPDATE jobs SET suspect = true WHERE id = %s", (job_id,))
    assert claim(conn, request(lacking=("new",), suspect_first=True)).suspect is None
    suspect = claim(conn, request(suspect_first=True)).suspect
    assert suspect is not None and suspect.id == job_id


def test_the_claimer_learns_a_lacking_handler_and_gives_its_jobs_back() -> None:
    claimer = Claimer(LaneConfig(name=LANE, concurrency=2), "w1", frozenset({"old"}))
    req = claimer.request(WorkerMode.RUNNING, 0)
    assert req is not None and req.lacking_handlers == ()
    claimer.suspects_possible = False
    jobs = [_job(1, "new"), _job(2, "old"), _job(3, "new")]
    claimer.took(queue.Claimed(jobs), req)
    assert claimer.handlers.lacking == ("new",)
    started = claimer.next_to_start(WorkerMode.RUNNING, 0)
    assert started is not None and started[0].id == 2
    assert claimer.next_to_start(WorkerMode.RUNNING, 1) is None
    assert sorted(job.id for job in claimer.to_release(WorkerMode.RUNNING, 0.0)) == [1, 3]
    claimer.released(WorkerMode.RUNNING, {1, 3})
    claimer.finished(2)
    claimer.maybe_more = True
    later = claimer.request(WorkerMode.RUNNING, 0)
    assert later is not None and later.lacking_handlers == ("new",)


def _job(job_id: int, handler: str) -> Job:
    now = datetime.now(UTC)
    return Job(id=job_id, lease_token=job_id, lane=LANE, handler=handler, payload_json="{}",
               priority=0, run_at=now, attempt=1, max_attempts=None, idempotency_key=None,
               created_at=now, lease_until=now, fairness_key=None)


@pytest.mark.slow
def test_a_node_without_a_handler_leaves_its_jobs_to_the_node_that_has_it(
    daemons: Callable[..., Daemon], effects_db: psycopg.Connection, tmp_path: Path,
) -> None:
    lanes = {LANE: {"workers": 1, "concurrency": 4}}
    old_config = make_config(lanes)
    old_config["node"]["name"] = "old"
    new_config = make_config(lanes, handlers={**HANDLERS, "extra": HANDLERS["ok"]})
    new_config["node"]["name"] = "new"
    old = daemons(old_config, name="old")
    old.wait_workers_started(LANE, 1)
    extra = [jobd.enqueue(effects_db, "extra") for _ in range(5)]
    plain = [jobd.enqueue(effects_db, "ok") for _ in range(5)]
    wait_until(lambda: all(job_row(effects_db, i)["state"] == "done" for i in plain), 15,
               message=lambda: "the old node to run the jobs it has a handler for\n"
               + old.tail())
    old.wait_for_log("this node has no such handler: its jobs are given back for the nodes "
                     "that have it, and this worker no longer claims them",
                     process=f"worker {LANE}#0", handler="extra")
    # Given back with their attempt, and the worker sleeps instead of claiming them again.
    wait_until(lambda: _armed(effects_db) == 1, 10, message="the old node's worker to arm")
    for job_id in extra:
        row = job_row(effects_db, job_id)
        assert (row["state"], row["attempts"]) == ("pending", 0), row

    new = daemons(new_config, name="new")
    wait_until(lambda: all(job_row(effects_db, i)["state"] == "done" for i in extra), 15,
               message=lambda: "the new node to run the extra jobs\n" + new.tail())
    new_pids = set(new.worker_pids(LANE).values())
    # With both nodes up, the extra jobs all go to the new node, first attempt each.
    extra += [jobd.enqueue(effects_db, "extra") for _ in range(10)]
    wait_until(lambda: all(job_row(effects_db, i)["state"] == "done" for i in extra), 15,
               message=lambda: "the extra jobs\n" + old.tail() + new.tail())
    rows = effects_db.execute(
        "SELECT pid, attempt FROM public.test_effects WHERE kind = 'start'"
        " AND job_id = ANY(%s)", (extra,)).fetchall()
    assert len(rows) == len(extra)
    assert {pid for pid, _attempt in rows} <= new_pids
    assert {attempt for _pid, attempt in rows} == {1}


def _armed(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM jobd.lane_waiters").fetchone()
    assert row is not None
    return int(row[0])
