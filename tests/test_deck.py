"""Jobs on deck (``jobd.slots``): sync jobs handed to the handler threads ahead of a free one,
driven in-process against a real PostgreSQL with real handler threads. A job on deck starts
only when a thread takes it, its timeout runs from then, and whatever the worker does to its
buffer (a drain, a cancel, shutdown) it does to the deck first: taken back, such a job never
starts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from worker_support import connected_worker

import jobd
from jobd import handlers, jobs, leases, protocol, queue, worker
from jobd.claimer import Claimer
from jobd.completer import Completer, Counters
from jobd.config import LaneConfig
from jobd.db import DEFAULT_SCHEMA
from jobd.handler_runner import HandlerRunner
from jobd.protocol import WorkerMode
from jobd.slots import Running, Slots

LANE = "default"
WORKER_ID = "test-node:default#0:deck"
WAIT_S = 10.0  # a bound for what happens at once, never a pause


class Gate:
    """A handler that records each job it runs and holds it until that job is let go."""

    def __init__(self) -> None:
        self.ran: list[int] = []
        self._let_go: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, job_id: int) -> threading.Event:
        with self._lock:
            return self._let_go.setdefault(job_id, threading.Event())

    def __call__(self, job: jobs.Job) -> None:
        self.ran.append(job.id)
        self._event(job.id).wait(WAIT_S)

    def let_go(self, job_id: int) -> None:
        self._event(job_id).set()


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def subject(db_url: str, gate: Gate) -> Iterator[worker.Worker]:
    """A connected worker of one thread (timeout 5 s) whose handler is ``gate``."""
    lane = LaneConfig(LANE, concurrency=1, timeout=5.0)
    with connected_worker(db_url, lane, WORKER_ID,
                          {"gate": handlers.resolved("gate", gate)}) as (made, _wake):
        yield made
        for job_id in gate.ran:
            gate.let_go(job_id)


def claim_into_buffer(subject: worker.Worker, conn: psycopg.Connection,
                      count: int) -> list[jobs.Job]:
    for _ in range(count):
        jobd.enqueue(conn, "gate")
    claimed = queue.claim(conn, LANE, WORKER_ID, count, 30.0)
    subject.claimer.suspects_possible = False  # none due: the buffer may be held
    subject.claimer.buffer.extend((job, time.monotonic()) for job in claimed)
    return claimed


def first_running_and_deck(subject: worker.Worker, conn: psycopg.Connection, gate: Gate,
                           on_deck: int) -> tuple[jobs.Job, list[jobs.Job], jobs.Job]:
    """Claim a first job, ``on_deck`` more and a marker (kept back); hand the first and the
    deck over and wait for the first to hold the one thread."""
    first, *deck, marker = claim_into_buffer(subject, conn, on_deck + 2)
    subject.claimer.buffer.pop()
    hand_over(subject, deck=on_deck)
    until(lambda: gate.ran == [first.id], "the first job runs")
    return first, deck, marker


def hand_over(subject: worker.Worker, deck: int) -> None:
    """Fill the slots and ``deck`` places on deck (the claimer's measure decides how many in
    a running worker: ``test_the_deck_is_open_only_to_short_sync_jobs``)."""
    subject.slots.deck_size = lambda: deck  # type: ignore[method-assign]
    subject.slots.fill(WorkerMode.RUNNING)


def passes_marker(subject: worker.Worker, gate: Gate, marker: jobs.Job) -> None:
    """Hand ``marker`` to the threads' queue, behind whatever waits there, and wait for it to
    run: the thread has then dealt with everything queued before it."""
    gate.let_go(marker.id)
    subject.runner.start(Running(marker, time.monotonic(), None))
    until(lambda: marker.id in gate.ran, "the marker runs")


def until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S}s: {what}")
        time.sleep(0.005)


def test_a_job_on_deck_starts_when_a_thread_frees_and_its_timeout_runs_from_then(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, second = claim_into_buffer(subject, conn, 2)
    hand_over(subject, deck=1)
    assert set(subject.inflight) == {first.id, second.id} and not subject.claimer.buffer
    until(lambda: gate.ran == [first.id], "the first job runs")
    on_deck = subject.inflight[second.id]
    assert on_deck.started is None and on_deck.deadline is None
    started = subject.inflight[first.id].started
    assert started is not None and subject.slots.deadlines() == [started + 5.0]
    assert subject.slots.running() == 1
    gate.let_go(first.id)
    until(lambda: gate.ran == [first.id, second.id], "the job on deck runs next")
    assert on_deck.started is not None and on_deck.deadline == on_deck.started + 5.0


def test_jobs_taken_back_from_the_deck_return_in_order_and_never_start(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, (second, third), marker = first_running_and_deck(subject, conn, gate, 2)
    assert subject.claimer.buffer.started == 3
    subject.slots.take_back_deck()
    assert [job.id for job, _claimed in subject.claimer.buffer] == [second.id, third.id]
    assert set(subject.inflight) == {first.id}
    assert subject.claimer.buffer.started == 1  # the start rate counts what started, once
    # The taken-back jobs still sit in the threads' queue: the marker goes in behind them.
    gate.let_go(first.id)
    passes_marker(subject, gate, marker)
    assert gate.ran == [first.id, marker.id]


def test_a_drain_gives_back_the_jobs_on_deck_at_once(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, (second, third), marker = first_running_and_deck(subject, conn, gate, 2)
    subject.exchange.release_buffer(WorkerMode.DRAINING)
    assert set(subject.inflight) == {first.id} and not subject.claimer.buffer
    rows = conn.execute("SELECT id, state, claimed_by FROM jobs WHERE id <> %s ORDER BY id",
                        (marker.id,)).fetchall()
    assert rows == [(first.id, "claimed", WORKER_ID), (second.id, "pending", None),
                    (third.id, "pending", None)]
    gate.let_go(first.id)
    passes_marker(subject, gate, marker)
    assert gate.ran == [first.id, marker.id]


def test_a_job_on_deck_asked_to_stop_is_finished_unstarted(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, (second,), marker = first_running_and_deck(subject, conn, gate, 1)
    jobd.cancel(conn, [second.id])
    subject.leases.renew_now()
    subject._renew_leases()
    assert [outcome.job.id for outcome in subject.completer.pending] == [second.id]
    assert set(subject.inflight) == {first.id} and not subject.claimer.buffer
    subject._settle_and_claim(claim=False)
    assert conn.execute("SELECT state FROM all_jobs WHERE id = %s",
                        (second.id,)).fetchone() == ("cancelled",)
    gate.let_go(first.id)
    passes_marker(subject, gate, marker)
    assert gate.ran == [first.id, marker.id]


def test_a_thread_held_past_its_timeout_wedges_the_worker_whatever_waits_behind_it(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, (second,), marker = first_running_and_deck(subject, conn, gate, 1)
    started = subject.inflight[first.id].started
    assert started is not None
    subject.slots.expire_timeouts(started + 5.0)
    assert subject.inflight[first.id].abandoned and subject.slots.wedged()
    # The job behind it never started: shutdown gives it back rather than failing it.
    subject._shutdown()
    assert conn.execute("SELECT state, attempts FROM all_jobs WHERE id = %s",
                        (second.id,)).fetchone() == ("pending", 0)
    gate.let_go(first.id)  # the handler returns at last
    passes_marker(subject, gate, marker)
    assert gate.ran == [first.id, marker.id]


def test_a_suspect_waiting_for_its_thread_is_never_taken_back(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, suspect = claim_into_buffer(subject, conn, 2)
    subject.claimer.buffer.pop()
    hand_over(subject, deck=0)
    until(lambda: gate.ran == [first.id], "the first job runs")
    # As Exchange._started starts a suspect: handed over at once, to run alone.
    subject.claimer.isolating = suspect.id
    subject.claimer.suspects_possible = True  # so the buffer's rules give back everything
    subject.slots.start(suspect)
    subject.exchange.release_buffer(WorkerMode.RUNNING)
    subject.leases.renew_now()
    subject._renew_leases()
    assert set(subject.inflight) == {first.id, suspect.id} and not subject.claimer.buffer
    gate.let_go(first.id)
    until(lambda: gate.ran == [first.id, suspect.id], "the suspect runs")
    gate.let_go(suspect.id)
    until(lambda: subject.runner.outcomes.qsize() == 2, "both outcomes arrive")
    subject._collect_outcomes()
    assert subject.claimer.isolating is None  # done: the worker claims again


def test_a_pause_learnt_of_takes_the_deck_back_and_gives_it_back(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, (second, third), marker = first_running_and_deck(subject, conn, gate, 2)
    subject.claimer.set_controls(False, frozenset({"gate"}))
    subject.slots.recall_deck(WorkerMode.RUNNING, time.monotonic())
    assert set(subject.inflight) == {first.id}
    subject.slots.fill(WorkerMode.RUNNING)  # a paused handler's jobs are not handed over
    assert set(subject.inflight) == {first.id}
    subject.exchange.release_buffer(WorkerMode.RUNNING)
    assert not subject.claimer.buffer
    assert conn.execute("SELECT count(*) FROM jobs WHERE state = 'pending' AND id IN (%s, %s)",
                        (second.id, third.id)).fetchone() == (2,)
    gate.let_go(first.id)
    passes_marker(subject, gate, marker)
    assert gate.ran == [first.id, marker.id]


def test_a_heartbeat_renews_the_leases_of_jobs_on_deck(
        subject: worker.Worker, conn: psycopg.Connection, gate: Gate) -> None:
    first, second = claim_into_buffer(subject, conn, 2)
    hand_over(subject, deck=1)
    until(lambda: gate.ran == [first.id], "the first job runs")
    conn.execute("UPDATE jobs SET lease_until = now() + interval '1 second'")
    subject.leases.renew_now()
    subject._renew_leases()
    assert conn.execute("SELECT count(*) FROM jobs WHERE lease_until > now() + interval '20s'"
                        ).fetchone() == (2,)
    assert subject.inflight[second.id].started is None


def test_the_deck_is_open_only_to_short_sync_jobs() -> None:
    lane = LaneConfig(LANE, concurrency=4)
    spec = protocol.WorkerSpec(
        worker_id=WORKER_ID, lane=lane, handlers={}, database_url="postgresql:///unused",
        schema=DEFAULT_SCHEMA, slot=0, generation=1, status_fd=-1, wake_fd=-1,
        shutdown_timeout=1.0)

    def sync_handler(job: jobs.Job) -> None:
        pass

    async def async_handler(job: jobs.Job) -> None:
        pass

    only_sync = {"s": handlers.resolved("s", sync_handler)}
    with_async = {**only_sync, "a": handlers.resolved("a", async_handler)}
    # (buffer size, places on deck for sync jobs): at least concurrency, else half the buffer
    sizes = ((lane.buffer_size + 1, 6), (200, 100))
    for resolved, short_sync in ((only_sync, True), (with_async, False)):
        runner = HandlerRunner(spec, resolved)
        claimer = Claimer(lane, WORKER_ID)
        slots = Slots(lane, runner, claimer, Completer(lane, Counters.for_spec(spec)))
        assert slots.deck_size() == 0  # at the buffer's floor: the jobs are not known short
        for size, places in sizes:
            claimer.prefetch.size = size
            assert slots.deck_size() == (places if short_sync else 0)
        # A fixed buffer (the lane's prefetch) stays at its floor: its start rate says.
        claimer.prefetch.size = claimer.prefetch.floor
        claimer.prefetch.short = True
        assert slots.deck_size() == (max(lane.concurrency, lane.buffer_size // 2)
                                     if short_sync else 0)
        claimer.prefetch.short = False
        if runner.async_handlers is not None:
            runner.async_handlers.close()


def test_a_heartbeat_that_could_not_be_sent_is_sent_again_soon_and_at_the_reconnect(
        subject: worker.Worker, conn: psycopg.Connection) -> None:
    # Tried again only a whole heartbeat later, two missed in a row (an outage of 11-20 s at
    # the defaults) would leave the next one at the leases' end, racing the lease sweep.
    claim_into_buffer(subject, conn, 1)
    assert subject.conn is not None
    backend = subject.conn.info.backend_pid
    conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    subject.leases.renew_now()
    now = time.monotonic()
    subject.leases.renew(now)  # the statement fails: the connection is gone
    assert subject.leases.next_at <= now + leases.RETRY_AFTER_FAILURE
    subject.link.retry_at = 0.0  # the link's pause after the failure, skipped
    subject._ensure_connection()
    assert subject.conn is not None and subject.conn.info.backend_pid != backend
    assert subject.leases.next_at == 0.0  # the first turn on the new connection renews
