"""Limits across nodes (lanes.<l>.max_running, lanes.<l>.rate): the config keys, and the
limited claim against a real PostgreSQL, with an injected clock for the token bucket.
(With daemons: tests/test_limits_daemon.py.)"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

import jobd
from jobd import queue
from jobd.config import LaneConfig, parse
from jobd.db import connect
from jobd.errors import ConfigError
from jobd.queries import query

LANE = "default"


def budget(max_running: int | None = None, rate_limit: int | None = None,
           rate_per: float = 1.0) -> dict[str, Any]:
    return LaneConfig(LANE, max_running=max_running, rate_limit=rate_limit,
                      rate_per=rate_per).budget()


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def claim(conn: psycopg.Connection, limits: dict[str, Any], limit: int = 100,
          now: datetime | None = None, worker: str = "w1") -> list[jobd.Job]:
    return queue.claim(conn, LANE, worker, limit, 30, now=now, budget=limits)


# --- config --------------------------------------------------------------------------------


def test_limits_come_from_the_lane_config() -> None:
    config = parse("lanes:\n  a: {max_running: 20, rate: {limit: 100, per: 2s}}\n"
                   "  b: {rate: {limit: 5}}\n  c: {}\n", "jobd.yaml")
    a, b, c = config.lanes["a"], config.lanes["b"], config.lanes["c"]
    assert (a.max_running, a.rate_limit, a.rate_per, a.limited) == (20, 100, 2.0, True)
    assert (b.max_running, b.rate_limit, b.rate_per, b.limited) == (None, 5, 1.0, True)
    assert (c.limited, c.budget()) == (False, {"max_running": None, "rate_limit": None,
                                               "rate_per": 1.0})
    # Jobs claimed ahead would count against max_running in one worker's buffer.
    assert (a.buffer_size, b.buffer_size, c.buffer_size) == (0, 24, 24)
    assert parse("lanes:\n  a: {max_running: 2, prefetch: 4}\n").lanes["a"].buffer_size == 4


def test_a_lane_of_single_attempts_claims_nothing_ahead_unless_it_says_so() -> None:
    # A whole node's crash spends an attempt on each job it held, started or not.
    lanes = parse("lanes:\n  once: {max_attempts: 1}\n  twice: {max_attempts: 2}\n"
                  "  told: {max_attempts: 1, prefetch: 4}\n").lanes
    assert [lanes[name].buffer_size for name in ("once", "twice", "told")] == [0, 24, 4]


@pytest.mark.parametrize(("text", "message"), [
    ("{max_running: 0}", "lanes.a.max_running: must be an integer from 1 to 1000000"),
    ("{max_running: many}", "lanes.a.max_running: must be an integer"),
    ("{rate: 100}", "lanes.a.rate: must be a mapping"),
    ("{rate: {per: 1s}}", "lanes.a.rate: needs limit"),
    ("{rate: {limit: 0}}", "lanes.a.rate.limit: must be an integer from 1 to 1000000"),
    ("{rate: {limit: 5, per: 0s}}", "lanes.a.rate.per: must be longer than zero"),
    ("{rate: {limit: 5, burst: 9}}", "lanes.a.rate.burst: unknown key"),
])
def test_bad_limits_are_refused_with_file_line_and_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(f"lanes:\n  a: {text}\n", "jobd.yaml")
    assert str(caught.value).startswith(f"jobd.yaml:2: {message}")


# --- the limited claim ---------------------------------------------------------------------


def scan(text: str) -> str:
    """The paused/levels/due part of a claim query, without the due CTE's outer LIMIT."""
    body = text[text.index("paused AS ("):]
    return body[:body.index("\n     LIMIT ", body.index("due AS ("))]


def test_the_limited_claim_scans_as_the_plain_claim_does() -> None:
    plain, limited = scan(query("claim_jobs")), scan(query("claim_jobs_limited"))
    assert "FOR UPDATE SKIP LOCKED" in plain
    assert limited == plain


def test_max_running_caps_the_claimed_jobs_of_the_lane_across_claimers(
    conn: psycopg.Connection,
) -> None:
    for _ in range(10):
        jobd.enqueue(conn, "h")
    jobd.enqueue(conn, "h", lane="other")
    limits = budget(max_running=3)
    first = claim(conn, limits, worker="w1")
    assert len(first) == 3
    assert claim(conn, limits, worker="w2") == []
    # Other lanes do not count.
    assert len(queue.claim(conn, "other", "w3", 10, 30)) == 1
    queue.complete(conn, [first[0].lease])
    assert len(claim(conn, limits, worker="w2")) == 1
    assert len(claim(conn, budget(max_running=10), limit=2)) == 2  # the claim's own limit


def test_the_rate_is_a_token_bucket_that_refills_with_time(conn: psycopg.Connection) -> None:
    for _ in range(30):
        jobd.enqueue(conn, "h")
    limits = budget(rate_limit=5, rate_per=1.0)
    start = db_now(conn)

    def at(seconds: float) -> int:
        return len(claim(conn, limits, now=start + timedelta(seconds=seconds)))

    assert at(0.0) == 5  # a full bucket: one `per` worth at once
    assert at(0.0) == 0
    assert at(0.5) == 2  # 2.5 tokens
    assert at(0.5) == 0  # 0.5 left
    assert at(0.7) == 1  # 0.5 + 1.0
    assert at(100.0) == 5  # never more than a full bucket
    row = conn.execute("SELECT tokens FROM lane_tokens WHERE lane = %s", (LANE,)).fetchone()
    assert row == (0.0,)


def test_a_claim_that_finds_less_than_its_budget_spends_only_what_it_took(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue(conn, "h")
    limits = budget(rate_limit=10, max_running=10)
    start = db_now(conn)
    assert len(claim(conn, limits, now=start)) == 1
    row = conn.execute("SELECT tokens FROM lane_tokens WHERE lane = %s", (LANE,)).fetchone()
    assert row == (9.0,)


def test_claims_of_a_limited_lane_take_turns(db_url: str, conn: psycopg.Connection) -> None:
    for _ in range(4):
        jobd.enqueue(conn, "h")
    limits = budget(max_running=3)
    with connect(db_url, autocommit=False) as first:
        first.execute(query("lock_lane_budget"), {"lane": LANE})
        assert len(first.execute(query("claim_jobs_limited"), {
            "lane": LANE, "worker": "w1", "limit": 2, "visibility_timeout": 30.0,
            "now": None, **queue.claim_floors.full_scan_params(), **queue.UNORDERED,
            "lacking_handlers": [], "payload_bytes": None, "least": 1,
            "starting": None, "lane_max_attempts": None,
            **limits}).fetchall()) == 2
        with connect(db_url, autocommit=False) as second:
            # While the first claim is not committed, the next one waits for its turn ...
            second.execute("SET lock_timeout = '100ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                second.execute(query("lock_lane_budget"), {"lane": LANE})
        first.commit()
    # ... and then counts what the first took: one more, not three.
    assert len(claim(conn, limits, worker="w2")) == 1


def test_a_limited_claim_through_the_worker_path(conn: psycopg.Connection) -> None:
    for _ in range(5):
        jobd.enqueue(conn, "h")
    request = queue.ClaimRequest(LANE, "w1", 10, 30, floors=queue.claim_floors.
                                 full_scan_params(), budget=budget(max_running=2))
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], request)
    assert len(claimed.jobs) == 2
    # Outcomes and the claim in one transaction: the completion frees a place for the claim.
    _done, _failed, claimed = queue.settle_and_claim(conn, [claimed.jobs[0].lease], [],
                                                     request)
    assert len(claimed.jobs) == 1


def test_a_suspect_counts_against_max_running(conn: psycopg.Connection) -> None:
    # Suspects (a dead worker's jobs, each run alone: claim_suspect) are claimed by an idle
    # worker before anything else; in a full lane they wait like any job.
    jobd.enqueue(conn, "h")
    suspect = jobd.enqueue(conn, "h")
    conn.execute("UPDATE jobs SET suspect = true WHERE id = %s", (suspect,))
    limits = budget(max_running=1)
    full = queue.ClaimRequest(LANE, "w1", 1, 30, budget=limits)
    assert len(queue.settle_and_claim(conn, [], [], full)[2].jobs) == 1
    idle = queue.ClaimRequest(LANE, "w2", 1, 30, budget=limits, suspect_first=True)
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], idle)
    assert (claimed.suspect, claimed.jobs) == (None, [])
    running = conn.execute("SELECT count(*) FROM jobs WHERE state = 'claimed'").fetchone()
    assert running == (1,)
    # Once the lane has room, the suspect goes first.
    conn.execute("DELETE FROM jobs WHERE state = 'claimed'")
    _done, _failed, claimed = queue.settle_and_claim(conn, [], [], idle)
    assert claimed.suspect is not None and claimed.suspect.id == suspect


def test_a_suspect_spends_a_rate_token_and_waits_for_one(conn: psycopg.Connection) -> None:
    # A suspect is claimed alone by an idle worker (claim_suspect) but budgeted as any job:
    # the lane's rate holds however many of a dead worker's jobs are suspects.
    suspects = [jobd.enqueue(conn, "h") for _ in range(3)]
    conn.execute("UPDATE jobs SET suspect = true WHERE id = ANY(%s)", (suspects,))
    limits = budget(rate_limit=2, rate_per=1.0)
    start = db_now(conn)

    def suspect_at(worker: str, seconds: float) -> int | None:
        request = queue.ClaimRequest(LANE, worker, 1, 30, budget=limits, suspect_first=True)
        claimed = queue.settle_and_claim(conn, [], [], request,
                                         now=start + timedelta(seconds=seconds))[2]
        assert claimed.jobs == []  # a worker holding a suspect takes nothing else
        return None if claimed.suspect is None else claimed.suspect.id

    assert suspect_at("w1", 0.0) == suspects[0]
    assert suspect_at("w2", 0.0) == suspects[1]
    assert suspect_at("w3", 0.0) is None  # the bucket is empty
    row = conn.execute("SELECT tokens FROM lane_tokens WHERE lane = %s", (LANE,)).fetchone()
    assert row == (0.0,)
    assert suspect_at("w3", 0.5) == suspects[2]  # one token back after half a second
