"""Lane controls in the pieces between the database and the handlers: the notification
payloads, the wake routing, the claimer's rules, the fallback poll, and the worker loop's
steps driven in-process against a real PostgreSQL."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import psycopg
import pytest
from worker_support import connected_worker

import jobd
from jobd import pauses, protocol, worker
from jobd.claim_buffer import BUFFER_MAX_AGE
from jobd.claim_floors import HEAD
from jobd.claimer import Claimer
from jobd.config import Config, LaneConfig
from jobd.duties.lane_poll import LanePoll
from jobd.protocol import WorkerMode
from jobd.wake_routing import WakeRouter
from jobd.wakeup import Wakeup, parse_payload

LANE = "default"
WORKER_ID = "test-node:default#0:beef"


# --- notifications and routing (pure) ------------------------------------------------------


@pytest.mark.parametrize(("payload", "expected"), [
    ("default!pause", Wakeup("default", None, 0, "pause")),
    ("mail.out:eu-1!cancel", Wakeup("mail.out:eu-1", None, 0, "cancel")),
    ("default!behind", Wakeup("default", None, 0, "behind")),
    ("default!", None),
    ("default!resume", None),
    ("!pause", None),
])
def test_control_payloads(payload: str, expected: Wakeup | None) -> None:
    assert parse_payload(payload) == expected


@dataclass(eq=False)
class FakeWorker:
    lane: str
    busy: int = 0
    capacity: int = 10
    retiring: bool = False
    wake_load: int = 0


def test_control_news_reaches_every_worker_of_the_lane_however_busy() -> None:
    busy, idle = FakeWorker("a", busy=10), FakeWorker("a")
    others = [FakeWorker("b"), FakeWorker("a", retiring=True)]
    router = WakeRouter()
    router.notified([Wakeup("a", None, 0, "pause"), Wakeup("a", None, 0, "cancel")])
    pokes = router.route([busy, idle, *others])
    assert sorted((id(w), b) for w, b in pokes) == sorted(
        (id(w), b) for w in (busy, idle) for b in (protocol.CONTROLS, protocol.CANCELS))
    assert router.route([busy, idle, *others]) == []  # consumed
    assert busy.wake_load == idle.wake_load == 0  # news is not work


# --- the claimer's rules (pure) ------------------------------------------------------------


def job(job_id: int, handler: str) -> jobd.Job:
    return jobd.Job.from_row((job_id, 1, LANE, handler, "{}", 0, None, 1, None, None, None,
                              None))


def test_a_paused_lane_claims_nothing_arms_not_and_gives_its_buffer_back() -> None:
    claimer = Claimer(LaneConfig(LANE, concurrency=2), WORKER_ID)
    claimer.buffer.extend([(job(1, "a"), 0.0), (job(2, "b"), 0.0)])
    assert claimer.set_controls(True, frozenset()) is False
    assert claimer.request(WorkerMode.RUNNING, 0) is None
    assert claimer.wants_arm(WorkerMode.RUNNING, 0.0) is False
    assert claimer.next_to_start(WorkerMode.RUNNING, 0) is None
    assert [j.id for j in claimer.to_release(WorkerMode.RUNNING, 0.0)] == [1, 2]
    claimer.buffer.clear()
    claimer.maybe_more = False
    assert claimer.set_controls(False, frozenset()) is True  # resumed: claim again
    assert claimer.maybe_more
    assert claimer.request(WorkerMode.RUNNING, 0) is not None


def test_a_paused_handlers_buffered_jobs_stay_unstarted_and_go_back() -> None:
    claimer = Claimer(LaneConfig(LANE, concurrency=2), WORKER_ID)
    claimer.suspects_possible = False
    claimer.buffer.extend([(job(1, "poison"), 10.0), (job(2, "fine"), 10.0),
                           (job(3, "poison"), 10.0)])
    claimer.set_controls(False, frozenset({"poison"}))
    started = claimer.next_to_start(WorkerMode.RUNNING, 0)
    assert started is not None and started[0].id == 2
    assert claimer.next_to_start(WorkerMode.RUNNING, 1) is None
    assert [j.id for j in claimer.to_release(WorkerMode.RUNNING, 10.5)] == [1, 3]
    assert claimer.request(WorkerMode.RUNNING, 1) is not None  # the lane still claims
    # Resuming the handler scans the lane from its head again: its jobs wait there.
    claimer.floors.last_full_scan = 10.0
    assert claimer.set_controls(False, frozenset()) is True
    assert claimer.floors.params(10.5)["default_floor_age"] is None


def test_a_paused_answer_from_arming_stops_claiming() -> None:
    claimer = Claimer(LaneConfig(LANE), WORKER_ID)
    claimer.arm_result("paused", 0.0, HEAD)
    assert claimer.lane_paused and not claimer.arming.armed
    assert claimer.request(WorkerMode.RUNNING, 0) is None


def test_taking_cancelled_jobs_out_of_the_buffer() -> None:
    claimer = Claimer(LaneConfig(LANE), WORKER_ID)
    claimer.buffer.extend([(job(1, "a"), 0.0), (job(2, "a"), 0.0)])
    assert [j.id for j in claimer.buffer.take({2, 9})] == [2]
    assert [j.id for j, _at in claimer.buffer] == [1]


def test_job_cancelled_is_false_until_requested() -> None:
    subject = job(1, "a")
    assert subject.cancelled is False
    subject.request_cancel()
    assert subject.cancelled is True
    assert job(1, "a").cancelled is False  # a fresh job from the same row


# --- the fallback poll ---------------------------------------------------------------------


def news(router: WakeRouter) -> dict[str, set[bytes]]:
    return {lane: set(found) for lane, found in router._news.items()}


def test_the_lane_poll_tells_workers_of_pause_changes_it_did_not_hear_of(
    conn: psycopg.Connection,
) -> None:
    config = Config(lanes={name: LaneConfig(name) for name in (LANE, "other")})
    router = WakeRouter()
    poll = LanePoll(lambda: config, router)
    poll.run(conn, 0.0)
    assert news(router) == {}
    pauses.pause(conn, LANE, "h")
    poll.run(conn, 0.0)
    assert news(router) == {LANE: {protocol.CONTROLS}}
    router.route([])
    poll.run(conn, 0.0)
    assert news(router) == {}  # unchanged: nothing to tell
    pauses.resume(conn, LANE, "h")
    poll.run(conn, 0.0)
    assert news(router) == {LANE: {protocol.CONTROLS}}


# --- the worker loop's steps, in-process ---------------------------------------------------


@pytest.fixture
def loop(db_url: str) -> Iterator[tuple[worker.Worker, int]]:
    """A worker with no handlers (no threads), connected, not started; and its wake pipe's
    write end, as the supervisor holds it."""
    lane = LaneConfig(LANE, concurrency=1, prefetch=4)
    with connected_worker(db_url, lane, WORKER_ID) as made:
        yield made


def states(conn: psycopg.Connection) -> dict[int, str]:
    return dict(conn.execute("SELECT id, state FROM all_jobs ORDER BY id").fetchall())


def claim_into_buffer(subject: worker.Worker) -> None:
    subject._refresh_controls()
    subject.claimer.maybe_more = True
    subject._settle_and_claim()


def test_the_worker_gives_back_its_buffer_when_told_of_a_pause_and_claims_on_resume(
    loop: tuple[worker.Worker, int], conn: psycopg.Connection,
) -> None:
    subject, wake_w = loop
    first, *rest = [jobd.enqueue(conn, "h") for _ in range(3)]
    claim_into_buffer(subject)
    # One slot: the first job runs (it fails: this worker has no handlers), two wait.
    assert list(subject.inflight) == [first]
    assert [j.id for j, _at in subject.claimer.buffer] == rest
    pauses.pause(conn, LANE)
    os.write(wake_w, protocol.CONTROLS)  # what the supervisor sends on 'default!pause'
    subject._on_wake(subject.spec.wake_fd)
    subject._refresh_controls()
    subject._release_buffer()
    assert states(conn) == {first: "claimed", **dict.fromkeys(rest, "pending")}
    assert not subject.claimer.buffer
    subject.claimer.maybe_more = True  # a wake-up from the released jobs' notification
    subject._collect_outcomes()
    subject._settle_and_claim()
    subject.exchange.take_settled(wait=True)  # written on the settler's connection
    assert states(conn) == {first: "failed", **dict.fromkeys(rest, "pending")}  # no claim
    pauses.resume(conn, LANE)
    os.write(wake_w, protocol.CONTROLS)
    subject._on_wake(subject.spec.wake_fd)
    subject._refresh_controls()
    subject._settle_and_claim()
    assert states(conn) == {first: "failed", **dict.fromkeys(rest, "claimed")}


def test_the_worker_reads_its_lanes_pauses_when_it_connects(
    loop: tuple[worker.Worker, int], conn: psycopg.Connection,
) -> None:
    subject, _wake_w = loop
    pauses.pause(conn, LANE, "poison")
    subject._refresh_controls()
    assert subject.claimer.handlers.paused == frozenset({"poison"})
    assert not subject.controls.stale


def test_a_cancelled_buffered_job_is_finished_unstarted_at_the_next_renewal(
    loop: tuple[worker.Worker, int], conn: psycopg.Connection,
) -> None:
    subject, wake_w = loop
    running, waiting, doomed = (jobd.enqueue(conn, "h") for _ in range(3))
    claim_into_buffer(subject)
    assert list(subject.inflight) == [running]
    assert jobd.cancel(conn, [doomed]).requested == [doomed]
    os.write(wake_w, protocol.CANCELS)  # what the supervisor sends on 'default!cancel'
    subject._on_wake(subject.spec.wake_fd)
    subject._renew_leases()  # due at once
    assert [j.id for j, _at in subject.claimer.buffer] == [waiting]
    subject._settle_and_claim(claim=False)
    assert states(conn) == {running: "claimed", waiting: "claimed", doomed: "cancelled"}
    assert (subject.counters.cancelled, subject.counters.completed) == (1, 0)


def test_a_buffered_job_asked_to_stop_is_finished_cancelled_when_its_buffer_goes_back(
    loop: tuple[worker.Worker, int], conn: psycopg.Connection,
) -> None:
    subject, _wake_w = loop
    running, waiting, doomed = (jobd.enqueue(conn, "h") for _ in range(3))
    claim_into_buffer(subject)
    assert list(subject.inflight) == [running]
    assert jobd.cancel(conn, [doomed]).requested == [doomed]
    # Before any renewal tells the worker, its buffer goes back for its age: the release
    # leaves the job asked to stop to it.
    buffer = subject.claimer.buffer
    aged = [(job, claimed_at - BUFFER_MAX_AGE - 1.0) for job, claimed_at in buffer]
    buffer.clear()
    buffer.extend(aged)
    subject._release_buffer()
    assert not buffer and subject.claimer.releasing == []
    assert [outcome.job.id for outcome in subject.completer.pending] == [doomed]
    subject._settle_and_claim(claim=False)
    assert states(conn) == {running: "claimed", waiting: "pending", doomed: "cancelled"}
    assert (subject.counters.cancelled, subject.counters.released) == (1, 1)


def test_told_of_jobs_behind_its_floors_the_worker_claims_from_the_head(
    loop: tuple[worker.Worker, int], conn: psycopg.Connection,
) -> None:
    subject, wake_w = loop
    first = jobd.enqueue(conn, "h")
    claim_into_buffer(subject)
    assert list(subject.inflight) == [first]
    [[db_now]] = conn.execute("SELECT now()").fetchall()
    herd = jobd.enqueue(conn, "h", run_at=db_now - timedelta(minutes=1))
    # Its floors sit above the herd, and its last scan from the head was just now.
    subject.claimer.floors.last_full_scan = time.monotonic()
    claim_into_buffer(subject)
    assert states(conn)[herd] == "pending"
    os.write(wake_w, protocol.BEHIND)  # what the supervisor sends on 'default!behind'
    subject._on_wake(subject.spec.wake_fd)
    subject._settle_and_claim()
    assert states(conn)[herd] == "claimed"
