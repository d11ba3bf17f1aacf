"""Wake routing decisions (jobd.wake_routing): which workers to poke, and when. Pure."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from jobd import protocol
from jobd.config import LaneConfig
from jobd.run_board import RunBoard
from jobd.wake_routing import WakeRouter, choose
from jobd.wakeup import Wakeup
from jobd.workerpool import WorkerPool, WorkerProcess


@dataclass(eq=False)
class FakeWorker:
    lane: str
    busy: int = 0
    capacity: int = 10
    retiring: bool = False
    wake_load: int = 0


def pokes(router: WakeRouter, workers: list[FakeWorker], now: float | None = None
          ) -> list[tuple[FakeWorker, bytes]]:
    return router.route(workers, now)


def test_due_jobs_wake_the_least_loaded_workers_as_many_as_they_need() -> None:
    busy, idle, half = FakeWorker("a", busy=10), FakeWorker("a"), FakeWorker("a", busy=5)
    router = WakeRouter()
    router.due_now("a", 3)
    assert pokes(router, [busy, idle, half]) == [(idle, protocol.WAKE)]
    # The estimate stands until the worker's next report: the next job goes elsewhere.
    assert idle.wake_load == 3
    router.due_now("a", 25)  # three workers at capacity 10, least loaded first
    assert [w for w, _ in pokes(router, [busy, idle, half])] == [idle, half, busy]


def test_an_unknown_number_of_due_jobs_wakes_every_worker_serving_the_lane() -> None:
    serving = [FakeWorker("a"), FakeWorker("a", busy=10)]
    others = [FakeWorker("b"), FakeWorker("a", retiring=True)]
    router = WakeRouter()
    router.due_now("a")
    router.due_now("a", 1)  # an unknown count stays unknown
    assert [w for w, _ in pokes(router, serving + others)] == serving
    assert pokes(router, serving + others) == []  # consumed


def test_a_lane_without_workers_wakes_nobody() -> None:
    router = WakeRouter()
    router.due_now("a", 5)
    assert pokes(router, [FakeWorker("b")]) == []
    assert choose([], 5) == []


def test_timers_fire_when_their_instant_passes() -> None:
    router = WakeRouter()
    worker = FakeWorker("a")
    now = time.monotonic()
    router.due_at("a", time.time() + 5.0)
    router.due_at("a", time.time() + 9.0)  # the earliest instant per lane is kept
    assert 4.9 < router.next_moment() - now < 5.2
    assert pokes(router, [worker], now) == []
    assert pokes(router, [worker], now + 5.5) == [(worker, protocol.WAKE)]
    assert router.next_moment() == float("inf")


def test_the_database_clock_offset_moves_timers() -> None:
    router = WakeRouter()
    router.db_clock_offset = 2.0  # the database clock is 2 s ahead of ours
    now = time.monotonic()
    router.due_at("a", time.time() + 5.0)
    assert 2.9 < router.next_moment() - now < 3.2


def test_notifications_become_due_now_or_timers() -> None:
    router = WakeRouter()
    router.notified([Wakeup("a", None, 2), Wakeup("b", time.time() + 60)])
    a1, a2, b = FakeWorker("a"), FakeWorker("a", busy=1), FakeWorker("b")
    assert pokes(router, [a1, a2, b]) == [(a1, protocol.WAKE)]
    assert router.next_moment() > time.monotonic() + 50


def test_suspects_tell_every_serving_worker_to_look_now_or_later() -> None:
    router = WakeRouter()
    a, b = FakeWorker("a", busy=10), FakeWorker("b")
    router.suspects_due("a")
    assert pokes(router, [a, b]) == [(a, protocol.SUSPECTS)]
    now = time.monotonic()
    router.suspects_due("b", time.time() + 3.0)
    assert pokes(router, [a, b], now) == []
    assert pokes(router, [a, b], now + 3.5) == [(b, protocol.SUSPECTS)]


def test_a_step_of_the_wall_clock_does_not_move_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    router = WakeRouter()
    real_time = time.time
    db_now = real_time() + 2.0
    router.measured_db_clock(db_now)  # the database clock is 2 s ahead of ours
    for step in (-3600.0, 3600.0):  # NTP steps this node's clock back, then forward
        monkeypatch.setattr(time, "time", lambda step=step: real_time() + step)
        now = time.monotonic()
        router.due_at("a", real_time() + 2.0 + 5.0)  # due in 5 s by the database clock
        assert 4.9 < router.next_moment() - now < 5.2
        router.route([], now + 6.0)  # consumes the timer


def test_jobs_behind_the_floors_reach_every_worker_of_the_lane_beside_the_wake_up() -> None:
    router = WakeRouter()
    a1, a2, b = FakeWorker("a"), FakeWorker("a", busy=5), FakeWorker("b")
    # What one enqueue of a herd due in the past sends: its count, then 'behind'.
    router.notified([Wakeup("a", None, 1), Wakeup("a", None, 0, "behind")])
    assert sorted((id(w), byte) for w, byte in pokes(router, [a1, a2, b])) == sorted(
        [(id(a1), protocol.BEHIND), (id(a2), protocol.BEHIND), (id(a1), protocol.WAKE)])


def test_an_idle_count_no_newer_than_the_workers_last_report_does_not_override_it() -> None:
    """The supervisor's side of the run board's idle count (WorkerProcess.look_for_idle): a
    worker that ran out of work, then claimed by itself and reported it busy, is busy; only
    a count after that report says it is idle again."""
    lane = dataclasses.replace(LaneConfig("default"), concurrency=1, prefetch=0)
    board, fd = RunBoard.create(lane.concurrency)
    worker_side = RunBoard(fd, lane.concurrency)  # the worker's mapping of the same memory
    os.close(fd)
    process = WorkerProcess(SimpleNamespace(lane=lane, worker_id="w"),  # type: ignore[arg-type]
                            SimpleNamespace(pid=1), -1, -1, board, 0.0, 0.0)  # type: ignore[arg-type]

    def report(busy: int) -> None:
        line = protocol.StatusReport(busy, 1, idle_count=worker_side.idle_count()).to_line()
        WorkerPool._take_reports(None, process, line)  # type: ignore[arg-type]

    try:
        report(0)
        worker_side.went_idle()
        report(1)  # written after the count: it claimed a job by itself
        process.look_for_idle()
        assert process.busy == 1
        worker_side.went_idle()  # that job done
        process.look_for_idle()
        assert process.busy == 0
    finally:
        worker_side.close()
        board.close()
