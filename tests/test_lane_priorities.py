"""The first enqueue of a (lane, priority) pair lists it in lane_priorities, and another
producer of that pair never waits for it (migration 0046).

Before 0046 the listing was an INSERT ... ON CONFLICT DO NOTHING, and a second producer of a
pair that a still-open transaction had listed waited for that transaction's end: a slow web
request or a backfill that enqueued first stalled every producer of the pair. Each test has
a first producer hold such an enqueue open and a second one enqueue under a lock timeout, so
a wait is an error, not a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest

import jobd
from jobd import queue
from jobd.config import Config, LaneConfig
from jobd.db import connect
from jobd.duties.lane_poll import LanePoll
from jobd.wake_routing import WakeRouter

LANE = "fresh"
LEVEL = 3
NOW = 1000.0  # the lane poll's injected monotonic clock
WAIT_LIMIT = "3s"  # far above a lock the enqueue takes and gives back at once

Enqueue = Callable[[psycopg.Connection], int]


def by_sql(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT jobd.enqueue('h', lane => %s, priority => %s)",
                       (LANE, LEVEL)).fetchone()
    assert row is not None
    return int(row[0])


def by_python(conn: psycopg.Connection) -> int:
    return jobd.enqueue(conn, "h", lane=LANE, priority=LEVEL)


def by_enqueue_many(conn: psycopg.Connection) -> int:
    [job_id] = jobd.enqueue_many(conn, [jobd.JobSpec("h", lane=LANE, priority=LEVEL)])
    return job_id


def by_insert(conn: psycopg.Connection) -> int:
    # A caller's own INSERT, announced (and its pair listed) by the insert trigger.
    row = conn.execute("INSERT INTO jobd.jobs (lane, handler, priority) VALUES (%s, 'h', %s) "
                       "RETURNING id", (LANE, LEVEL)).fetchone()
    assert row is not None
    return int(row[0])


ENTRY_POINTS: dict[str, Enqueue] = {
    "sql": by_sql, "python": by_python, "enqueue_many": by_enqueue_many, "insert": by_insert,
}
PAIRS = [pytest.param(ENTRY_POINTS[first], ENTRY_POINTS[second], id=f"{first}-then-{second}")
         for first in ENTRY_POINTS for second in ENTRY_POINTS]


@pytest.fixture
def first(db_url: str) -> Iterator[psycopg.Connection]:
    """The producer whose transaction stays open after its enqueue."""
    with connect(db_url, autocommit=False) as producer:
        yield producer


@pytest.fixture
def second(db_url: str) -> Iterator[psycopg.Connection]:
    """Another producer, committing each enqueue; a lock it would wait for is an error."""
    with connect(db_url, autocommit=True) as producer:
        producer.execute(f"SET lock_timeout = '{WAIT_LIMIT}'")
        yield producer


def claimed(conn: psycopg.Connection) -> list[int]:
    return sorted(job.id for job in queue.claim(conn, LANE, "w", 10, 30))


def wanted(conn: psycopg.Connection) -> list[tuple[str, int]]:
    return conn.execute("SELECT lane, priority FROM lane_priorities_wanted").fetchall()


def listed(conn: psycopg.Connection) -> list[tuple[str, int]]:
    return conn.execute("SELECT lane, priority FROM lane_priorities WHERE lane = %s",
                        (LANE,)).fetchall()


def merge(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT merge_wanted_priorities()").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(("enqueue_first", "enqueue_second"), PAIRS)
def test_a_producer_does_not_wait_for_an_open_transaction_listing_the_same_priority(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
    enqueue_first: Enqueue, enqueue_second: Enqueue,
) -> None:
    held = enqueue_first(first)  # lists the pair; its transaction stays open
    late = enqueue_second(second)  # before 0046: LockNotAvailable after WAIT_LIMIT
    first.commit()
    assert claimed(conn) == sorted([held, late])  # no merge needed: the pair is listed


@pytest.mark.parametrize(("enqueue_first", "enqueue_second"), PAIRS)
def test_a_job_whose_pair_was_being_listed_by_a_transaction_that_rolled_back_is_claimed(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
    enqueue_first: Enqueue, enqueue_second: Enqueue,
) -> None:
    enqueue_first(first)
    late = enqueue_second(second)
    first.rollback()
    # Not listed, but not lost: the pair is wanted, and the merge lists it.
    assert listed(conn) == []
    assert wanted(conn) == [(LANE, LEVEL)]
    assert merge(conn) == 1
    assert wanted(conn) == [] and listed(conn) == [(LANE, LEVEL)]
    assert claimed(conn) == [late]


def test_while_a_listing_stays_open_its_pair_is_wanted_once(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
) -> None:
    # A backfill holding its transaction open for minutes while requests enqueue into the
    # pair: one wanted row covers every later job, not one row each.
    by_sql(first)
    late = [enqueue(second) for enqueue in ENTRY_POINTS.values() for _ in range(2)]
    assert wanted(conn) == [(LANE, LEVEL)]
    first.rollback()
    assert merge(conn) == 1
    assert claimed(conn) == sorted(late)


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_a_producer_outside_read_committed_does_not_wait_either(
    db_url: str, conn: psycopg.Connection, first: psycopg.Connection, isolation: str,
) -> None:
    # Outside READ COMMITTED an enqueue lists its pair whatever its snapshot says (0038).
    by_python(first)
    with connect(db_url, autocommit=False) as late_producer:
        late_producer.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        late_producer.execute(f"SET LOCAL lock_timeout = '{WAIT_LIMIT}'")
        late = by_python(late_producer)
        late_insert = by_insert(late_producer)
        late_producer.commit()
    first.rollback()
    assert merge(conn) == 1
    assert claimed(conn) == sorted([late, late_insert])  # not the rolled back one


def test_the_lane_poll_merges_wanted_pairs_and_wakes_their_lane(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
) -> None:
    by_sql(first)
    late = by_enqueue_many(second)
    first.rollback()
    router = WakeRouter()
    poll = LanePoll(lambda: Config(lanes={LANE: LaneConfig(LANE)}), router)
    poll.run(conn, NOW)
    assert dict(router._now) == {LANE: None}  # due work found in the merged pair
    assert wanted(conn) == []
    assert claimed(conn) == [late]


def test_the_merge_leaves_a_pair_whose_listing_is_still_in_flight(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
) -> None:
    conn.execute(f"SET lock_timeout = '{WAIT_LIMIT}'")  # the merge must not wait either
    held = by_insert(first)
    late = by_python(second)
    # The open transaction holds the pair: the merge neither waits for it nor drops the
    # wanted row, which keeps the late job claimable should that transaction roll back.
    assert merge(conn) == 0
    assert wanted(conn) == [(LANE, LEVEL)]
    first.commit()
    assert merge(conn) == 1
    assert wanted(conn) == [] and listed(conn) == [(LANE, LEVEL)]
    assert claimed(conn) == sorted([held, late])


def test_the_retention_duty_keeps_a_pair_while_it_is_wanted(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
) -> None:
    by_sql(first)
    by_insert(second)
    first.commit()
    # Every job of the pair done: the pair is unused, but still wanted until the merge.
    jobs = queue.claim(conn, LANE, "w", 10, 30)
    assert len(jobs) == 2
    queue.complete(conn, [job.lease for job in jobs])
    assert conn.execute("SELECT forget_unused_priorities(%s)", (LANE,)).fetchone() == (0,)
    assert listed(conn) == [(LANE, LEVEL)]
    assert merge(conn) == 1
    assert conn.execute("SELECT forget_unused_priorities(%s)", (LANE,)).fetchone() == (1,)
    assert listed(conn) == []


def test_a_known_pair_takes_no_pair_lock_and_wants_nothing(
    conn: psycopg.Connection, first: psycopg.Connection, second: psycopg.Connection,
) -> None:
    # The common path: the pair is listed, and nothing beyond the lane's shared lock is taken.
    by_sql(conn)
    by_python(first)
    by_insert(first)
    advisory = first.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        " AND mode = 'ExclusiveLock'").fetchone()
    assert advisory == (0,)
    by_enqueue_many(second)
    first.commit()
    assert wanted(conn) == []
