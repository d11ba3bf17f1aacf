"""Steady under pressure (migrations/0009_steady_claims.sql): enqueues notify only while a
worker waits, arming cannot miss an enqueue that commits meanwhile, and claims from floors do
not walk the dead index entries a held xmin horizon keeps."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from notify_support import sent_so_far

import jobd
from jobd import claim_floors, prefetch, queue, recovery
from jobd.claim_floors import ClaimFloors, full_scan_params, look_back_params
from jobd.claimer import Claimer
from jobd.config import LaneConfig
from jobd.db import connect
from jobd.jobs import Job
from jobd.protocol import WorkerMode
from jobd.queries import query

LANE = "default"


@pytest.fixture
def listener(db_url: str) -> Iterator[psycopg.Connection]:
    with connect(db_url) as conn:
        conn.execute("LISTEN jobd_wakeup")
        yield conn


# --- wake-ups ------------------------------------------------------------------------------


def test_due_work_notifies_only_while_a_worker_is_armed(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    jobd.enqueue(conn, "h")
    assert sent_so_far(listener) == []

    assert len(queue.claim(conn, LANE, "w1", 10, 30)) == 1
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    jobd.enqueue(conn, "h")
    assert sent_so_far(listener) == [f"{LANE}#1"]

    queue.disarm(conn, "w1")
    jobd.enqueue(conn, "h")
    assert sent_so_far(listener) == []


def test_a_woken_worker_stays_armed_while_its_claims_come_back_short(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    # The claimer's decisions against the real tables: after a wake-up whose claim is short
    # the worker's row stays (no arming per job), enqueues still notify; after a full claim
    # the next claim removes it and the busy lane stops notifying.
    worker = Claimer(LaneConfig(LANE, concurrency=2, prefetch=0), "w1")
    worker.suspects_possible = False

    def claim() -> list[Job]:
        request = worker.request(WorkerMode.RUNNING, 0)
        assert request is not None
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        worker.took(claimed, request)
        taken = claimed.jobs
        for _ in taken:
            worker.next_to_start(WorkerMode.RUNNING, 0)  # started and done
        return taken

    def waiter_row() -> tuple[str, ...] | None:
        return conn.execute("SELECT xmin::text, armed_at::text FROM lane_waiters "
                            "WHERE worker_id = 'w1'").fetchone()

    assert claim() == []
    assert queue.arm(conn, LANE, "w1", worker.floors.params(0.0)) == "armed"
    worker.arm_result("armed", time.monotonic(), claim_floors.HEAD)
    armed = waiter_row()
    for _ in range(3):
        jobd.enqueue(conn, "h")
        assert sent_so_far(listener) == [f"{LANE}#1"]
        worker.maybe_more = True  # the wake-up
        assert len(claim()) == 1
        assert worker.arming.armed and not worker.wants_arm(WorkerMode.RUNNING, time.monotonic())
        assert waiter_row() == armed  # not written again

    jobd.enqueue_many(conn, [jobd.JobSpec("h") for _ in range(3)])
    assert sent_so_far(listener) == [f"{LANE}#3"]
    worker.maybe_more = True
    assert len(claim()) == 2  # full: the next claim disarms
    assert len(claim()) == 1
    assert waiter_row() is None and not worker.arming.armed
    jobd.enqueue(conn, "h")
    assert sent_so_far(listener) == []


def test_work_for_later_always_tells_the_supervisors(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    jobd.enqueue(conn, "h", delay=3600)
    [payload] = sent_so_far(listener)
    assert payload.startswith(f"{LANE}@")


def test_work_for_later_enqueued_beside_due_work_tells_the_supervisors_too(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    # One statement of due jobs and jobs for later (enqueue_many, a COPY, a caller's INSERT):
    # the due ones wake the workers, and the supervisors set a timer for the later ones; without
    # one they waited for the lane poll (poll_interval, 5 s by default) past their run_at.
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    now = row[0]
    jobd.enqueue_many(conn, [jobd.JobSpec("h"),
                             jobd.JobSpec("h", run_at=now + timedelta(hours=1)),
                             jobd.JobSpec("h", run_at=now + timedelta(minutes=1))])
    [later] = sent_so_far(listener)  # no worker is armed: the due job wakes nobody
    assert later.startswith(f"{LANE}@")
    due_at = conn.execute("SELECT extract(epoch FROM min(run_at)) FROM jobs WHERE run_at > now()"
                          ).fetchone()
    assert due_at is not None and float(later.split("@")[1]) == pytest.approx(float(due_at[0]))
    assert len(queue.claim(conn, LANE, "w1", 10, 30)) == 1
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    jobd.enqueue_many(conn, [jobd.JobSpec("h"),
                             jobd.JobSpec("h", run_at=now + timedelta(minutes=1))])
    woken, timer = sent_so_far(listener)
    assert (woken, timer.split("@")[0]) == (f"{LANE}#1", LANE)


def test_arming_with_due_work_visible_claims_instead_and_stays_armed(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    jobd.enqueue(conn, "h")
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "work"
    # Registered before the probe, the row stays (0024): the worker claims while armed, and
    # every enqueue meanwhile notifies.
    assert conn.execute("SELECT worker_id FROM lane_waiters").fetchall() == [("w1",)]
    jobd.enqueue(conn, "h")
    assert sent_so_far(listener) == [f"{LANE}#1"]


def test_the_one_transaction_arming_of_older_daemons_removes_the_row_on_work(
    conn: psycopg.Connection,
) -> None:
    # arm_waiter (daemons before 0020) answers as before: 'work' leaves the worker unarmed.
    jobd.enqueue(conn, "h")
    assert conn.execute(query("arm_waiter"), {"lane": LANE, "worker": "w1",
                                              **full_scan_params()}).fetchone() == ("work",)
    assert conn.execute("SELECT count(*) FROM lane_waiters").fetchone() == (0,)


def test_arming_while_an_enqueue_is_committing_is_contended(
    db_url: str, conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    with connect(db_url, autocommit=False) as producer:
        jobd.enqueue(producer, "h")  # inserted, holding the lane's shared lock, not committed
        assert queue.arm(conn, LANE, "w1", full_scan_params()) == "contended"
        producer.commit()
    # Committed before the arming looked: the arming sees the job instead of sleeping past it.
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "work"
    assert sent_so_far(listener) == []


def test_an_enqueue_that_starts_after_arming_notifies(
    db_url: str, conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    with connect(db_url, autocommit=False) as producer:
        jobd.enqueue(producer, "h")
        producer.commit()
    assert sent_so_far(listener) == [f"{LANE}#1"]


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_an_enqueue_outside_read_committed_always_notifies(
    db_url: str, listener: psycopg.Connection, isolation: str
) -> None:
    # Its snapshot may predate a worker's arming, so lane_waiters proves nothing to it.
    with connect(db_url, autocommit=False) as producer:
        producer.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        jobd.enqueue(producer, "h")
        producer.commit()
    assert sent_so_far(listener) == [f"{LANE}#1"]


def test_enqueue_announces_its_job_once_and_other_inserts_still_notify(
    db_url: str, conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    # jobd.enqueue notifies itself and the insert trigger lets its row by (migration 0021):
    # one notification, not two; an insert of another kind in the same transaction, after
    # it, is announced by the trigger as before.
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    with connect(db_url, autocommit=False) as producer:
        producer.execute("SELECT enqueue('h')")
        producer.execute("INSERT INTO jobs (id, lane, handler) VALUES (nextval('job_id_seq'),"
                         " %s, 'h'), (nextval('job_id_seq'), %s, 'h')", [LANE, LANE])
        producer.commit()
    assert sent_so_far(listener) == [f"{LANE}#1", f"{LANE}#2"]
    assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (3,)


def test_jobs_a_callers_trigger_inserts_during_an_enqueue_are_announced(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    # The trigger's WHEN lets enqueue's own insert by, not inserts nested inside it.
    conn.execute("""
        CREATE FUNCTION public.spawn_child() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO jobd.jobs (id, lane, handler)
                 VALUES (nextval('jobd.job_id_seq'), 'child', 'h');
            RETURN NULL;
        END $$""")
    conn.execute("CREATE TRIGGER spawn AFTER INSERT ON jobs FOR EACH ROW"
                 " WHEN (NEW.handler = 'parent') EXECUTE FUNCTION public.spawn_child()")
    for lane, worker_id in ((LANE, "w1"), ("child", "w2")):
        assert queue.arm(conn, lane, worker_id, full_scan_params()) == "armed"
    conn.execute("SELECT enqueue('parent')")
    assert sorted(sent_so_far(listener)) == ["child#1", f"{LANE}#1"]


def test_an_enqueue_due_long_ago_tells_the_workers_to_claim_from_the_head(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    conn.execute("SELECT enqueue('h', run_at => now() - interval '1 minute')")
    assert sent_so_far(listener) == [f"{LANE}#1", f"{LANE}!behind"]


def test_an_enqueue_into_a_lane_nobody_waits_on_sends_nothing_but_lists_its_priority(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    assert queue.arm(conn, "other", "w1", full_scan_params()) == "armed"
    conn.execute("SELECT enqueue('h', priority => 7)")
    assert sent_so_far(listener) == []
    assert conn.execute("SELECT lane, priority FROM lane_priorities").fetchall() == [(LANE, 7)]


def test_a_crashed_workers_waiter_row_is_removed_by_crash_attribution(
    conn: psycopg.Connection,
) -> None:
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    recovery.settle_crashed_worker(conn, "w1", "killed by SIGKILL", lambda _lane: None)
    assert conn.execute("SELECT count(*) FROM lane_waiters").fetchone() == (0,)


# --- lane priorities -----------------------------------------------------------------------


def test_enqueue_lists_the_lanes_priorities(conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h", priority=5)
    jobd.enqueue_many(conn, [jobd.JobSpec("h", lane="b", priority=p) for p in (1, 2, 2)])
    rows = conn.execute("SELECT lane, priority FROM lane_priorities ORDER BY 1, 2").fetchall()
    assert rows == [("b", 1), ("b", 2), (LANE, 5)]


def test_unused_priorities_are_forgotten_unless_an_enqueue_is_in_flight(
    db_url: str, conn: psycopg.Connection
) -> None:
    jobd.enqueue(conn, "h", priority=1)
    done = jobd.enqueue(conn, "h", priority=2)
    [job] = [j for j in queue.claim(conn, LANE, "w", 10, 30) if j.id == done]
    queue.complete(conn, [job.lease])

    with connect(db_url, autocommit=False) as producer:
        jobd.enqueue(producer, "h", priority=2)  # finds the pair present; not committed yet
        conn.execute("SELECT forget_unused_priorities(%s)", [LANE])
        producer.commit()
    rows = conn.execute("SELECT priority FROM lane_priorities ORDER BY 1").fetchall()
    assert rows == [(1,), (2,)]  # kept: the lane was skipped while the enqueue was in flight

    [job] = [j for j in queue.claim(conn, LANE, "w", 10, 30) if j.priority == 2]
    queue.complete(conn, [job.lease])
    assert conn.execute("SELECT forget_unused_priorities(%s)", [LANE]).fetchone() == (1,)
    assert conn.execute("SELECT priority FROM lane_priorities").fetchall() == [(1,)]


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_an_enqueue_whose_snapshot_predates_the_forgetting_of_its_priority_is_claimable(
    db_url: str, conn: psycopg.Connection, isolation: str
) -> None:
    # The producer's snapshot still shows the pair the retention duty forgot meanwhile: the
    # enqueue did not record it again, and every claim reads the lane's priorities there.
    done = jobd.enqueue(conn, "h", priority=2)
    [job] = queue.claim(conn, LANE, "w", 10, 30)
    queue.complete(conn, [job.lease])
    with connect(db_url, autocommit=False) as producer:
        producer.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        producer.execute("SELECT count(*) FROM lane_priorities")  # the snapshot is taken
        assert conn.execute("SELECT forget_unused_priorities(%s)", [LANE]).fetchone() == (1,)
        late = jobd.enqueue(producer, "h", priority=2)
        producer.commit()
    assert late != done
    assert [j.id for j in queue.claim(conn, LANE, "w", 10, 30)] == [late]


# --- claim floors --------------------------------------------------------------------------


def statistic(db_url: str, statement: str, params: tuple[object, ...] = ()) -> int:
    """One counter of the statistics views, as of now (no snapshot of the views is kept)."""
    with connect(db_url) as stats:
        stats.execute("SET stats_fetch_consistency = none")
        row = stats.execute(statement, params).fetchone()
    assert row is not None
    return int(row[0])


def index_entries_read(db_url: str, index: str = "jobs_claimable_idx") -> int:
    return statistic(db_url, "SELECT idx_tup_read FROM pg_stat_user_indexes "
                             "WHERE indexrelname = %s", (index,))


def flush_stats(conn: psycopg.Connection) -> None:
    # A backend sends its counters at most once a second unless told; the flush happens at
    # the end of the next transaction.
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")


def claim_counting_reads(db_url: str, conn: psycopg.Connection,
                         request: queue.ClaimRequest) -> tuple[list[jobd.Job], int]:
    flush_stats(conn)
    before = index_entries_read(db_url)
    claimed = queue.settle_and_claim(conn, [], [], request)[2].jobs
    flush_stats(conn)
    return claimed, index_entries_read(db_url) - before


def test_claims_from_floors_do_not_walk_what_a_held_horizon_keeps(
    db_url: str, conn: psycopg.Connection
) -> None:
    floors = ClaimFloors()
    with connect(db_url, autocommit=False) as holder:
        holder.execute("SELECT txid_current()")  # holds the xmin horizon, like an idle session
        # Due a minute ago: the history a look back (the last LOOK_BACK seconds) steps over.
        [[db_now]] = conn.execute("SELECT now()").fetchall()
        a_minute_ago = db_now - timedelta(seconds=60)
        jobd.enqueue_many(conn, [jobd.JobSpec("h", run_at=a_minute_ago) for _ in range(3000)])
        clock = 0.0
        while True:
            clock += 0.01
            request = queue.ClaimRequest(LANE, "w", 100, 30, floors=floors.params(clock))
            claimed = queue.settle_and_claim(conn, [], [], request)[2].jobs
            floors.claimed(request.floors or {}, [(j.priority, j.run_at, j.id) for j in claimed],
                           100, clock)
            queue.complete(conn, [job.lease for job in claimed])
            if len(claimed) < 100:
                break
        jobd.enqueue_many(conn, [jobd.JobSpec("h") for _ in range(10)])
        conn.execute("VACUUM jobs")  # removes nothing the holder may still see

        from_floors = queue.ClaimRequest(LANE, "w", 100, 30, floors=floors.params(clock))
        claimed, reads = claim_counting_reads(db_url, conn, from_floors)
        assert len(claimed) == 10
        assert reads < 100
        queue.release(conn, [job.lease for job in claimed])

        # What the claims do once a second while scans from the head are spaced out.
        looking_back = queue.ClaimRequest(LANE, "w", 100, 30, floors=look_back_params())
        claimed, reads = claim_counting_reads(db_url, conn, looking_back)
        assert len(claimed) == 10
        assert reads < 100
        queue.release(conn, [job.lease for job in claimed])

        from_head = queue.ClaimRequest(LANE, "w", 100, 30)
        claimed, reads = claim_counting_reads(db_url, conn, from_head)
        assert len(claimed) == 10
        assert reads > 3000  # every job claimed since the horizon was taken is still indexed
        holder.rollback()


def index_blocks_touched(db_url: str) -> int:
    """Index blocks of jobd.jobs read so far, buffer hits included. An index scan that checks
    a condition inside the index (a column after one without a bound) steps over entries
    without returning them, so idx_tup_read does not show that walk; the blocks do."""
    return statistic(db_url, "SELECT sum(idx_blks_hit + idx_blks_read) "
                             "FROM pg_statio_user_indexes "
                             "WHERE relname = 'jobs' AND indexrelname <> 'jobs_pkey'")


def test_the_arming_probe_walks_the_claim_index_from_the_floors_under_a_held_horizon(
    db_url: str, conn: psycopg.Connection
) -> None:
    floors = ClaimFloors()
    with connect(db_url, autocommit=False) as holder:
        holder.execute("SELECT txid_current()")
        for step in range(12):
            jobd.enqueue_many(conn, [jobd.JobSpec("h") for _ in range(500)])
            clock = step / 100
            request = queue.ClaimRequest(LANE, "w", 500, 30, floors=floors.params(clock))
            claimed = queue.settle_and_claim(conn, [], [], request)[2].jobs
            floors.claimed(request.floors or {},
                           [(j.priority, j.run_at, j.id) for j in claimed], 500, clock)
            queue.complete(conn, [job.lease for job in claimed])
            assert len(claimed) == 500
        # Statistics of that moment, as autoanalyze takes them: no live row, pages of dead
        # ones. The planner then rates jobs_fair_idx (the same predicate, the share key
        # before run_at) as cheap as the claim index, and there a floor bounds nothing: an
        # unordered probe walked all 6,000 dead entries (about 40 blocks).
        conn.execute("ANALYZE jobs")
        for attempt in range(6):  # past the five custom plans, to the cached generic one
            flush_stats(conn)
            before = index_blocks_touched(db_url)
            assert queue.arm(conn, LANE, "w1", floors.params(0.2 + attempt / 100)) == "armed"
            flush_stats(conn)
            touched = index_blocks_touched(db_url) - before
            assert touched < 10, f"probe {attempt + 1} read {touched} index blocks"
            queue.disarm(conn, "w1")
        holder.rollback()


def floors_past_one_job(conn: psycopg.Connection) -> ClaimFloors:
    """A worker's floors after it claimed (from the head) the one job of the lane."""
    floors = ClaimFloors()
    jobd.enqueue(conn, "h")
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(0.0))
    [first] = queue.settle_and_claim(conn, [], [], request)[2].jobs
    floors.claimed(request.floors or {}, [(first.priority, first.run_at, first.id)], 10, 0.0)
    return floors


def test_a_job_that_commits_below_a_floor_waits_for_the_next_scan_from_the_head(
    db_url: str, conn: psycopg.Connection
) -> None:
    floors = floors_past_one_job(conn)

    # An enqueue whose transaction began long before it committed: run_at is its start.
    [[db_now]] = conn.execute("SELECT now()").fetchall()
    straggler = jobd.enqueue(conn, "h", run_at=db_now - timedelta(seconds=30))
    soon = claim_floors.FULL_SCAN_INTERVAL / 2
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(soon))
    assert queue.settle_and_claim(conn, [], [], request)[2].jobs == []
    later = claim_floors.FULL_SCAN_INTERVAL + 0.01
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(later))
    assert [job.id for job in queue.settle_and_claim(conn, [], [], request)[2].jobs] == [straggler]


def test_a_job_whose_transaction_began_before_the_last_job_claimed_is_claimed_next(
    db_url: str, conn: psycopg.Connection
) -> None:
    # A request's transaction begins (run_at defaults to its start), then a trickle job is
    # enqueued and claimed beside it, then the request enqueues its job and commits. The
    # trickle claim came back short, so the next claim starts at its dry instant, not at the
    # job it took, which the request's job lies below; it did wait for the next scan from
    # the head, up to FULL_SCAN_INTERVAL (and a bulk enqueue beside a trickle drained on one
    # worker of several until then).
    with connect(db_url, autocommit=False) as request_tx:
        request_tx.execute("SELECT now()")
        floors = floors_past_one_job(conn)
        late = jobd.enqueue(request_tx, "h")
        request_tx.commit()
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(0.1))
    assert claim_floors.kind(request.floors) == claim_floors.FLOORS
    assert [job.id for job in queue.settle_and_claim(conn, [], [], request)[2].jobs] == [late]


def test_in_a_fair_lane_too_such_a_job_is_claimed_next(
    db_url: str, conn: psycopg.Connection
) -> None:
    # The same in a fair lane, whose claims also keep a position per share key.
    lane = LaneConfig(LANE, fair_by="handler")
    floors = ClaimFloors()
    with connect(db_url, autocommit=False) as request_tx:
        request_tx.execute("SELECT now()")
        jobd.enqueue(conn, "h")
        first_claim = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(0.0),
                                         order=lane.claim_order(None))
        [first] = queue.settle_and_claim(conn, [], [], first_claim)[2].jobs
        floors.claimed(first_claim.floors or {}, [(first.priority, first.run_at, first.id)],
                       10, 0.0, fair=True)
        floors.keys.claimed([(first.priority, "h", first.run_at, first.id)], 10)
        late = jobd.enqueue(request_tx, "h")
        request_tx.commit()
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(0.1),
                                 order=lane.claim_order("h"))
    assert claim_floors.kind(request.floors) == claim_floors.FLOORS
    assert [job.id for job in queue.settle_and_claim(conn, [], [], request)[2].jobs] == [late]


def test_a_fair_claim_after_an_idle_spell_steps_from_key_to_key_by_the_fair_index(
    db_url: str, conn: psycopg.Connection
) -> None:
    # Statistics taken while the table was empty, then a burst: the planner rated reading the
    # claim index and sorting by key as cheap as a descent of the fair index, and each step of
    # the key walk (due_keys) read every due job (migration 0027).
    conn.execute("ANALYZE jobs")
    jobd.enqueue_many(conn, [jobd.JobSpec("h", {}, LANE, fairness_key=f"tenant-{n % 10}")
                             for n in range(20_000)])
    request = queue.ClaimRequest(LANE, "w", 20, 30, floors=full_scan_params(),
                                 order=LaneConfig(LANE, fair_by="handler").claim_order(None))
    claimed, reads = claim_counting_reads(db_url, conn, request)
    assert len({job.fairness_key for job in claimed}) == 10
    assert reads < 1000  # some 200; each step of the walk read all 20,000 jobs: 220,000


def test_while_scans_from_the_head_are_spaced_out_a_look_back_finds_recent_stragglers(
    db_url: str, conn: psycopg.Connection
) -> None:
    floors = floors_past_one_job(conn)
    floors.head_scan_took(0.5)  # slow: the next scan from the head is a minute away

    # Enqueues whose transactions began 5 s and 30 s before they committed.
    [[db_now]] = conn.execute("SELECT now()").fetchall()
    recent = jobd.enqueue(conn, "h", run_at=db_now - timedelta(seconds=5))
    older = jobd.enqueue(conn, "h", run_at=db_now - timedelta(seconds=30))
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(0.1))  # looks back
    assert [job.id for job in queue.settle_and_claim(conn, [], [], request)[2].jobs] == [recent]
    request = queue.ClaimRequest(LANE, "w", 10, 30, floors=floors.params(0.2))  # its floors
    assert queue.settle_and_claim(conn, [], [], request)[2].jobs == []
    request = queue.ClaimRequest(LANE, "w", 10, 30,
                                 floors=floors.params(floors.next_full_scan_at()))
    assert [job.id for job in queue.settle_and_claim(conn, [], [], request)[2].jobs] == [older]


def test_the_arming_probe_uses_the_floors(db_url: str, conn: psycopg.Connection) -> None:
    floors = ClaimFloors()
    floors.claimed(full_scan_params(), [], 10, 0.0)  # dry at 0.0
    [[db_now]] = conn.execute("SELECT now()").fetchall()
    jobd.enqueue(conn, "h", run_at=db_now - timedelta(seconds=30))  # below the floor
    assert queue.arm(conn, LANE, "w1", floors.params(0.1)) == "armed"
    assert queue.arm(conn, LANE, "w2", full_scan_params()) == "work"


def test_enqueues_from_a_session_without_jobds_schema_on_its_path(
    db_url: str, conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    # A caller's own connection: the insert trigger must find jobd's tables by itself.
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    with psycopg.connect(db_url, autocommit=True) as plain:
        plain.execute("SET search_path = public")
        jobd.enqueue_many(plain, [jobd.JobSpec("h", priority=3) for _ in range(3)])
        jobd.enqueue(plain, "h", priority=4)
        plain.execute("SELECT jobd.enqueue('h', priority => 5)")
    assert sent_so_far(listener) == [f"{LANE}#3", f"{LANE}#1", f"{LANE}#1"]
    rows = conn.execute("SELECT priority FROM lane_priorities ORDER BY 1").fetchall()
    assert rows == [(3,), (4,), (5,)]


def test_jobs_due_for_a_while_tell_the_waiting_workers_to_claim_from_the_head(
    conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "armed"
    [[db_now]] = conn.execute("SELECT now()").fetchall()
    # A herd due in the past: below any floor a worker set when it last found the lane dry.
    jobd.enqueue(conn, "h", run_at=db_now - timedelta(minutes=1))
    assert sorted(sent_so_far(listener)) == [f"{LANE}!behind", f"{LANE}#1"]
    # Due as it commits: above every floor, nothing to say but the wake-up.
    jobd.enqueue(conn, "h")
    assert sent_so_far(listener) == [f"{LANE}#1"]
    # Nobody waiting: nobody to tell.
    queue.disarm(conn, "w1")
    jobd.enqueue(conn, "h", run_at=db_now - timedelta(minutes=1))
    assert sent_so_far(listener) == []


def test_an_enqueue_during_the_arming_probe_neither_waits_nor_goes_unheard(
    db_url: str, conn: psycopg.Connection, listener: psycopg.Connection
) -> None:
    # The probe holds no lock: an enqueue while its transaction is open is not queued behind
    # it (arm_waiter held the lane's exclusive lock until its commit), and it notifies,
    # since the registration committed first.
    assert conn.execute("SELECT arm_waiter_register(%s, 'w1')", (LANE,)).fetchone() == (
        "registered",)
    with connect(db_url, autocommit=False) as producer:
        producer.execute("SET lock_timeout = '2s'")  # waiting for the prober fails this
        with conn.transaction():
            row = conn.execute(
                "SELECT arm_waiter_probe(%s, 'w1', '{}', '{}', '{}', '{}', 1e9)",
                (LANE,)).fetchone()
            assert row == ("armed",)
            jobd.enqueue(producer, "h")
            producer.commit()
    assert sent_so_far(listener) == [f"{LANE}#1"]
    assert queue.arm(conn, LANE, "w1", full_scan_params()) == "work"
    assert conn.execute("SELECT count(*) FROM lane_waiters").fetchone() == (1,)  # still armed


def entries_read_by(db_url: str, conn: psycopg.Connection, index: str, statement: str,
                    params: dict[str, object]) -> tuple[list[tuple[object, ...]], int]:
    """The rows of one of jobd's named statements and the entries it read of ``index``."""
    flush_stats(conn)
    before = index_entries_read(db_url, index)
    rows = conn.execute(query(statement), params).fetchall()
    flush_stats(conn)
    return rows, index_entries_read(db_url, index) - before


def test_the_supervisors_poll_and_sweep_look_back_past_what_a_held_horizon_keeps(
    db_url: str, conn: psycopg.Connection
) -> None:
    [[db_now]] = conn.execute("SELECT now()").fetchall()
    then = db_now - timedelta(minutes=5)
    with connect(db_url, autocommit=False) as holder:
        holder.execute("SELECT txid_current()")  # holds the xmin horizon
        # 3,000 jobs due, claimed (leases ran out 4.5 minutes ago) and done: dead entries
        # in the claim index and in the lease index that nothing can remove.
        jobd.enqueue_many(conn, [jobd.JobSpec("h", run_at=then) for _ in range(3000)])
        done = queue.claim(conn, LANE, "w", 3000, 30, now=then)
        assert len(done) == 3000
        queue.complete(conn, [job.lease for job in done])
        conn.execute("VACUUM jobs")  # removes nothing the holder may still see

        due_now = jobd.enqueue(conn, "h")
        due_long_ago = jobd.enqueue(conn, "h", run_at=db_now - timedelta(minutes=2))
        only_old = jobd.enqueue(conn, "h", lane="quiet", run_at=db_now - timedelta(minutes=2))
        run_at = dict(conn.execute("SELECT id, extract(epoch FROM run_at)::float8 FROM jobs "
                                   "WHERE id = ANY(%s)", [[due_now, due_long_ago, only_old]]))

        def poll(look_back: float | None) -> tuple[dict[object, object], int]:
            rows, reads = entries_read_by(
                db_url, conn, "jobs_claimable_idx", "lane_heads",
                {"lanes": [LANE, "quiet"], "now": None, "look_back": look_back})
            return {row[0]: row[1] for row in rows}, reads

        heads, reads = poll(claim_floors.LOOK_BACK)
        assert reads < 100
        # The lane is due either way; a job due only before the look back waits for the next
        # poll from the head.
        assert heads == {LANE: run_at[due_now], "quiet": None}
        heads, reads = poll(None)
        assert reads > 3000
        assert heads == {LANE: run_at[due_long_ago], "quiet": run_at[only_old]}

        # Leases that ran out 5 s and 70 s ago.
        [recent] = queue.claim(conn, LANE, "w", 1, 30, now=db_now - timedelta(seconds=35))
        [old] = queue.claim(conn, "quiet", "w", 1, 30, now=db_now - timedelta(seconds=100))

        def expired(look_back: float | None) -> tuple[list[object], int]:
            rows, reads = entries_read_by(db_url, conn, "jobs_lease_idx", "expired_leases",
                                          recovery.expired_leases_params(look_back=look_back))
            return [row[0] for row in rows], reads

        ids, reads = expired(claim_floors.LOOK_BACK)
        assert (ids, reads < 100) == ([recent.id], True)
        ids, reads = expired(None)
        assert ids == [old.id, recent.id]
        assert reads > 3000
        holder.rollback()


# --- large payloads ----------------------------------------------------------------------------


def test_a_worker_claims_less_ahead_once_its_claims_bring_large_payloads(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The claimer feeds what its claims brought to jobd.prefetch: a budget of 40 KB ahead
    # stands for BYTES_AHEAD, payloads of 10 KB for ones of megabytes.
    monkeypatch.setattr(prefetch, "BYTES_AHEAD", 40_000)
    worker = Claimer(LaneConfig(LANE, concurrency=4), "w1")
    worker.suspects_possible = False
    jobd.enqueue_many(conn, [jobd.JobSpec("h", payload="x" * 10_000) for _ in range(40)])

    def claim() -> int:
        request = worker.request(WorkerMode.RUNNING, 0)
        assert request is not None
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        worker.took(claimed, request)
        while worker.next_to_start(WorkerMode.RUNNING, 0) is not None:
            pass  # started and done
        return len(claimed.jobs)

    assert claim() == 4 + 12  # the slots and the floor: nothing known of the payloads yet
    assert claim() == 4 + 4  # the slots and one refill of them: 40 KB ahead at most


def incompressible(size: int) -> str:
    """Text that neither TOAST's compression nor jsonb shrinks: its stored size is its own."""
    return secrets.token_urlsafe(size)[:size]


def stored_sizes(conn: psycopg.Connection) -> list[int]:
    """Each live job's payload as stored, in claim order (priority, then age)."""
    return [size for (size,) in conn.execute(
        "SELECT pg_column_size(payload) FROM jobs WHERE state = 'pending' "
        "ORDER BY priority DESC, run_at, id")]


def test_a_claim_over_its_byte_bound_takes_the_first_jobs_in_claim_order(
    conn: psycopg.Connection,
) -> None:
    jobd.enqueue_many(conn, [jobd.JobSpec("h", payload=incompressible(10_000), priority=p)
                             for p in (0, 0, 0, 5, 5, 5)])
    sizes = stored_sizes(conn)
    ids = [job_id for (job_id,) in conn.execute(
        "SELECT id FROM jobs ORDER BY priority DESC, run_at, id")]
    assert min(sizes) > 10_000  # none compressed

    def claim(payload_bytes: int | None, least: int) -> queue.Claimed:
        request = queue.ClaimRequest(LANE, "w", 6, 30, payload_bytes=payload_bytes,
                                     least=least)
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        conn.execute("UPDATE jobs SET state = 'pending', attempts = 0, claimed_by = NULL, "
                     "claimed_at = NULL, lease_until = NULL, lease_token = NULL")
        return claimed

    # While the payload before a job is under the bound: the first three, the priority 5
    # ones, whose payload before them is 0, one job and two.
    bounded = claim(sizes[0] + sizes[1] + 1, least=1)
    assert ([job.id for job in bounded.jobs], bounded.bounded) == (ids[:3], True)
    # Never fewer than `least`.
    assert sorted(job.id for job in claim(1, least=4).jobs) == sorted(ids[:4])
    # A bound the claim stays under, or none: all of them, not bounded.
    for payload_bytes in (sum(sizes), None):
        unbounded = claim(payload_bytes, least=1)
        assert (len(unbounded.jobs), unbounded.bounded) == (6, False)


def large_payload_worker(conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch,
                         lane: LaneConfig, jobs: int) -> Claimer:
    """A worker of ``lane`` whose byte bound is 30 KB (standing for STORED_BYTES_AHEAD), and
    ``jobs`` jobs of 10 KB payloads (standing for ones of megabytes) in its lane."""
    monkeypatch.setattr(prefetch, "STORED_BYTES_AHEAD", 30_000)
    worker = Claimer(lane, "w1")
    worker.suspects_possible = False
    jobd.enqueue_many(conn, [jobd.JobSpec("h", payload=incompressible(10_000))
                             for _ in range(jobs)])
    return worker


def test_a_workers_first_claim_of_large_payloads_holds_no_more_than_the_bound_ahead(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing is learned of the payloads before the first claim: the database bounds it.
    worker = large_payload_worker(conn, monkeypatch, LaneConfig(LANE, concurrency=4), 16)
    claims: list[int] = []
    for _ in range(16):
        # Every slot is busy after the first claim: what follows is claimed ahead.
        request = worker.request(WorkerMode.RUNNING, 4 if claims else 0)
        if request is None:
            break  # a claim came back short and not bounded: the lane is dry
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        worker.took(claimed, request)
        claims.append(len(claimed.jobs))
        while worker.next_to_start(WorkerMode.RUNNING, 0) is not None:
            pass  # started and done
    # The slots' 4 at once (over the bound), then 3 at a time ahead, the payload before
    # the third under 30 KB: never the 16 that the floor asked for. Each short claim but
    # the last was bounded, not dry: the worker claimed on, from where the last one ended.
    assert claims == [4, 3, 3, 3, 3]
    assert conn.execute("SELECT count(*) FROM jobs WHERE state = 'claimed' AND attempts = 1"
                        ).fetchone() == (16,)


def test_a_rate_limited_lanes_first_claim_of_large_payloads_is_bounded_too(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lane with a rate and no max_running claims ahead as a plain lane does (its buffer
    # adapts), so its claim (claim_jobs_limited) carries the byte bound too.
    worker = large_payload_worker(conn, monkeypatch,
                                  LaneConfig(LANE, concurrency=4, rate_limit=1000), 16)
    request = worker.request(WorkerMode.RUNNING, 4)  # the slots busy: all of it ahead
    assert request is not None and request.limit == 12
    claimed = queue.settle_and_claim(conn, [], [], request)[2]
    worker.took(claimed, request)
    # The payload before the third is under 30 KB; the bucket spent a token a job taken.
    assert (len(claimed.jobs), claimed.bounded, worker.maybe_more) == (3, True, True)
    assert conn.execute("SELECT count(*) FROM jobs WHERE state = 'claimed'").fetchone() == (3,)
    assert conn.execute("SELECT tokens FROM lane_tokens WHERE lane = %s", (LANE,)
                        ).fetchone() == (997.0,)


def test_a_worker_asks_its_claims_for_about_what_the_byte_bound_lets_them_take(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rows a claim locks beyond the bound go back pending, stepped over meanwhile by the
    # other workers' claims: once a bounded claim told the size, a claim asks for one more
    # than the bound lets it take (so that it meets the bound and learns the size anew), not
    # for the refill of the slots that the buffer is never smaller than.
    worker = large_payload_worker(conn, monkeypatch, LaneConfig(LANE, concurrency=20), 40)
    asked, took = [], []
    for _ in range(4):
        request = worker.request(WorkerMode.RUNNING, 20 if asked else 0)
        assert request is not None
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        worker.took(claimed, request)
        asked.append(request.limit)
        took.append(len(claimed.jobs))
        while worker.next_to_start(WorkerMode.RUNNING, 0) is not None:
            pass  # started and done
    # The slots' 20 at once, over the bound, then 3 at a time ahead. The first claim ahead
    # knows only that 20 held the bound; from the second on it asks for 3 + 1.
    assert took == [20, 3, 3, 3]
    assert asked == [80, 20, 4, 4]


# --- the last attempts ----------------------------------------------------------------------


def test_a_claim_takes_jobs_on_their_last_attempt_only_among_those_that_start_at_once(
    conn: psycopg.Connection,
) -> None:
    # A whole node's death spends an attempt on every job it held, started or not; a job
    # held ahead of a free slot on its last attempt would reach the dead-letter queue unrun.
    ids = [jobd.enqueue(conn, "h", max_attempts=1 if n == 2 else None) for n in range(6)]
    # A retry on its last attempt by the lane's max_attempts (3): the fourth job, once failed
    # twice, is one too.
    conn.execute("UPDATE jobs SET state = 'failed', attempts = 2 WHERE id = %s", (ids[4],))

    def claim(starting: int | None, limited: bool = False,
              order: dict[str, Any] | None = None) -> queue.Claimed:
        request = queue.ClaimRequest(
            LANE, "w", 6, 30, payload_bytes=None if order else 10**9, starting=starting,
            lane_max_attempts=3, order=order,
            budget={"max_running": None, "rate_limit": 1000, "rate_per": 1.0} if limited
            else None)
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        conn.execute("UPDATE jobs SET state = 'pending', attempts = 0, claimed_by = NULL, "
                     "claimed_at = NULL, lease_until = NULL, lease_token = NULL")
        conn.execute("UPDATE jobs SET state = 'failed', attempts = 2 WHERE id = %s", (ids[4],))
        return claimed

    def taken(claimed: queue.Claimed) -> tuple[list[int], bool, bool]:
        return [job.id for job in claimed.jobs], claimed.bounded, claimed.bytes_bounded

    for limited in (False, True):  # claim_jobs, claim_jobs_limited
        # The claim ends before the first last attempt past the jobs that start at once: cut
        # short, not dry, and not by the byte bound (the worker learns no size from it).
        assert taken(claim(0, limited)) == (ids[:2], True, False)
        assert taken(claim(2, limited)) == (ids[:2], True, False)
        assert taken(claim(3, limited)) == (ids[:4], True, False)
        # Both start at once, first: the claim's jobs come in claim order.
        assert taken(claim(5, limited)) == (ids, False, False)
        # Without a count of starting jobs (a caller of queue.claim that starts what it
        # takes), nothing is cut.
        everything = claim(None, limited)
        assert (sorted(job.id for job in everything.jobs), everything.bounded) == (ids, False)
    # A fair or age-promoting lane's claim (claim_jobs_ordered) cuts as claim_jobs does, in
    # its own claim order: here one share key, so oldest first.
    for fair_by, max_wait in (("handler", None), ("none", 60.0), ("handler", 60.0)):
        ordered = LaneConfig(LANE, fair_by=fair_by, max_wait=max_wait).claim_order(None)
        assert taken(claim(0, order=ordered)) == (ids[:2], True, False)
        assert taken(claim(3, order=ordered)) == (ids[:4], True, False)
        assert taken(claim(5, order=ordered)) == (ids, False, False)
        everything = claim(None, order=ordered)
        assert ([job.id for job in everything.jobs], everything.bounded) == (ids, False)


def test_a_fair_claims_jobs_come_in_its_claim_order_and_its_cut_follows_it(
    conn: psycopg.Connection,
) -> None:
    """A fair claim takes each share key's share in turn, then splits what is left: its
    jobs start in that order, not by id, and the last attempts' cut counts in it."""
    a1, a2, a3 = (jobd.enqueue(conn, "a") for _ in range(3))
    last_b = jobd.enqueue(conn, "b", max_attempts=1)
    b2 = jobd.enqueue(conn, "b")
    last_c = jobd.enqueue(conn, "c", max_attempts=1)
    ordered = LaneConfig(LANE, fair_by="handler").claim_order(None)

    def claim(starting: int) -> queue.Claimed:
        request = queue.ClaimRequest(LANE, "w", 6, 30, order=ordered, starting=starting,
                                     lane_max_attempts=3)
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        queue.release(conn, [job.lease for job in claimed.jobs])
        return claimed

    # Shares of two for a, b and c, then a's third job with the room c left.
    everything = claim(6)
    assert ([job.id for job in everything.jobs], everything.bounded) == (
        [a1, a2, last_b, b2, last_c, a3], False)
    # b's last attempt is third, among the three that start at once; c's is fifth: cut.
    cut = claim(3)
    assert ([job.id for job in cut.jobs], cut.bounded) == ([a1, a2, last_b, b2], True)


def test_a_worker_whose_claim_ahead_meets_a_last_attempt_claims_it_once_a_slot_frees(
    conn: psycopg.Connection,
) -> None:
    last = jobd.enqueue(conn, "h", max_attempts=1)
    later = [jobd.enqueue(conn, "h") for _ in range(3)]
    worker = Claimer(LaneConfig(LANE, concurrency=2, max_attempts=3), "w1")
    worker.suspects_possible = False
    request = worker.request(WorkerMode.RUNNING, 2)  # both slots busy: all of it ahead
    assert request is not None and request.starting == 0
    claimed = queue.settle_and_claim(conn, [], [], request)[2]
    worker.took(claimed, request)
    # Nothing taken, and not dry: the worker neither arms nor claims again while the slots
    # stay full, and its floors still see the job.
    assert (claimed.jobs, worker.maybe_more) == ([], True)
    assert worker.request(WorkerMode.RUNNING, 2) is None
    request = worker.request(WorkerMode.RUNNING, 1)
    assert request is not None and request.starting == 1
    claimed = queue.settle_and_claim(conn, [], [], request)[2]
    worker.took(claimed, request)
    assert [job.id for job in claimed.jobs] == [last, *later]
    assert worker.next_to_start(WorkerMode.RUNNING, 1) is not None  # it starts at once


@pytest.mark.parametrize("limited", [False, True])
def test_a_claim_the_last_attempts_cut_before_the_byte_bound_teaches_no_payload_size(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch, limited: bool
) -> None:
    # 30 KB stands for STORED_BYTES_AHEAD: the byte bound alone would end a claim of these
    # 10 KB payloads after its third job. A last attempt second in line ends it after the
    # first, which holds a third of the bound: learnt as the bound, it would have the
    # worker ask its next claims for a third of what the bound lets through.
    monkeypatch.setattr(prefetch, "STORED_BYTES_AHEAD", 30_000)
    worker = Claimer(LaneConfig(LANE, concurrency=4, max_attempts=3,
                                rate_limit=1000 if limited else None), "w1")
    worker.suspects_possible = False
    ids = [jobd.enqueue(conn, "h", incompressible(10_000), max_attempts=1 if n == 1 else None)
           for n in range(16)]
    asked, took, learnt_from_the_bound = [], [], []
    for _ in range(2):
        request = worker.request(WorkerMode.RUNNING, 3)  # one slot free
        assert request is not None and request.starting == 1
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        worker.took(claimed, request)
        asked.append(request.limit)
        took.append([job.id for job in claimed.jobs])
        learnt_from_the_bound.append(claimed.bytes_bounded)
        assert worker.next_to_start(WorkerMode.RUNNING, 3) is not None  # into the free slot
        worker.buffer.clear()  # the rest started, and the slot is free again
    assert took == [ids[:1], ids[1:4]]
    assert learnt_from_the_bound == [False, True]
    assert asked == [13, 13]


def test_a_claim_the_byte_bound_ends_first_still_tells_the_size_with_a_last_attempt_locked(
    conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The byte bound ends the claim after the third job; a last attempt fourth or later
    # (past the one job that starts at once) is cut too, but the three taken hold the bound.
    monkeypatch.setattr(prefetch, "STORED_BYTES_AHEAD", 30_000)
    for last_at in (3, 4):
        conn.execute("DELETE FROM jobs")
        ids = [jobd.enqueue(conn, "h", incompressible(10_000),
                            max_attempts=1 if n == last_at else None) for n in range(8)]
        request = queue.ClaimRequest(LANE, "w", 8, 30, payload_bytes=30_000, least=1,
                                     starting=1, lane_max_attempts=3)
        claimed = queue.settle_and_claim(conn, [], [], request)[2]
        assert ([job.id for job in claimed.jobs], claimed.bounded,
                claimed.bytes_bounded) == (ids[:3], True, True)


# --- the order of a claim's jobs -----------------------------------------------------------------


def test_a_claims_jobs_start_highest_priority_first_whatever_their_ids(
    conn: psycopg.Connection,
) -> None:
    # The UPDATE returns the rows in the order it finds them by id; the buffer starts them
    # in that order. A low-priority job enqueued before higher ones must not start first.
    older = jobd.enqueue(conn, "h", priority=0)
    newer = [jobd.enqueue(conn, "h", priority=5) for _ in range(3)]
    worker = Claimer(LaneConfig(LANE, concurrency=1), "w1")
    worker.suspects_possible = False
    request = worker.request(WorkerMode.RUNNING, 0)
    assert request is not None and request.limit == 4
    worker.took(queue.settle_and_claim(conn, [], [], request)[2], request)
    started = []
    while (entry := worker.next_to_start(WorkerMode.RUNNING, 0)) is not None:
        started.append(entry[0].id)
    assert started == [*newer, older]
