"""The worker loop's steps, driven in-process against a real PostgreSQL: how it survives failed
statements, lost connections and error texts PostgreSQL cannot store; runs that overrun their
timeout or lose their lease; and the pieces without a database (when the loop wakes, what a
signal does to its mode)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import psycopg
import pytest
from daemon_support import wait_until
from worker_support import connected_worker

import jobd
from jobd import outcomes, protocol, queue, slots, worker
from jobd.backoff import Backoff
from jobd.claim_buffer import BUFFER_MAX_AGE
from jobd.claim_floors import (
    FULL_SCAN_INTERVAL,
    HEAD_SCAN_SHARE,
    MAX_FULL_SCAN_INTERVAL,
    full_scan_params,
    kind,
)
from jobd.completer import SETTLE_DELAY, Completer, Counters
from jobd.config import LaneConfig
from jobd.protocol import WorkerMode
from jobd.run_board import RunBoard
from jobd.worker_mode import Lifecycle
from jobd.worker_status import REPORT_INTERVAL, StatusReporter
from jobd.worker_timers import select_timeout

LANE = "default"
WORKER_ID = "test-node:default#0:cafe"
WAIT_S = 10.0  # a bound for what happens at once, never a pause
T = TypeVar("T")


@pytest.fixture
def loop(db_url: str) -> Iterator[worker.Worker]:
    with connected_worker(db_url, LaneConfig(LANE), WORKER_ID) as (subject, _wake):
        yield subject


@pytest.fixture
def one_slot_with_timeout(db_url: str) -> Iterator[worker.Worker]:
    lane = LaneConfig(LANE, concurrency=1, timeout=5.0)
    with connected_worker(db_url, lane, WORKER_ID) as (subject, _wake):
        yield subject


def state_of(conn: psycopg.Connection, job_id: int) -> tuple[str, int, str | None]:
    row = conn.execute("SELECT state, attempts, last_error FROM all_jobs WHERE id = %s",
                       (job_id,)).fetchone()
    assert row is not None
    return row


def test_an_error_text_with_a_nul_byte_is_stored_escaped(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h")
    jobd.enqueue(conn, "h")
    good, bad = queue.claim(conn, LANE, WORKER_ID, 2, 30.0)
    try:
        raise ValueError("cannot parse b'\x00\x01'")
    except ValueError as exc:
        error = outcomes.format_error(exc)
    loop.completer.pending = [outcomes.Outcome(good, None),
                              outcomes.Outcome(bad, error)]
    loop._settle_and_claim(claim=False)
    assert loop.completer.pending == []
    assert state_of(conn, good.id)[0] == "done"
    state, _, last_error = state_of(conn, bad.id)
    assert state == "failed"
    assert last_error is not None and "cannot parse b'\\x00\\x01'" in last_error


def test_a_statement_error_that_closed_the_connection_counts_as_a_lost_connection(
        loop: worker.Worker) -> None:
    def breaks(conn: psycopg.Connection) -> None:
        conn.close()
        raise psycopg.DataError("refused")

    assert loop.link.run("queue", breaks) is None
    assert loop.conn is None and loop.claims_unknown
    loop._ensure_connection()
    assert loop.conn is not None and not loop.conn.closed


def test_a_failed_statement_on_a_healthy_connection_keeps_it(loop: worker.Worker) -> None:
    conn = loop.conn
    assert loop.link.run("queue", lambda c: c.execute("SELECT 1/0")) is None
    assert loop.conn is conn and not conn.closed and not loop.claims_unknown


def test_after_a_lost_connection_claims_it_never_received_go_back_with_their_attempt_unspent(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    """None of them started: a network blip during a claim must not spend their attempts,
    put them behind their backoff, or dead-letter one on its last attempt unrun."""
    jobd.enqueue(conn, "h")
    last = jobd.enqueue(conn, "h", max_attempts=1)
    jobd.enqueue(conn, "h")
    # A claim whose result was lost with the connection, next to a job the worker did get.
    held, *orphans = queue.claim(conn, LANE, WORKER_ID, 3, 30.0)
    assert last in {job.id for job in orphans}
    loop.completer.pending = [outcomes.Outcome(held, None)]
    loop.link.lost("test", psycopg.OperationalError("server closed the connection"))
    loop._ensure_connection()
    loop.repair.repair_lost_claims()
    assert not loop.claims_unknown
    for job in orphans:
        assert state_of(conn, job.id) == ("pending", 0, None)
    assert state_of(conn, held.id)[:2] == ("claimed", 1)
    loop._settle_and_claim(claim=False)
    assert state_of(conn, held.id)[0] == "done"


def test_a_job_lost_with_a_connection_a_second_time_fails_as_an_attempt(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    """A job whose claim loses the connection every time (an answer too large for the
    reply bound, say) must reach the dead-letter queue, not loop: given back unspent once,
    it fails the next time."""
    job_id = jobd.enqueue(conn, "h", max_attempts=1)
    for expected in (("pending", 0), ("dead", 1)):
        assert [job.id for job in queue.claim(conn, LANE, WORKER_ID, 1, 30.0)] == [job_id]
        loop.link.lost("test", psycopg.OperationalError("server closed the connection"))
        loop._ensure_connection()
        loop.repair.repair_lost_claims()
        state, attempts, error = state_of(conn, job_id)
        assert (state, attempts) == expected
    assert error is not None and "never reached the worker" in error


def test_claimed_rows_that_cannot_be_loaded_end_in_the_dead_letter_queue(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    # A row from before the run_at CHECK existed: no client can load '-infinity'.
    conn.execute("ALTER TABLE jobs DROP CONSTRAINT jobs_run_at_range")
    poison = jobd.enqueue(conn, "h", max_attempts=2)
    for attempt in (1, 2):
        # Due at once, and unloadable: the claim commits, its rows fail to load.
        conn.execute("UPDATE jobs SET run_at = '-infinity' WHERE id = %s", (poison,))
        loop.link.usable_at = 0.0
        loop.claimer.maybe_more = True
        loop._settle_and_claim()
        assert loop.claims_unknown and loop.inflight == {}
        loop.link.usable_at = 0.0
        loop.repair.repair_lost_claims()
        assert not loop.claims_unknown
        if attempt == 1:
            assert conn.execute("SELECT state, attempts FROM jobs WHERE id = %s",
                                (poison,)).fetchone() == ("failed", 1)
    assert conn.execute("SELECT count(*) FROM dead_letter WHERE id = %s",
                        (poison,)).fetchone() == (1,)


def test_a_late_result_of_an_abandoned_run_leaves_the_new_run_held(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h")
    (first,) = queue.claim(conn, LANE, WORKER_ID, 1, 30.0)
    queue.fail(conn, [queue.Failure(first.lease, "timed out", 0.0, 8)])
    (second,) = queue.claim(conn, LANE, WORKER_ID, 1, 30.0)
    assert second.id == first.id and second.lease_token != first.lease_token
    loop.inflight[second.id] = slots.Running(second, 0.0, None, started=0.0)
    loop.runner.outcomes.put(outcomes.Outcome(first, None))
    loop._collect_outcomes()
    assert loop.inflight[second.id].job is second and loop.completer.pending == []


def test_a_run_past_its_timeout_fails_and_frees_its_claim_but_holds_its_slot(
        one_slot_with_timeout: worker.Worker, conn: psycopg.Connection) -> None:
    subject = one_slot_with_timeout
    jobd.enqueue(conn, "h")
    (job,) = queue.claim(conn, LANE, WORKER_ID, 1, 30.0)
    started = time.monotonic()
    subject.inflight[job.id] = slots.Running(job, started, 5.0, started=started)
    subject.slots.expire_timeouts(started + 1.0)
    assert subject.completer.pending == [] and subject.slots.deadlines() == [started + 5.0]
    subject.slots.expire_timeouts(started + 5.0)
    assert subject.inflight[job.id].abandoned and subject.slots.deadlines() == []
    # Its thread is still taken: the one slot is wedged, and nothing is renewed or released.
    assert subject.slots.wedged() and subject.slots.holding_handlers() == {"h": 1}
    assert subject.slots.renewable_leases() == [] and subject.slots.unfinished_leases() == []
    subject._settle_and_claim(claim=False)
    state, attempts, error = state_of(conn, job.id)
    assert (state, attempts) == ("failed", 1) and error == "timed out after 5s"


def test_a_renewal_that_finds_a_lease_gone_stops_renewing_it(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    jobd.enqueue(conn, "h")
    jobd.enqueue(conn, "h")
    kept, taken_away = queue.claim(conn, LANE, WORKER_ID, 2, 30.0)
    for job in (kept, taken_away):
        now = time.monotonic()
        loop.inflight[job.id] = slots.Running(job, now, None, started=now)
    queue.release(conn, [taken_away.lease])  # as a sweep of an expired lease would
    loop._renew_leases()  # due at once: the worker has not started its loop
    assert loop.inflight[taken_away.id].lease_lost and not loop.inflight[kept.id].lease_lost
    assert loop.slots.renewable_leases() == [kept.lease]
    assert loop.leases.next_at > time.monotonic()


OTHER_WORKER = "other-node:default#0:f00d"


def cut_after(real: Callable[..., T], commit: bool) -> Callable[..., T]:
    """``real`` on a connection that is lost before its answer arrives: after the server
    committed (``commit``) or before it was sent."""

    def cut(conn: psycopg.Connection, *args: object, **kwargs: object) -> T:
        if commit:
            real(conn, *args, **kwargs)
        conn.close()
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    return cut


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not-sent"])
def test_jobs_whose_release_went_unanswered_never_start_and_are_released_again(
        loop: worker.Worker, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch,
        committed: bool) -> None:
    ids = [jobd.enqueue(conn, "h") for _ in range(2)]
    claimed = queue.claim(conn, LANE, WORKER_ID, 2, 30.0)
    loop.claimer.suspects_possible = False
    # Unstarted past the buffer's age: due to go back.
    loop.claimer.buffer.add(claimed, time.monotonic() - BUFFER_MAX_AGE - 1.0)
    with monkeypatch.context() as patched:
        patched.setattr(queue, "release", cut_after(queue.release, committed))
        loop._release_buffer()
    assert loop.conn is None
    if committed:
        # Another worker takes them, as the release's notification asks.
        assert sorted(j.id for j in queue.claim(conn, LANE, OTHER_WORKER, 2, 30.0)) == ids
    holder = OTHER_WORKER if committed else WORKER_ID
    # The next turn, in the loop's order: the repair, then the slots are filled first.
    loop._ensure_connection()
    loop.repair.repair_lost_claims()
    loop.slots.fill(WorkerMode.RUNNING)
    assert loop.inflight == {}
    # The repair took them for held: their release was not known to have applied.
    assert {state_of(conn, i)[:2] for i in ids} == {("claimed", 1)}
    assert {row[0] for row in conn.execute("SELECT claimed_by FROM jobs")} == {holder}
    loop._release_buffer()
    assert not loop.claimer.buffer and loop.claimer.releasing == []
    assert loop.completer.pending == []
    assert loop.counters.released == 2 and loop.counters.lease_lost == 0
    expected = ("claimed", 1) if committed else ("pending", 0)
    assert {state_of(conn, i)[:2] for i in ids} == {expected}


def backend_state(conn: psycopg.Connection, pid: int) -> tuple[str, str | None] | None:
    return conn.execute("SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = %s",
                        (pid,)).fetchone()


@contextlib.contextmanager
def budget_lock_held(db_url: str) -> Iterator[None]:
    """The budget lock of a limited lane, held by another session: its claims wait."""
    with psycopg.connect(db_url, autocommit=True) as holder:
        key = f"jobd.{LANE}#budget"
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (key,))
        yield


def claim_lost_while_waiting(subject: worker.Worker, conn: psycopg.Connection) -> int:
    """Send a claim that waits on the lane's budget lock, and lose the connection while it
    waits: the network goes, so the client knows and the backend does not. Returns the lost
    connection's backend, still waiting; the lock is let go on the way out."""
    assert subject.conn is not None
    pid, fd = subject.conn.info.backend_pid, subject.conn.pgconn.socket

    def cut_when_waiting() -> None:
        wait_until(lambda: (backend_state(conn, pid) or (None, None))[1] == "Lock", WAIT_S,
                   message="the claim waits on the budget lock")
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    cutter = threading.Thread(target=cut_when_waiting)
    cutter.start()
    subject.claimer.suspects_possible = False
    subject.claimer.maybe_more = True
    subject._settle_and_claim()
    cutter.join()
    assert subject.conn is None and subject.claims_unknown
    assert backend_state(conn, pid) == ("active", "Lock")
    return pid


@pytest.fixture
def limited(db_url: str) -> Iterator[worker.Worker]:
    lane = LaneConfig(LANE, concurrency=2, max_running=10, settle_connection=False)
    with connected_worker(db_url, lane, WORKER_ID) as (subject, _wake):
        yield subject


def test_a_claim_still_running_on_a_lost_connections_backend_is_ended_before_the_repair(
        limited: worker.Worker, db_url: str, conn: psycopg.Connection) -> None:
    ids = [jobd.enqueue(conn, "h") for _ in range(2)]
    with budget_lock_held(db_url):
        old = claim_lost_while_waiting(limited, conn)
        limited._ensure_connection()
        limited.repair.repair_lost_claims()
        assert not limited.claims_unknown
    # The lock is free: a claim still waiting for it would go on and commit now.
    wait_until(lambda: (backend_state(conn, old) or ("gone",))[0] != "active", WAIT_S,
               message="the lost connection's backend is done")
    # It was ended before the repair looked: its jobs wait for the next claim, attempt
    # unspent, instead of staying claimed in the worker's name until their lease expires.
    assert backend_state(conn, old) is None
    assert {state_of(conn, i)[:2] for i in ids} == {("pending", 0)}
    assert conn.execute("SELECT count(*) FROM jobs WHERE claimed_by = %s",
                        (WORKER_ID,)).fetchone() == (0,)


def test_the_repair_waits_for_a_lost_connections_backend_that_has_not_exited(
        limited: worker.Worker, db_url: str, conn: psycopg.Connection,
        monkeypatch: pytest.MonkeyPatch) -> None:
    jobd.enqueue(conn, "h")
    with budget_lock_held(db_url):
        old = claim_lost_while_waiting(limited, conn)
        limited._ensure_connection()
        with monkeypatch.context() as patched:
            # It outlives the wait (a backend stuck where a terminate cannot reach it).
            patched.setattr(queue, "end_backends", lambda *_args: [old])
            limited.repair.repair_lost_claims()
        assert limited.claims_unknown and limited.repair.lost_backends == [old]
        retry_at = limited.repair.due_at()
        assert retry_at is not None and retry_at > time.monotonic()
        limited.repair.repair_lost_claims()  # not before its time: nothing tried
        assert backend_state(conn, old) == ("active", "Lock")
        limited.repair.backends_retry_at = 0.0  # as if the loop woke at due_at()
        limited.repair.repair_lost_claims()
        assert not limited.claims_unknown and limited.repair.due_at() is None
        assert backend_state(conn, old) is None


def test_moments_that_need_the_database_wait_until_it_can_be_used() -> None:
    # A poll long overdue while the database is down: the loop sleeps until the retry.
    assert select_timeout(10.0, local=[12.0], database=[5.0], database_ready=11.0,
                          connected=False) == pytest.approx(1.0)
    # A process-local deadline is not held back by the database.
    assert select_timeout(10.0, local=[10.25, None], database=[10.5], database_ready=11.0,
                          connected=True) == pytest.approx(0.25)
    # Connected and ready: the soonest moment of any kind; overdue ones return at once.
    assert select_timeout(10.0, local=[12.0], database=[10.5, None], database_ready=0.0,
                          connected=True) == pytest.approx(0.5)
    assert select_timeout(10.0, local=[9.0], database=[], database_ready=0.0,
                          connected=True) == 0.0


def test_sigterm_drains_until_the_deadline_and_sigquit_stops_at_once() -> None:
    life = Lifecycle(shutdown_timeout=30.0)
    assert not life.finished(holds_work=False, now=time.monotonic())  # running: never
    life.on_signal(signal.SIGTERM, in_flight=3)
    assert life.mode == WorkerMode.DRAINING and life.drain_deadline is not None
    assert life.finished(holds_work=False, now=time.monotonic())
    assert not life.finished(holds_work=True, now=time.monotonic())
    assert life.finished(holds_work=True, now=life.drain_deadline)
    life.on_signal(signal.SIGUSR2, in_flight=3)  # a drain is not turned into a retirement
    assert life.mode == WorkerMode.DRAINING and not life.stop_now
    # A second SIGTERM is the same stop reaching the worker twice (sent to the process
    # group, and relayed by the supervisor): the drain goes on, to the same deadline.
    deadline = life.drain_deadline
    life.on_signal(signal.SIGTERM, in_flight=3)
    assert life.mode == WorkerMode.DRAINING and not life.stop_now
    assert life.drain_deadline == deadline
    life.on_signal(signal.SIGQUIT, in_flight=3)  # the supervisor's "stop fast"
    assert life.stop_now


def test_a_retiring_worker_finishes_its_work_however_long_and_drains_if_orphaned() -> None:
    life = Lifecycle(shutdown_timeout=1.0)
    life.on_signal(signal.SIGUSR2, in_flight=1)
    assert life.mode == WorkerMode.RETIRING and life.drain_deadline is None
    assert not life.finished(holds_work=True, now=time.monotonic() + 3600.0)
    life.supervisor_gone(in_flight=1)
    assert life.mode == WorkerMode.DRAINING and life.drain_deadline is not None
    assert not life.stop_now  # gone supervisor: a drain, not a stop


def test_a_worker_counts_on_its_board_each_time_it_runs_out_of_work() -> None:
    status_r, status_w = os.pipe()
    os.set_blocking(status_r, False)
    wake_r, wake_w = os.pipe()
    board, board_fd = RunBoard.create(concurrency=10)
    os.close(board_fd)
    spec = protocol.WorkerSpec(
        worker_id=WORKER_ID, lane=LaneConfig(LANE), handlers={},
        database_url="postgresql:///unused", schema="jobd", slot=0, generation=1,
        status_fd=status_w, wake_fd=wake_r, shutdown_timeout=1.0)
    reporter = StatusReporter(spec, Counters(), board)

    def reports() -> list[int]:
        try:
            data = os.read(status_r, 65536)
        except BlockingIOError:
            return []
        return [protocol.StatusReport.parse(line).busy for line in data.splitlines()]

    try:
        now = time.monotonic()
        reporter.report(now, WorkerMode.RUNNING, 0, 0, 10, True)
        assert (reports(), board.idle_count()) == ([0], 0)  # idle from the start: no news
        reporter.report(now + 0.1, WorkerMode.RUNNING, 2, 3, 10, True)
        reporter.report(now + 0.2, WorkerMode.RUNNING, 0, 0, 10, True)
        # Out of work: counted on the board at once, no report before the second is up.
        assert (reports(), board.idle_count()) == ([], 1)
        reporter.report(now + 0.3, WorkerMode.RUNNING, 0, 0, 10, True)
        assert board.idle_count() == 1  # still idle: nothing new
        reporter.report(now + 0.4, WorkerMode.RUNNING, 0, 1, 10, True)  # a job claimed ahead
        reporter.report(now + 0.5, WorkerMode.RUNNING, 0, 0, 10, True)
        assert board.idle_count() == 2
        reporter.report(now + REPORT_INTERVAL, WorkerMode.RUNNING, 1, 0, 10, True)
        assert reports() == [1]  # the second's report
        # The board's other slots, the running jobs, are untouched by the count.
        assert board.running().job_ids == frozenset()
        # A wake-up written during the turn that ran out of work routed work here, which the
        # next turn claims: counting now would tell the supervisor that work was done.
        os.write(wake_w, b"w")
        reporter.report(now + 0.6, WorkerMode.RUNNING, 0, 0, 10, True)
        assert board.idle_count() == 2
        os.read(wake_r, 16)  # the next turn reads it, and finds nothing to claim
        reporter.report(now + 0.7, WorkerMode.RUNNING, 0, 0, 10, True)
        assert board.idle_count() == 3
        # Each report carries the count as of its writing (2 x REPORT_INTERVAL: one is due).
        reporter.report(now + 2 * REPORT_INTERVAL, WorkerMode.RUNNING, 0, 0, 10, True)
        assert [protocol.StatusReport.parse(line).idle_count
                for line in os.read(status_r, 65536).splitlines()] == [3]
    finally:
        board.close()
        for fd in (status_r, status_w, wake_r, wake_w):
            os.close(fd)


def test_a_busy_worker_holds_outcomes_for_company_until_its_whole_capacity_or_the_delay(
        conn: psycopg.Connection) -> None:
    lane = LaneConfig(LANE, concurrency=2, prefetch=3)
    completer = Completer(lane, Counters())
    for _ in range(5):
        jobd.enqueue(conn, "h")
    claimed = queue.claim(conn, LANE, WORKER_ID, 5, 30.0)
    for job in claimed[:4]:
        completer.add(outcomes.Outcome(job, None))
    # A full round of slots (concurrency) is no reason to commit alone while the buffer's
    # jobs can run first; with nothing else running there is nothing to wait for.
    assert not completer.due(busy=True, capacity=5) and completer.due(busy=False, capacity=5)
    completer.add(outcomes.Outcome(claimed[4], None))
    assert completer.due(busy=True, capacity=5)  # all the worker can hold: no more can come
    completer.pending = completer.pending[:1]
    assert completer.since is not None
    completer.since -= SETTLE_DELAY
    assert completer.due(busy=True, capacity=5)  # waited long enough for company


def test_outcomes_that_arrive_while_a_batch_is_written_wait_for_the_next_one(
        conn: psycopg.Connection) -> None:
    counters = Counters()
    completer = Completer(LaneConfig(LANE), counters)
    for _ in range(2):
        jobd.enqueue(conn, "h")
    first, second = queue.claim(conn, LANE, WORKER_ID, 2, 30.0)
    completer.add(outcomes.Outcome(first, None))
    batch = completer.batch()
    # The slots turn over while the exchange waits for the server (Slots.turn_over).
    completer.add(outcomes.Outcome(second, None))
    completed, failed, _ = queue.settle_and_claim(conn, batch.successes, batch.failures, None)
    completer.written(batch, completed, failed)
    assert [o.job.id for o in completer.pending] == [second.id] and counters.completed == 1
    assert completer.since is not None  # it is written within SETTLE_DELAY, like any other
    assert state_of(conn, first.id)[0] == "done" and state_of(conn, second.id)[0] == "claimed"


def test_a_slow_round_trip_from_the_head_of_the_lane_spaces_out_the_next_one(
        loop: worker.Worker, db_url: str) -> None:
    """What a held horizon does to a scan from the head (it walks every dead entry), made
    here by a lock that holds the claim for a known time: the worker scans from its floors
    until such scans take at most their share of its time again."""
    floors = loop.claimer.floors
    assert floors.params(time.monotonic()) == full_scan_params()  # a new worker: the head
    loop._settle_and_claim()  # a first claim plans the statement on this connection
    floors.forget()
    loop.claimer.maybe_more = True
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE jobd.lane_pauses IN ACCESS EXCLUSIVE MODE")
        releaser = threading.Timer(0.3, holder.execute, ("COMMIT",))
        releaser.start()
        started = time.monotonic()
        loop._settle_and_claim()
        waited = time.monotonic() - started
        releaser.join()
    assert waited >= 0.3
    assert floors.full_scan_spacing == min(MAX_FULL_SCAN_INTERVAL, 0.3 / HEAD_SCAN_SHARE)
    # Until then, once a second, a claim looks back LOOK_BACK seconds instead.
    assert kind(floors.params(time.monotonic())) == "look back"
    floors.forget()  # given back below the floors: the head at once, however slow
    loop.claimer.maybe_more = True
    loop._settle_and_claim()
    # A quick one brings the spacing back down (to the second, when it took under 2 ms more
    # than the usual round trip; a busy machine's jitter may leave it a few seconds).
    assert FULL_SCAN_INTERVAL <= floors.full_scan_spacing <= 0.02 / HEAD_SCAN_SHARE


def test_a_full_claim_that_finds_the_worker_empty_doubles_its_buffer(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    """Until the start rate is measured (jobd.prefetch): the buffer held less than a round
    trip of work, so the next claim asks for twice as much."""
    prefetch = loop.claimer.prefetch
    floor = prefetch.floor
    jobd.enqueue_many(conn, [jobd.JobSpec("noop") for _ in range(4 * floor)])
    loop._settle_and_claim()
    assert len(loop.claimer.buffer) + len(loop.slots) == loop.lane.concurrency + floor
    assert prefetch.size == 2 * floor


def test_a_short_claim_keeps_the_buffer_as_it_was(
        loop: worker.Worker, conn: psycopg.Connection) -> None:
    prefetch = loop.claimer.prefetch
    jobd.enqueue_many(conn, [jobd.JobSpec("noop") for _ in range(prefetch.floor)])
    loop._settle_and_claim()
    assert len(loop.claimer.buffer) + len(loop.slots) == prefetch.floor  # all there was
    assert prefetch.size == prefetch.floor



def test_outcomes_committed_before_a_failed_claim_count_as_written(
        db_url: str, conn: psycopg.Connection) -> None:
    # A limited lane writes outcomes in a transaction of their own, then claims under the
    # lane's budget lock. A claim that fails there (lock_timeout) must not make the worker
    # send the committed outcomes again: the fence would answer "lease lost" for each, and
    # the done job would be logged and counted as a result discarded.
    lane = LaneConfig(LANE, max_running=5, settle_connection=False)
    with (connected_worker(db_url, lane, WORKER_ID) as (subject, _wake),
          psycopg.connect(db_url, autocommit=True) as holder):
        job_id = jobd.enqueue(conn, "h")
        [job] = queue.claim(conn, LANE, WORKER_ID, 1, 30.0)
        subject.completer.add(outcomes.Outcome(job, None))
        subject.claimer.maybe_more = True
        assert subject.conn is not None
        subject.conn.execute("SET lock_timeout = '100ms'")
        holder.execute("SELECT pg_advisory_lock(hashtextextended('jobd.' || %s || '#budget', 0))",
                       (LANE,))
        subject.exchange.settle_and_claim(WorkerMode.RUNNING)
        assert subject.repair.claims_unknown  # the claim failed: its fate is looked into
        assert conn.execute("SELECT state FROM jobd.all_jobs WHERE id = %s",
                            (job_id,)).fetchone() == ("done",)
        assert not subject.completer.pending
        counts = subject.counters.as_dict()
        assert (counts["completed"], counts["lease_lost"]) == (1, 0)


@pytest.mark.parametrize("apart", [False, True], ids=["with-claims", "own-connection"])
@pytest.mark.parametrize(("error", "max_attempts", "state", "counter"), [
    (None, None, "done", "completed"),
    ("boom", 3, "failed", "failed"),
    ("boom", 1, "dead", "dead"),
], ids=["done", "retried", "dead"])
def test_outcomes_whose_answer_was_lost_after_their_commit_count_as_written(
        db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch, apart: bool,
        error: str | None, max_attempts: int | None, state: str, counter: str) -> None:
    # The connection is lost between the outcomes' COMMIT and its answer: the worker sends
    # them again and the fence refuses them. Reported as leases lost, a network blip would
    # log "result discarded" for jobs that were not, and raise the lease_lost counter.
    # A retry's delay is drawn from [0, base): with the default base of 1 s it was now and
    # then short enough for the resend's claim to take the job again (claimed, not failed).
    lane = LaneConfig(LANE, settle_connection=apart, backoff=Backoff(base=3600.0, cap=3600.0))
    with connected_worker(db_url, lane, WORKER_ID) as (subject, _wake):
        assert (subject.settler is not None) == apart
        job_id = jobd.enqueue(conn, "h", max_attempts=max_attempts)
        [job] = queue.claim(conn, LANE, WORKER_ID, 1, 30.0)
        subject.claimer.maybe_more = False  # outcomes alone, no claim with them
        subject.completer.add(outcomes.Outcome(job, error))
        with monkeypatch.context() as patched:
            patched.setattr(queue, "settle_and_claim",
                            cut_after(queue.settle_and_claim, commit=True))
            subject.exchange.settle_and_claim(WorkerMode.RUNNING)
            subject.exchange.take_settled(wait=True)
        assert state_of(conn, job_id)[0] == state  # written, its answer lost
        assert len(subject.completer.pending) == 1
        subject._ensure_connection()
        subject.claimer.maybe_more = False
        subject.exchange.settle_and_claim(WorkerMode.RUNNING)  # sent again, on the link
        subject.exchange.take_settled(wait=True)
        assert not subject.completer.pending
        counts = subject.counters.as_dict()
        assert (counts[counter], counts["lease_lost"]) == (1, 0)
        assert state_of(conn, job_id)[0] == state


@pytest.mark.parametrize("error", [None, "boom"], ids=["success", "failure"])
def test_an_unanswered_write_that_did_not_commit_is_still_lost_if_the_lease_was(
        db_url: str, conn: psycopg.Connection, monkeypatch: pytest.MonkeyPatch,
        error: str | None) -> None:
    # The look-up must not turn a real loss into a write: here the first write never
    # reached the server, and meanwhile the job's lease expired and it was retried by
    # another worker, which finished it (as it would have failed it: the sweep's entry).
    with connected_worker(db_url, LaneConfig(LANE, settle_connection=False),
                          WORKER_ID) as (subject, _wake):
        job_id = jobd.enqueue(conn, "h")
        [job] = queue.claim(conn, LANE, WORKER_ID, 1, 30.0)
        subject.claimer.maybe_more = False
        subject.completer.add(outcomes.Outcome(job, error))
        with monkeypatch.context() as patched:
            patched.setattr(queue, "settle_and_claim",
                            cut_after(queue.settle_and_claim, commit=False))
            subject.exchange.settle_and_claim(WorkerMode.RUNNING)
        expired = queue.Failure(job.lease, "lease expired", 0.0, 3)
        assert queue.fail(conn, [expired]).retried == [job_id]  # as the sweep would
        [again] = queue.claim(conn, LANE, OTHER_WORKER, 1, 30.0)
        queue.complete(conn, [again.lease])
        subject._ensure_connection()
        subject.claimer.maybe_more = False
        subject.exchange.settle_and_claim(WorkerMode.RUNNING)
        assert not subject.completer.pending
        counts = subject.counters.as_dict()
        assert (counts["completed"], counts["failed"], counts["lease_lost"]) == (0, 0, 1)


def test_a_limited_lanes_wait_for_its_budget_lock_is_not_charged_to_a_scan_from_the_head(
        limited: worker.Worker, db_url: str) -> None:
    # Claims of a limited lane take turns under its budget lock, so a claim's round trip
    # includes the others' turns. Charged to a scan from the head, a 0.3 s turn spaced such
    # scans 60 s apart (the cap), leaving jobs below the floors waiting that long.
    floors = limited.claimer.floors
    limited.claimer.suspects_possible = False
    limited._settle_and_claim()  # a first claim plans the statement on this connection
    floors.forget()
    limited.claimer.maybe_more = True
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))",
                       (f"jobd.{LANE}#budget",))
        releaser = threading.Timer(0.3, holder.execute, (
            "SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (f"jobd.{LANE}#budget",)))
        releaser.start()
        started = time.monotonic()
        limited._settle_and_claim()
        waited = time.monotonic() - started
        releaser.join()
    assert waited >= 0.3
    assert FULL_SCAN_INTERVAL <= floors.full_scan_spacing <= 0.02 / HEAD_SCAN_SHARE


@contextlib.contextmanager
def claims_wait(db_url: str, seconds: float) -> Iterator[None]:
    """Claims sent meanwhile wait ``seconds`` for another session's lock on lane_pauses,
    which every claim reads."""
    with psycopg.connect(db_url) as holder:
        holder.execute("LOCK TABLE jobd.lane_pauses IN ACCESS EXCLUSIVE MODE")
        release = threading.Timer(seconds, holder.commit)
        release.start()
        try:
            yield
        finally:
            release.join()


def test_a_new_sessions_first_scan_from_the_head_is_not_taken_for_what_such_scans_cost(
        loop: worker.Worker, conn: psycopg.Connection, db_url: str) -> None:
    """A fresh worker's first claim scans from the head on a new session; slow for reasons
    of its own (the planning, a cold cache, a busy machine at start), it spaced the next
    scans from the head up to a minute apart, and a job due behind the floors waited so."""
    jobd.enqueue(conn, "h")
    loop.claimer.suspects_possible = False

    def slow_claim_from_the_head() -> None:
        loop.claimer.floors.last_full_scan = -math.inf  # a scan from the head is due
        loop.claimer.maybe_more = True
        with claims_wait(db_url, 0.3):
            loop._settle_and_claim()

    slow_claim_from_the_head()
    assert not loop.claimer.floors.spaced_out
    # The next one is what such scans cost now: spaced out.
    slow_claim_from_the_head()
    assert loop.claimer.floors.spaced_out
    # So is a new session's first one after a lost connection.
    loop.claimer.floors.full_scan_spacing = FULL_SCAN_INTERVAL
    loop.link.lost("test", psycopg.OperationalError("server closed the connection"))
    loop._ensure_connection()
    slow_claim_from_the_head()
    assert not loop.claimer.floors.spaced_out
