"""Fairness within a lane (docs/design/fairness.md): age-based promotion (max_wait) and
round-robin shares across keys (fair_by), through the real claim against PostgreSQL with an
injected clock. (With daemons: tests/test_fairness_daemon.py.)"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

import jobd
from jobd import claim_floors, dlq, queue
from jobd import migrate as migrate_module
from jobd.claimer import Claimer
from jobd.config import LaneConfig, parse
from jobd.db import connect
from jobd.errors import ConfigError
from jobd.key_positions import next_key_cursor
from jobd.protocol import WorkerMode

if TYPE_CHECKING:
    from conftest import Databases

LANE = "default"


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0]


def order(max_wait: float | None = None, fair_by: str = "none",
          cursor: str | None = None) -> dict[str, Any]:
    return LaneConfig(LANE, max_wait=max_wait, fair_by=fair_by).claim_order(cursor)


def claim(conn: psycopg.Connection, limit: int, now: datetime | None = None,
          lane_order: dict[str, Any] | None = None, **limits: Any) -> list[jobd.Job]:
    budget = LaneConfig(LANE, **limits).budget() if limits else None
    return queue.claim(conn, LANE, "w1", limit, 30, now=now, order=lane_order, budget=budget)


def bulk(conn: psycopg.Connection, count: int, handler: str, at: datetime,
         **fields: Any) -> None:
    jobd.enqueue_many(conn, [jobd.JobSpec(handler, {"n": n}, LANE, at, **fields)
                             for n in range(count)])


def share_keys(jobs: list[jobd.Job]) -> list[str]:
    return [job.fairness_key or job.handler for job in jobs]


# --- age-based promotion -------------------------------------------------------------------


def test_a_job_overdue_by_max_wait_goes_ahead_of_higher_priorities(
    conn: psycopg.Connection,
) -> None:
    t0 = db_now(conn)
    low = jobd.enqueue(conn, "low", lane=LANE, run_at=t0, priority=0)
    bulk(conn, 20, "high", t0 + timedelta(seconds=1), priority=9)
    aged = order(max_wait=60)
    # Not overdue yet: strict priority.
    with conn.transaction():
        early = claim(conn, 5, now=t0 + timedelta(seconds=30), lane_order=aged)
        assert {job.handler for job in early} == {"high"}
        raise psycopg.Rollback()
    # Passed over for max_wait: first, whatever its priority.
    first = claim(conn, 5, now=t0 + timedelta(seconds=61), lane_order=aged)
    assert first[0].id == low
    assert {job.handler for job in first} == {"low", "high"}


def test_overdue_jobs_of_several_priorities_go_oldest_first(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    bulk(conn, 3, "p5", t0 - timedelta(seconds=100), priority=5)
    bulk(conn, 3, "p1", t0 - timedelta(seconds=200), priority=1)
    bulk(conn, 3, "p9", t0, priority=9)
    taken = claim(conn, 6, now=t0, lane_order=order(max_wait=50))
    assert sorted(job.handler for job in taken) == ["p1"] * 3 + ["p5"] * 3


@pytest.mark.parametrize("fair_by", ["handler", "fairness_key"])
def test_a_herd_older_than_max_wait_does_not_hold_back_the_other_keys(
    conn: psycopg.Connection, fair_by: str
) -> None:
    # With max_wait and fair_by (as in the example config), a herd of one key due for longer
    # than max_wait (delayed jobs a clock jump made due, a backlog that outlived max_wait)
    # filled every claim as overdue work, and the other keys' new jobs of the same priority
    # waited max_wait each. No higher priority passes them over: they share the claim.
    t0 = db_now(conn)
    bulk(conn, 500, "herd", t0 - timedelta(hours=1))
    bulk(conn, 5, "mail", t0)
    jobd.enqueue(conn, "sms", lane=LANE, run_at=t0 - timedelta(seconds=1))
    taken = claim(conn, 12, now=t0, lane_order=order(max_wait=60, fair_by=fair_by))
    assert sorted(share_keys(taken)) == ["herd"] * 6 + ["mail"] * 5 + ["sms"]


def test_a_fair_claim_lists_each_job_once_when_the_top_prioritys_jobs_all_fit(
    conn: psycopg.Connection,
) -> None:
    # The top priority's overdue level takes its younger jobs too; the second pass, which
    # visits the younger jobs of each priority, took them again (rows the claim's own
    # transaction locked are not skipped): {1,2,3,4,3,4}.
    t0 = db_now(conn)
    bulk(conn, 2, "herd", t0 - timedelta(hours=1))
    bulk(conn, 2, "mail", t0 - timedelta(seconds=1))
    conn.execute("SELECT merge_wanted_priorities()")
    with conn.transaction(force_rollback=True):
        row = conn.execute(
            "SELECT claim_order(%s, '{}', '{}', '{}', '{}', NULL, %s, 60, true, NULL, 10,"
            " '{}', '{}', '{}', '{}', '{}')", (LANE, t0)).fetchone()
    assert row is not None and len(row[0]) == len(set(row[0])) == 4


def test_an_older_overdue_job_of_a_lower_priority_goes_ahead_of_a_fair_lanes_top_one(
    conn: psycopg.Connection,
) -> None:
    # The top priority's claim of all its due jobs keeps the place its oldest overdue job
    # gives it: a lower priority's job overdue for longer still goes first, one overdue for
    # less comes after it.
    t0 = db_now(conn)
    bulk(conn, 50, "herd", t0 - timedelta(seconds=300), priority=9)
    bulk(conn, 50, "mail", t0, priority=9)
    low = jobd.enqueue(conn, "low", lane=LANE, run_at=t0 - timedelta(seconds=600))
    younger = jobd.enqueue(conn, "p5", lane=LANE, run_at=t0 - timedelta(seconds=120),
                           priority=5)
    taken = claim(conn, 10, now=t0, lane_order=order(max_wait=60, fair_by="handler"))
    assert taken[0].id == low and younger not in [job.id for job in taken]
    assert sorted(share_keys(taken)[1:]) == ["herd"] * 5 + ["mail"] * 4


@pytest.mark.parametrize("blocker", ["paused", "suspect"])
@pytest.mark.parametrize("fair_by", ["none", "handler"])
def test_an_overdue_job_the_claim_cannot_take_does_not_put_its_priority_first(
    conn: psycopg.Connection, blocker: str, fair_by: str
) -> None:
    # The overdue pass orders priorities by their oldest overdue job. A job the claim steps
    # over (a paused handler's, a suspect) put its priority first: the claim filled with that
    # priority's younger overdue jobs and passed over an older one of another priority.
    t0 = db_now(conn)
    jobd.enqueue(conn, "blocker", lane=LANE, run_at=t0 - timedelta(seconds=600), priority=5)
    oldest = jobd.enqueue(conn, "low", lane=LANE, run_at=t0 - timedelta(seconds=400))
    bulk(conn, 20, "busy", t0 - timedelta(seconds=120), priority=5)
    if blocker == "paused":
        jobd.pause(conn, LANE, handler="blocker")
    else:
        conn.execute("UPDATE jobs SET suspect = true WHERE handler = 'blocker'")
    taken = claim(conn, 10, now=t0, lane_order=order(max_wait=60, fair_by=fair_by))
    assert len(taken) == 10 and oldest in [job.id for job in taken]
    assert "blocker" not in share_keys(taken)


def saturated_lane(conn: psycopg.Connection, lane_order: dict[str, Any] | None,
                   rounds: int) -> int | None:
    """A lane kept full by a flood of priority-9 jobs (each second 10 arrive, 10 are
    claimed) and one priority-0 job due from the start: the round it is claimed in."""
    t0 = db_now(conn)
    low = jobd.enqueue(conn, "low", lane=LANE, run_at=t0, priority=0)
    for second in range(rounds):
        now = t0 + timedelta(seconds=second)
        bulk(conn, 10, "flood", now, priority=9)
        taken = claim(conn, 10, now=now, lane_order=lane_order)
        assert len(taken) == 10  # saturated: every claim is full
        if low in [job.id for job in taken]:
            return second
        queue.complete(conn, [job.lease for job in taken])
    return None


def test_under_a_flood_of_high_priority_work_a_low_priority_job_starts_after_max_wait(
    conn: psycopg.Connection,
) -> None:
    started = saturated_lane(conn, order(max_wait=5), rounds=30)
    assert started is not None and 5 <= started <= 7


def test_without_max_wait_the_flood_starves_it(conn: psycopg.Connection) -> None:
    assert saturated_lane(conn, None, rounds=30) is None


# --- the order a claim's jobs start in ------------------------------------------------------


def started_in_order(conn: psycopg.Connection, lane: LaneConfig) -> list[int]:
    """The ids one claim of an idle worker of ``lane`` took, in the order it starts them."""
    worker = Claimer(lane, "w1")
    worker.suspects_possible = False
    request = worker.request(WorkerMode.RUNNING, 0)
    assert request is not None
    worker.took(queue.settle_and_claim(conn, [], [], request)[2], request)
    started = []
    while (entry := worker.next_to_start(WorkerMode.RUNNING, 0)) is not None:
        started.append(entry[0].id)
    return started


# claim_jobs_ordered, and claim_jobs_limited's pick by claim_order() in a rate-limited lane.
ORDERED_LANES = pytest.mark.parametrize("fair_by, rate", [
    ("none", None), ("handler", None), ("none", 1000), ("handler", 1000)])


@ORDERED_LANES
def test_an_ordered_claims_jobs_start_highest_priority_first_whatever_their_ids(
    conn: psycopg.Connection, fair_by: str, rate: int | None
) -> None:
    # The UPDATE returns the rows by id and the worker starts its buffer in that order: in a
    # lane with max_wait or fair_by, a priority-0 job enqueued before three of priority 5
    # started first, one job at a time, ahead of all of them.
    older = jobd.enqueue(conn, "h", priority=0)
    newer = [jobd.enqueue(conn, "h", priority=5) for _ in range(3)]
    lane = LaneConfig(LANE, concurrency=1, prefetch=3, max_wait=3600, fair_by=fair_by,
                      rate_limit=rate)
    assert started_in_order(conn, lane) == [*newer, older]


@ORDERED_LANES
def test_an_overdue_job_starts_ahead_of_the_younger_work_its_claim_took(
    conn: psycopg.Connection, fair_by: str, rate: int | None
) -> None:
    # claim_order takes the overdue job first; the worker started it last, behind every
    # higher-priority job of its claim with a smaller id.
    t0 = db_now(conn)
    fresh = [jobd.enqueue(conn, "h", run_at=t0, priority=9) for _ in range(3)]
    overdue = jobd.enqueue(conn, "h", run_at=t0 - timedelta(seconds=120), priority=0)
    older_overdue = jobd.enqueue(conn, "h", run_at=t0 - timedelta(seconds=300), priority=1)
    lane = LaneConfig(LANE, concurrency=1, prefetch=4, max_wait=60, fair_by=fair_by,
                      rate_limit=rate)
    assert started_in_order(conn, lane) == [older_overdue, overdue, *fresh]


# --- fair shares ---------------------------------------------------------------------------


def test_a_herd_of_one_handler_does_not_hold_back_the_others(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    bulk(conn, 5000, "herd", t0 - timedelta(minutes=5))
    bulk(conn, 10, "mail", t0)
    bulk(conn, 10, "sms", t0)
    with conn.transaction():
        unfair = claim(conn, 30, now=t0)
        assert set(share_keys(unfair)) == {"herd"}
        raise psycopg.Rollback()
    fair = claim(conn, 30, now=t0, lane_order=order(fair_by="handler"))
    assert sorted(share_keys(fair)) == ["herd"] * 10 + ["mail"] * 10 + ["sms"] * 10
    # Each key's oldest jobs, in order.
    herd = [job for job in fair if job.handler == "herd"]
    assert [job.payload["n"] for job in herd] == list(range(10))


def claim_from_positions(conn: psycopg.Connection, positions: dict[tuple[int, str],
                                                                   tuple[datetime, int]]
                         ) -> set[int]:
    """The ids a fair claim of 10 takes, the worker's positions per (priority, share key)
    sent as the claimer sends them; given back after."""
    floors = {**claim_floors.full_scan_params(),
              "key_floor_priorities": [priority for priority, _key in positions],
              "key_floor_keys": [key for _priority, key in positions],
              "key_floor_run_ats": [at for at, _id in positions.values()],
              "key_floor_ids": [job_id for _at, job_id in positions.values()]}
    request = queue.ClaimRequest(LANE, "w1", 10, 30, floors=floors,
                                 order=order(fair_by="handler"))
    claimed = queue.settle_and_claim(conn, [], [], request)[2].jobs
    queue.release(conn, [job.lease for job in claimed])
    return {job.id for job in claimed}


def test_a_fair_claim_starts_each_key_at_the_workers_position_for_it(
    conn: psycopg.Connection,
) -> None:
    t0 = db_now(conn)
    first, second, third = (jobd.enqueue(conn, "h", lane=LANE, fairness_key="tenant:a",
                                         run_at=t0 - timedelta(seconds=s, microseconds=7))
                            for s in (3, 2, 1))
    other_key = jobd.enqueue(conn, "h", lane=LANE, fairness_key="b",
                             run_at=t0 - timedelta(seconds=3))
    other_priority = jobd.enqueue(conn, "h", lane=LANE, fairness_key="tenant:a", priority=1,
                                  run_at=t0 - timedelta(seconds=3))
    run_at = dict(conn.execute("SELECT id, run_at FROM jobs").fetchall())
    everything = {first, second, third, other_key, other_priority}
    assert claim_from_positions(conn, {}) == everything
    # The position is the last job of the key the worker took: its scan starts there, and
    # only for that priority and key.
    assert claim_from_positions(conn, {(0, "tenant:a"): (run_at[second], second)}) == (
        everything - {first})
    # To the microsecond: a position just past the second job steps over it too.
    assert claim_from_positions(
        conn, {(0, "tenant:a"): (run_at[second] + timedelta(microseconds=1), 0)}) == (
        everything - {first, second})
    # A position below the priority's floor changes nothing; one of another key, nothing.
    assert claim_from_positions(conn, {(0, "tenant:a"): (t0 - timedelta(days=1), 0),
                                       (0, "c"): (t0, 0)}) == everything


def test_a_session_that_made_fair_claims_before_migration_0028_goes_on_after_it(
    databases: Databases, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0028 replaced the functions under claim_order (same signature): a daemon whose
    session planned the old ones keeps claiming, and takes what it would have taken."""
    url = databases.empty()
    # And 0032, the lease tokens this release's claims draw (the session claims with them).
    before_0028 = [m for m in migrate_module.available() if m.version < 28 or m.version == 32]
    with connect(url, autocommit=True) as admin:
        monkeypatch.setattr(migrate_module, "available", lambda: before_0028)
        migrate_module.migrate(admin, "jobd")
        monkeypatch.undo()
        with connect(url, "jobd", autocommit=True) as daemon:
            t0 = db_now(daemon)
            ids = [jobd.enqueue(daemon, "h", lane=LANE, fairness_key=key,
                                run_at=t0 - timedelta(seconds=n, microseconds=3))
                   for n, key in enumerate(["a", "a", "b", "c"])]
            run_at = dict(daemon.execute("SELECT id, run_at FROM jobs").fetchall())
            # The position of key a at its newer job: the older one lies below it.
            positions = {(0, "a"): (run_at[ids[0]], ids[0])}
            assert claim_from_positions(daemon, positions) == set(ids) - {ids[1]}
            assert [m.version for m in migrate_module.migrate(admin, "jobd")] == [
                m.version for m in migrate_module.available() if m not in before_0028]
            assert claim_from_positions(daemon, positions) == set(ids) - {ids[1]}


def test_a_key_with_few_jobs_leaves_its_share_to_the_others(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    bulk(conn, 100, "a", t0)
    bulk(conn, 2, "b", t0)
    fair = claim(conn, 20, now=t0, lane_order=order(fair_by="handler"))
    assert sorted(share_keys(fair)) == ["a"] * 18 + ["b"] * 2


@pytest.mark.parametrize("names", [("a", "b", "c"), ("k1", "k2", "k3")])
def test_what_a_key_that_ran_dry_leaves_goes_to_the_others(
    conn: psycopg.Connection, names: tuple[str, str, str],
) -> None:
    """Fewer jobs left than keys in a round: the keys with no share this round stay for the
    next, so the claim still fills up (it came back short, and the worker then thought the
    lane dry, with jobs left)."""
    t0 = db_now(conn)
    for name, count in zip(names, (2, 2, 10), strict=True):
        bulk(conn, count, "h", t0, fairness_key=name)
    fair = claim(conn, 7, now=t0, lane_order=order(fair_by="fairness_key"))
    assert len(fair) == 7
    assert sorted(share_keys(fair)).count(names[2]) == 3


def test_fairness_keys_share_within_one_handler(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    bulk(conn, 1000, "report", t0 - timedelta(minutes=1), fairness_key="tenant-big")
    bulk(conn, 5, "report", t0, fairness_key="tenant-small")
    bulk(conn, 5, "report", t0)  # no key: shares as its handler
    fair = claim(conn, 15, now=t0, lane_order=order(fair_by="fairness_key"))
    assert sorted(share_keys(fair)) == (["report"] * 5 + ["tenant-big"] * 5
                                        + ["tenant-small"] * 5)


def test_with_more_keys_than_a_claim_takes_the_keys_rotate(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    for key in range(250):
        bulk(conn, 3, "h", t0, fairness_key=f"tenant-{key:03}")
    cursor: str | None = None
    claims: list[set[str]] = []
    for _ in range(3):
        taken = claim(conn, 100, now=t0, lane_order=order(fair_by="handler", cursor=cursor))
        keys = share_keys(taken)
        assert len(keys) == len(set(keys)) == 100  # one job from each of 100 keys
        claims.append(set(keys))
        cursor = next_key_cursor(cursor, taken)
    # The third claim went on from the 200th key and around to the first 50.
    expected = [f"tenant-{key:03}" for key in range(250)]
    assert claims[0] | claims[1] == set(expected[:200])
    assert claims[2] == set(expected[200:] + expected[:50])


@pytest.mark.parametrize("other", ["higher priority", "overdue"])
def test_the_keys_rotate_when_a_claim_also_takes_another_levels_jobs(
    conn: psycopg.Connection, other: str
) -> None:
    # Twenty tenants with a backlog, four of them busier. Every claim also takes a job of
    # another level: a higher priority's key (webhook, sorting after the tenants), or an
    # overdue job (zz-late). A cursor taken over every level stayed on that key, and the
    # tenants' level started at its first keys at every claim: 4 tenants of 20 served.
    t0 = db_now(conn)
    for key in range(20):
        bulk(conn, 50, "h", t0 - timedelta(seconds=5), fairness_key=f"t{key:02}")
    lane = LaneConfig(LANE, fair_by="fairness_key",
                      max_wait=60.0 if other == "overdue" else None)
    cursor: str | None = None
    served: set[str] = set()
    for n in range(10):
        if other == "overdue":
            jobd.enqueue(conn, "h", run_at=t0 - timedelta(minutes=5), fairness_key="zz-late")
        else:
            jobd.enqueue(conn, "h", run_at=t0, priority=5, fairness_key="webhook")
        now = t0 + timedelta(milliseconds=n)
        taken = claim(conn, 5, now=now, lane_order=lane.claim_order(cursor))
        assert len(taken) == 5
        served |= {key for key in share_keys(taken) if key.startswith("t")}
        cursor = next_key_cursor(cursor, taken,
                                 now - timedelta(seconds=60) if lane.max_wait else None)
    assert len(served) == 20


def test_the_cursor_is_the_last_key_reached() -> None:
    def jobs(*keys: str) -> list[jobd.Job]:
        now = datetime(2026, 1, 1).astimezone()
        return [jobd.Job(n, n, LANE, "h", "{}", 0, now, 1, None, None, now, now, key)
                for n, key in enumerate(keys)]

    assert next_key_cursor(None, jobs("b", "a", "c")) == "c"
    assert next_key_cursor("b", jobs("c", "d")) == "d"
    assert next_key_cursor("m", jobs("x", "y", "a", "c")) == "c"  # wrapped around
    assert next_key_cursor("m", jobs("a", "m")) == "m"


def test_the_cursor_counts_the_top_prioritys_overdue_keys_with_its_others() -> None:
    # In a fair lane with max_wait, the highest priority's overdue jobs and its younger ones
    # are one level (migration 0048): the last key reached may be an overdue one's.
    now = datetime(2026, 1, 1).astimezone()
    overdue_before = now - timedelta(seconds=60)

    def job(n: int, key: str, age: float, priority: int = 0) -> jobd.Job:
        at = now - timedelta(seconds=age)
        return jobd.Job(n, n, LANE, "h", "{}", priority, at, 1, None, None, at, now, key)

    taken = [job(1, "t16", 1), job(2, "t17", 1), job(3, "zz-herd", 3600)]
    assert next_key_cursor("t15", taken, overdue_before) == "zz-herd"
    # A lower priority's overdue level younger than the top's comes after it: its keys.
    taken = [job(1, "zz-herd", 3600), job(2, "t17", 1), job(3, "low", 120, priority=-1)]
    assert next_key_cursor("t15", taken, overdue_before) == "low"
    # The top priority without overdue jobs is visited in the second pass, last.
    taken = [job(1, "low", 120, priority=-1), job(2, "t17", 1)]
    assert next_key_cursor("t15", taken, overdue_before) == "t17"


def test_fair_shares_within_a_priority_and_priorities_still_first(
    conn: psycopg.Connection,
) -> None:
    t0 = db_now(conn)
    bulk(conn, 10, "urgent", t0, priority=5)
    bulk(conn, 100, "a", t0)
    bulk(conn, 100, "b", t0)
    fair = claim(conn, 20, now=t0, lane_order=order(fair_by="handler"))
    assert sorted(share_keys(fair)) == ["a"] * 5 + ["b"] * 5 + ["urgent"] * 10


def test_a_fair_lane_with_max_running_stays_within_it(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    bulk(conn, 50, "a", t0)
    bulk(conn, 50, "b", t0)
    taken = claim(conn, 100, now=t0, lane_order=order(fair_by="handler"), max_running=8)
    assert sorted(share_keys(taken)) == ["a"] * 4 + ["b"] * 4
    assert claim(conn, 100, now=t0, lane_order=order(fair_by="handler"), max_running=8) == []


def test_paused_handlers_and_suspects_are_stepped_over(conn: psycopg.Connection) -> None:
    t0 = db_now(conn)
    bulk(conn, 5, "a", t0)
    bulk(conn, 5, "b", t0)
    jobd.pause(conn, LANE, handler="a")
    conn.execute("UPDATE jobs SET suspect = true WHERE payload->>'n' = '0'")
    fair = claim(conn, 10, now=t0, lane_order=order(fair_by="handler", max_wait=1))
    assert sorted(share_keys(fair)) == ["b"] * 4


def test_keys_whose_due_jobs_a_claim_must_step_over_leave_it_to_the_keys_after_them(
    conn: psycopg.Connection,
) -> None:
    # A claim of four looks for four share keys with due jobs. The first four keys in order
    # hold only a paused handler's jobs and suspects: were they counted, the claim would take
    # nothing, and the next claim would start at the same keys, for as long as the pause.
    t0 = db_now(conn)
    for key in ("t1", "t2"):
        bulk(conn, 1, "mail", t0, fairness_key=key)
    for key in ("t3", "t4"):
        bulk(conn, 1, "report", t0, fairness_key=key)
    conn.execute("UPDATE jobs SET suspect = true WHERE fairness_key IN ('t3', 't4')")
    for key in ("t5", "t6", "t7", "t8"):
        bulk(conn, 1, "resize", t0, fairness_key=key)
    jobd.pause(conn, LANE, handler="mail")
    taken = claim(conn, 4, now=t0, lane_order=order(fair_by="fairness_key"))
    assert sorted(share_keys(taken)) == ["t5", "t6", "t7", "t8"]


@pytest.mark.parametrize("cursor", [None, "t2"])
def test_keys_whose_jobs_another_claim_holds_leave_it_to_the_keys_after_them(
    conn: psycopg.Connection, db_url: str, cursor: str | None,
) -> None:
    # Another worker's claim, not yet committed, holds every due job of the first keys this
    # claim finds. Those keys take nothing; the claim must go on to the keys after them, or it
    # comes back short and its worker thinks the lane dry with jobs left. With a cursor, the
    # keys after it come first and the ones before it (around the wrap) after them.
    t0 = db_now(conn)
    for key in ("t1", "t2", "t3", "t4", "t5", "t6"):
        bulk(conn, 2, "h", t0, fairness_key=key)
    held = ("t3", "t4") if cursor else ("t1", "t2")
    with connect(db_url) as other, other.transaction():
        other.execute("SELECT id FROM jobs WHERE fairness_key = ANY(%s) FOR UPDATE",
                      [list(held)])
        taken = claim(conn, 2, now=t0, lane_order=order(fair_by="fairness_key", cursor=cursor))
        assert len(taken) == 2
        assert not set(share_keys(taken)) & set(held)
        # Every key left but the held ones: the keys after them, then around the wrap.
        rest = claim(conn, 8, now=t0, lane_order=order(fair_by="fairness_key", cursor=cursor))
        assert len(rest) == 6
        assert not set(share_keys(rest)) & set(held)


# --- entry points and config ---------------------------------------------------------------


def test_every_entry_point_takes_a_fairness_key(conn: psycopg.Connection) -> None:
    one = jobd.enqueue(conn, "h", fairness_key="t1")
    many = jobd.enqueue_many(conn, [jobd.JobSpec("h", fairness_key="t2")])
    row = conn.execute("SELECT enqueue('h', fairness_key => 't3')").fetchone()
    assert row is not None
    keys = dict(conn.execute("SELECT id, fairness_key FROM all_jobs").fetchall())
    assert (keys[one], keys[many[0]], keys[row[0]]) == ("t1", "t2", "t3")


@pytest.mark.parametrize(("key", "message"), [
    ("", "fairness_key must be a non-empty string"),
    ("x" * 257, "fairness_key is 257 bytes; at most 256 are allowed"),
])
def test_every_entry_point_refuses_a_bad_fairness_key(conn: psycopg.Connection, key: str,
                                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        jobd.enqueue(conn, "h", fairness_key=key)
    with pytest.raises(ValueError, match=message):
        jobd.enqueue_many(conn, [jobd.JobSpec("h", fairness_key=key)])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        conn.execute("SELECT enqueue('h', fairness_key => %s)", (key,))


def test_the_key_survives_the_dead_letter_queue_and_the_archive(
    conn: psycopg.Connection,
) -> None:
    job_id = jobd.enqueue(conn, "h", fairness_key="tenant-7")
    dlq.quarantine(conn, "h")
    assert conn.execute("SELECT fairness_key FROM dead_letter").fetchall() == [("tenant-7",)]
    dlq.replay_handler(conn, "h")
    (job,) = claim(conn, 1)
    assert job.fairness_key == "tenant-7"
    queue.complete(conn, [job.lease])
    row = conn.execute("SELECT state, fairness_key FROM all_jobs WHERE id = %s",
                       (job_id,)).fetchone()
    assert row == ("done", "tenant-7")


# --- an empty fairness key (migration 0049) -------------------------------------------------


def fair_claim(conn: psycopg.Connection, lane: str, limit: int = 10) -> list[jobd.Job]:
    lane_order = LaneConfig(lane, fair_by="fairness_key").claim_order(None)
    return queue.claim(conn, lane, "w1", limit, 30, order=lane_order)


def empty_keys(conn: psycopg.Connection) -> list[tuple[str, int]]:
    return conn.execute("SELECT 'jobs', id FROM jobs WHERE fairness_key = ''"
                        " UNION ALL SELECT 'dead_letter', id FROM dead_letter"
                        " WHERE fairness_key = ''").fetchall()


def test_a_callers_own_insert_or_copy_of_an_empty_fairness_key_is_refused(
    conn: psycopg.Connection,
) -> None:
    # A fair claim lists the share keys after '', so a job stored with the key '' was never
    # claimed in a fair lane: it waited for ever. Every entry point refuses the key; the
    # table does too, for what is written into it by hand.
    refused = "violates check constraint \"jobs_fairness_key_not_empty\""
    with pytest.raises(psycopg.errors.CheckViolation, match=refused):
        conn.execute("INSERT INTO jobs (handler, fairness_key) VALUES ('h', '')")
    with pytest.raises(psycopg.errors.CheckViolation, match=refused), \
            conn.cursor().copy("COPY jobs (handler, fairness_key) FROM STDIN") as copy:
        copy.write_row(("h", "t1"))
        copy.write_row(("h", ""))
    kept = jobd.enqueue(conn, "h", fairness_key="t1")
    with pytest.raises(psycopg.errors.CheckViolation, match=refused):
        conn.execute("UPDATE jobs SET fairness_key = '' WHERE id = %s", (kept,))
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (1,)
    # A key of its own, or none, still goes in both ways; the insert trigger announces the
    # rows, and a fair claim takes them.
    with conn.cursor().copy("COPY jobs (handler, fairness_key) FROM STDIN") as copy:
        copy.write_row(("h", "t2"))
        copy.write_row(("h", None))
    conn.execute("INSERT INTO jobs (handler, fairness_key) VALUES ('h', 't3')")
    assert sorted(share_keys(fair_claim(conn, LANE))) == ["h", "t1", "t2", "t3"]


def test_jobs_stored_with_an_empty_fairness_key_before_0049_are_claimed_after_it(
    databases: Databases, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0049 gives the rows already stored with the key '' no key (they share by their
    handler): in a fair lane they are claimed, and no later write of them fails the new
    constraint. It does so whatever state they are in, and in the dead-letter queue."""
    url = databases.empty()
    before_0049 = [m for m in migrate_module.available() if m.version < 49]
    with connect(url, autocommit=True) as admin:
        monkeypatch.setattr(migrate_module, "available", lambda: before_0049)
        migrate_module.migrate(admin, "jobd")
        monkeypatch.undo()
        with connect(url, "jobd", autocommit=True) as conn:
            t0 = db_now(conn)
            insert = ("INSERT INTO jobs (lane, handler, priority, state, attempts, run_at,"
                      " fairness_key) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id")
            rows = [(LANE, "h", 0, "pending", 0, "t1"), (LANE, "h", 0, "pending", 0, ""),
                    (LANE, "h", 5, "pending", 0, ""), (LANE, "g", 0, "failed", 1, ""),
                    (LANE, "g", 0, "pending", 0, None), ("other", "h", 0, "pending", 0, ""),
                    ("busy", "h", 0, "pending", 0, "")]
            ids = [conn.execute(insert, (lane, handler, priority, state, attempts,
                                         t0 - timedelta(seconds=1), key)).fetchone()[0]
                   for lane, handler, priority, state, attempts, key in rows]
            # One of them running (claimed in a lane without fair_by, which takes it).
            (running,) = queue.claim(conn, "busy", "w1", 1, 30)
            dead = conn.execute(
                "INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at,"
                " attempts, created_at, errors, fairness_key)"
                " VALUES (nextval('job_id_seq'), %s, 'h', '{}', 0, %s, 3, %s, '[]', '')"
                " RETURNING id", (LANE, t0, t0)).fetchone()[0]
            with conn.transaction(force_rollback=True):
                # What 0049 ends: a fair claim takes every job but those of the key ''.
                assert sorted(job.id for job in fair_claim(conn, LANE)) == [ids[0], ids[4]]
            assert [m.version for m in migrate_module.migrate(admin, "jobd")] == [49]
            assert empty_keys(conn) == []
            # Every row complies now: the constraint, added NOT VALID, validates.
            conn.execute("ALTER TABLE jobs VALIDATE CONSTRAINT jobs_fairness_key_not_empty")
            taken = fair_claim(conn, LANE)
            assert sorted(job.id for job in taken) == sorted(ids[:5])
            assert sorted(share_keys(taken)) == ["g", "g", "h", "h", "t1"]
            assert [job.id for job in fair_claim(conn, "other")] == [ids[5]]
            failure = queue.Failure(running.lease, "boom", 0, 5)
            assert queue.fail(conn, [failure]).retried == [running.id]
            assert dlq.replay(conn, [dead]) == [dead]
            (replayed,) = fair_claim(conn, LANE)
            assert (replayed.id, replayed.fairness_key) == (dead, None)


def test_0049_at_a_repeatable_read_default_sees_the_jobs_committed_while_it_waited(
    databases: Databases, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0049 takes the key '' off the live jobs once it holds its lock on jobs: it must see
    every job committed before it got the lock. At a role's or database's default of
    REPEATABLE READ the migration's snapshot was its first statement's: a job committed
    while it waited for the lock kept the key '', and every claim that took it (in a lane
    without shares) then failed the new constraint, and with it the lane."""
    url = databases.empty()
    before_0049 = [m for m in migrate_module.available() if m.version < 49]
    with connect(url, autocommit=True) as admin, \
            connect(url, "jobd", autocommit=True) as conn:
        monkeypatch.setattr(migrate_module, "available", lambda: before_0049)
        migrate_module.migrate(admin, "jobd")
        monkeypatch.undo()
        admin.execute("SET default_transaction_isolation = 'repeatable read'")
        # The producer is closed first on the way out, so a failure cannot leave the
        # migration waiting for it.
        with ThreadPoolExecutor(1) as pool, \
                connect(url, "jobd", autocommit=False) as producer:
            producer.execute("INSERT INTO jobs (handler, fairness_key) VALUES ('h', '')")
            migrating = admin.info.backend_pid
            applying = pool.submit(migrate_module.migrate, admin, "jobd")
            # The producer's transaction holds the migration back from its lock on jobs.
            waiting = ("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted"
                       " AND relation = 'jobs'::regclass)")
            deadline = time.monotonic() + 30
            while not conn.execute(waiting, (migrating,)).fetchone()[0]:  # type: ignore[index]
                assert not applying.done(), applying.result()
                assert time.monotonic() < deadline, "the migration never waited for its lock"
                time.sleep(0.01)
            producer.commit()
            assert [m.version for m in applying.result(timeout=60)] == [49]
        assert empty_keys(conn) == []
        [job] = queue.claim(conn, LANE, "w1", 1, 30)
        assert (job.handler, job.fairness_key) == ("h", None)


def test_a_dead_job_stored_with_an_empty_fairness_key_is_replayed_sharing_by_its_handler(
    conn: psycopg.Connection,
) -> None:
    # A job dead-lettered with the key '' while 0049 was being applied (after its pass over
    # the dead-letter queue) is replayed without the key, as 0049 left the others.
    t0 = db_now(conn)
    dead = [conn.execute(
        "INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at, attempts,"
        " created_at, errors, fairness_key)"
        " VALUES (nextval('job_id_seq'), %s, %s, '{}', 0, %s, 3, %s, '[]', '')"
        " RETURNING id", (LANE, handler, t0, t0)).fetchone()[0] for handler in ("a", "b")]
    assert dlq.replay(conn, [dead[0]]) == [dead[0]]
    assert dlq.replay_handler(conn, "b") == [dead[1]]
    taken = fair_claim(conn, LANE)
    assert sorted((job.id, job.fairness_key) for job in taken) == [(dead[0], None),
                                                                   (dead[1], None)]


def test_fairness_comes_from_the_lane_config() -> None:
    lanes = parse("lanes:\n  a: {max_wait: 5m, fair_by: handler}\n"
                  "  b: {fair_by: fairness_key}\n  c: {}\n", "jobd.yaml").lanes
    assert (lanes["a"].max_wait, lanes["a"].fair_by, lanes["a"].ordered) == (300.0, "handler",
                                                                             True)
    assert (lanes["b"].max_wait, lanes["b"].ordered) == (None, True)
    assert (lanes["c"].max_wait, lanes["c"].fair_by, lanes["c"].ordered) == (None, "none",
                                                                             False)


@pytest.mark.parametrize(("text", "message"), [
    ("{fair_by: tenant}", "lanes.a.fair_by: must be one of handler, fairness_key, none"),
    ("{max_wait: 0s}", "lanes.a.max_wait: must be"),
    ("{max_wait: soon}", "lanes.a.max_wait:"),
])
def test_bad_fairness_settings_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(f"lanes:\n  a: {text}\n", "jobd.yaml")


def test_run_jobs_takes_a_fair_lanes_turns(conn: psycopg.Connection) -> None:
    """jobd.testing runs a fair lane's jobs one at a time, and the keys still take turns."""
    from jobd.testing import run_jobs

    t0 = db_now(conn)
    bulk(conn, 10, "herd", t0 - timedelta(minutes=1))
    bulk(conn, 2, "mail", t0)
    config = parse("handlers: {herd: 'jobd.examples:echo', mail: 'jobd.examples:echo'}\n"
                   "lanes:\n  default: {fair_by: handler}\n", "jobd.yaml")
    summary = run_jobs(conn, config=config, limit=4)
    handlers = [row[0] for row in conn.execute(
        "SELECT handler FROM jobs_archive ORDER BY claimed_at, id").fetchall()]
    assert summary.done == 4 and sorted(handlers) == ["herd", "herd", "mail", "mail"]
