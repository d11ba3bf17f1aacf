"""The node's Prometheus metrics (jobd.metrics, jobd.worker_metrics, the metrics sampler).

Pure parts first (histograms, the report's wire format, aggregation across worker restarts,
the families a view exports), then the sampler and the worker's counting against a real
PostgreSQL, then the daemon: every family exported from the start, a counter that does not
go backwards when a worker is killed with SIGKILL, and a real Prometheus scraping a running
daemon while jobs are enqueued, run, fail and dead-letter, and evaluating the shipped alert
rules (contrib/prometheus/alerts.yml) on that scrape. ``promtool check metrics`` judges the
exposition.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, db_now, enqueued_when_due, make_config, wait_until
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_support import Prometheus, check_metrics, fetch

import jobd
from jobd import dlq, protocol, queue, recovery, views, worker
from jobd.backoff import Backoff, RetryPolicy
from jobd.completer import Counters
from jobd.config import Config, LaneConfig
from jobd.db import DEFAULT_SCHEMA
from jobd.duties.lease_sweep import LeaseSweep
from jobd.duties.metrics_sampler import DEPTH_STATES, take_sample
from jobd.eventloop import SelectLoop
from jobd.jobs import Job
from jobd.localpg import free_port
from jobd.looplag import WINDOW, LoopLag
from jobd.metrics import (
    FAMILY_NAMES,
    NodeCollector,
    NodeMetrics,
    NodeView,
    families,
    handler_labels,
)
from jobd.metrics_http import Server
from jobd.outcomes import Outcome
from jobd.queries import query
from jobd.restarts import RESTART_REASONS, restart_reason
from jobd.run_board import RunBoard
from jobd.wake_routing import WakeRouter
from jobd.worker_metrics import (
    DEAD,
    DONE,
    DURATION_BUCKETS,
    OUTCOMES,
    UNLISTED,
    Histogram,
    WorkObserver,
    WorkTotals,
)
from jobd.workerpool import WORKER_STATES, Slot, WorkerPool, WorkerProcess

daemons = daemon_support.daemons


def exposed_name(family: Metric) -> str:
    """A family's name as scraped (prometheus-client keeps counters' without ``_total``)."""
    return f"{family.name}_total" if family.type == "counter" else family.name
Daemons = Callable[..., Daemon]

BOUNDED_LABELS = {"lane", "handler", "outcome", "state", "reason", "le"}
T0 = datetime(2026, 1, 1, 12, 0, 0).astimezone()


def job(handler: str, run_at: datetime, lease_until: datetime, job_id: int = 1,
        token: int = 7, created_at: datetime | None = None) -> Job:
    return Job.from_row((job_id, token, "default", handler, "{}", 0, run_at, 1, None, None,
                         run_at if created_at is None else created_at, lease_until))


def parsed(exposition: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(exposition)}


def samples(exposition: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted labels: value} of the samples called ``name`` (e.g. jobd_dlq_depth)."""
    found = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def value(exposition: str, name: str, **labels: str) -> float:
    return samples(exposition, name)[tuple(sorted(labels.items()))]


# --- histograms and the report's wire format -----------------------------------------------


def closed_by_server(client: socket.socket) -> bool:
    try:
        return client.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_the_endpoint_serves_a_bounded_number_of_connections_and_times_idle_ones_out() -> None:
    # prometheus-client's own server gave every connection a thread of the supervisor's
    # process, with no timeout: connections that send nothing piled up threads until the
    # unit's task limit stopped the node from spawning workers.
    server = Server(f"127.0.0.1:{free_port()}", NodeCollector(NodeMetrics()), timeout=1.0,
                    max_connections=4)
    server.start()
    try:
        baseline = threading.active_count()
        address = server.handle[0].server_address if server.handle else None
        idle = [socket.create_connection(address) for _ in range(40)]
        wait_until(lambda: sum(closed_by_server(c) for c in idle) >= 36, 10,
                   message="connections beyond the bound closed")
        assert threading.active_count() <= baseline + 4
        wait_until(lambda: all(closed_by_server(c) for c in idle), 10,
                   message="idle connections timed out")
        for client in idle:
            client.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{address[1]}/metrics", timeout=5) as got:
            assert got.status == 200
    finally:
        server.stop()


def test_a_value_on_a_bucket_bound_counts_in_that_bucket() -> None:
    histogram = Histogram((0.1, 1.0))
    for observed in (0.05, 0.1, 0.5, 1.0, 7.0):
        histogram.observe(observed)
    assert histogram.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert histogram.count == 5
    assert histogram.total == pytest.approx(8.65)


def test_histograms_add_up_and_refuse_other_buckets() -> None:
    a, b = Histogram((1.0,)), Histogram((1.0,))
    a.observe(0.5)
    b.observe(2.0)
    a.add(b)
    assert a.cumulative() == [(1.0, 1), (float("inf"), 2)]
    with pytest.raises(ValueError, match="different buckets"):
        a.add(Histogram((2.0,)))


def test_a_report_carries_the_work_totals_through_the_pipe_format() -> None:
    observer = WorkObserver(["send"], visibility_timeout=30.0)
    observer.claimed([job("send", T0, T0 + timedelta(seconds=31))])
    observer.finished("send", DONE, 0.2)
    report = protocol.StatusReport(1, 4, protocol.WorkerMode.RUNNING, True,
                                   {"claimed": 1}, observer.totals)
    back = protocol.StatusReport.parse(report.to_line().rstrip(b"\n"))
    assert back.work is not None
    assert back.work.to_json() == observer.totals.to_json()
    assert back.counters == {"claimed": 1}
    assert protocol.StatusReport.parse(protocol.StatusReport().to_line()).work is None


@pytest.mark.parametrize("work", [
    {"handlers": {"a": {"claimed": 1, "outcomes": [0, 0], "duration": []}}, "pickup": []},
    {"handlers": {"a": {"claimed": -1, "outcomes": [0] * 6,
                        "duration": [0] * (len(DURATION_BUCKETS) + 2)}}},
    {"handlers": {}, "pickup": "no", "stale_completions": 0},
    {"handlers": [], "pickup": [], "stale_completions": 0},
])
def test_a_report_with_malformed_work_is_refused(work: object) -> None:
    line = protocol.StatusReport().to_line().replace(
        b'"work":null', b'"work":' + json.dumps(work).encode())
    with pytest.raises(ValueError):
        protocol.StatusReport.parse(line)


# --- what a worker counts ------------------------------------------------------------------


def test_pickup_delay_is_the_claim_time_minus_run_at_on_the_database_clock() -> None:
    observer = WorkObserver(["send"], visibility_timeout=30.0)
    late = job("send", T0, T0 + timedelta(seconds=32.5))  # claimed 2.5 s after run_at
    observer.claimed([late])
    assert dict(observer.totals.pickup.cumulative())[2.5] == 1
    assert dict(observer.totals.pickup.cumulative())[1.0] == 0
    assert observer.totals.pickup.total == pytest.approx(2.5)


def test_a_job_enqueued_due_in_the_past_waited_from_its_enqueue() -> None:
    """A replayed event keeps its own timestamp as run_at: a day before it was enqueued. It
    was claimed 1.5 s after its enqueue, not a day late."""
    observer = WorkObserver(["send"], visibility_timeout=30.0)
    replayed = job("send", T0 - timedelta(days=1), T0 + timedelta(seconds=31.5),
                   created_at=T0)
    observer.claimed([replayed])
    assert observer.totals.pickup.total == pytest.approx(1.5)


def test_a_pickup_before_run_at_by_clock_rounding_counts_as_zero() -> None:
    observer = WorkObserver(["send"], visibility_timeout=30.0)
    observer.claimed([job("send", T0, T0 + timedelta(seconds=29.9))])
    assert observer.totals.pickup.cumulative()[0][1] == 1
    assert observer.totals.pickup.total == 0.0


def test_handlers_outside_the_allow_list_share_one_label() -> None:
    observer = WorkObserver(["send"], visibility_timeout=30.0)
    observer.claimed([job(name, T0, T0 + timedelta(seconds=30), job_id=n)
                      for n, name in enumerate(["send", "typo1", "typo2"])])
    assert {name: work.claimed for name, work in observer.totals.handlers.items()} == {
        "send": 1, UNLISTED: 2}


# --- aggregation ---------------------------------------------------------------------------


def claimed(totals: WorkTotals, handler: str = "send") -> int:
    return totals.handlers[handler].claimed if handler in totals.handlers else 0


def test_a_node_counter_does_not_go_back_when_a_worker_is_replaced() -> None:
    metrics = NodeMetrics()
    first = WorkObserver(["send"], 30.0)
    first.claimed([job("send", T0, T0 + timedelta(seconds=30), n) for n in range(10)])
    assert claimed(metrics.lane_totals([("default", first.totals)])["default"]) == 10
    # The worker dies; its last report stays in the lane's retired totals, and the new
    # worker starts from zero.
    metrics.retire("default", first.totals)
    second = WorkObserver(["send"], 30.0)
    assert claimed(metrics.lane_totals([("default", second.totals)])["default"]) == 10
    second.claimed([job("send", T0, T0 + timedelta(seconds=30), n) for n in range(3)])
    assert claimed(metrics.lane_totals([("default", second.totals)])["default"]) == 13
    # A worker that reported no totals (metrics off when it started) adds nothing.
    metrics.retire("default", None)
    assert claimed(metrics.lane_totals([])["default"]) == 10


def test_lane_totals_are_copies_not_the_reports_themselves() -> None:
    metrics = NodeMetrics()
    live = WorkObserver(["send"], 30.0)
    live.finished("send", DONE, 1.0)
    summed = metrics.lane_totals([("default", live.totals)])["default"]
    live.finished("send", DONE, 1.0)
    assert summed.handlers["send"].duration.count == 1


# --- the exported families -----------------------------------------------------------------


def empty_view(lanes: tuple[str, ...] = ("default", "mail"),
               handlers: tuple[str, ...] = ("send", "report"), **changes: Any) -> NodeView:
    fields: dict[str, Any] = dict(
        lanes=lanes, handlers=handler_labels(handlers), work={}, workers={}, restarts={},
        lease_expiries={}, listener_connected=False, loop_lag=0.0, sample=None, started=0.0)
    fields.update(changes)
    return NodeView(**fields)


def exposition_of(view: NodeView) -> str:
    metrics = NodeMetrics()
    metrics.publish(view)
    registry = CollectorRegistry()
    registry.register(NodeCollector(metrics))
    return generate_latest(registry).decode()


def test_every_family_is_exported_in_the_listed_order() -> None:
    names = [exposed_name(family) for family in families(empty_view(), now=1.0)]
    assert names == list(FAMILY_NAMES)
    assert set(parsed(exposition_of(empty_view()))) == {
        name.removesuffix("_total") for name in FAMILY_NAMES}


def test_a_fresh_node_exports_zero_for_every_lane_and_handler() -> None:
    text = exposition_of(empty_view())
    lanes, handlers = ("default", "mail"), ("report", "send", UNLISTED)
    pairs = {(("handler", h), ("lane", lane)) for lane in lanes for h in handlers}
    assert samples(text, "jobd_jobs_claimed_total") == dict.fromkeys(pairs, 0.0)
    assert samples(text, "jobd_job_duration_seconds_count") == dict.fromkeys(pairs, 0.0)
    completed = samples(text, "jobd_jobs_completed_total")
    assert set(completed) == {tuple(sorted((*p, ("outcome", o)))) for p in pairs
                              for o in OUTCOMES}
    assert set(completed.values()) == {0.0}
    for name, label, values in [("jobd_queue_depth", "state", DEPTH_STATES),
                                ("jobd_workers", "state", WORKER_STATES),
                                ("jobd_worker_restarts_total", "reason", RESTART_REASONS)]:
        assert samples(text, name) == {
            tuple(sorted([("lane", lane), (label, v)])): 0.0 for lane in lanes for v in values}
    for name in ("jobd_pickup_delay_seconds_count", "jobd_oldest_unclaimed_age_seconds",
                 "jobd_dlq_depth", "jobd_lease_expiries_total", "jobd_stale_completions_total"):
        assert samples(text, name) == {(("lane", lane),): 0.0 for lane in lanes}
    assert value(text, "jobd_listener_connected") == 0.0


def test_labels_are_bounded_and_the_exposition_passes_promtool() -> None:
    observer = WorkObserver(["send"], 30.0)
    observer.claimed([job("send", T0, T0 + timedelta(seconds=31), n) for n in range(4)])
    observer.finished("send", DEAD, 0.003)
    observer.finished("send", DEAD, 0.003)
    view = empty_view(work={"default": observer.totals}, restarts={("default", "crash"): 2},
                      workers={"default": {"running": 2}}, listener_connected=True,
                      loop_lag=0.25)
    text = exposition_of(view)
    assert value(text, "jobd_jobs_claimed_total", lane="default", handler="send") == 4
    assert value(text, "jobd_jobs_completed_total", lane="default", handler="send",
                 outcome="dead") == 2
    assert value(text, "jobd_worker_restarts_total", lane="default", reason="crash") == 2
    assert value(text, "jobd_workers", lane="default", state="running") == 2
    assert value(text, "jobd_supervisor_loop_lag_seconds") == 0.25
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= BOUNDED_LABELS, sample
    checked = check_metrics(text)
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked


def test_a_handler_removed_by_a_reload_keeps_its_series() -> None:
    observer = WorkObserver(["old"], 30.0)
    observer.claimed([job("old", T0, T0 + timedelta(seconds=30))])
    text = exposition_of(empty_view(handlers=("new",), work={"default": observer.totals}))
    assert value(text, "jobd_jobs_claimed_total", lane="default", handler="old") == 1
    assert value(text, "jobd_jobs_claimed_total", lane="default", handler="new") == 0


@pytest.mark.parametrize(("returncode", "kill_reason", "reason"), [
    (-signal.SIGKILL, None, "crash"),
    (1, None, "crash"),
    (-signal.SIGKILL, "hung: no liveness report for 31s", "timeout"),
    (3, None, "boot_failure"),
    (4, None, "wedged"),
    (0, None, "exited"),
])
def test_restart_reasons(returncode: int, kill_reason: str | None, reason: str) -> None:
    assert restart_reason(returncode, kill_reason) == reason
    assert reason in RESTART_REASONS


def test_loop_lag_is_the_worst_lateness_of_the_last_window_or_two() -> None:
    lag = LoopLag(now=0.0)
    lag.woke(due_at=1.0, now=0.5)  # woken early by a pipe: not late
    assert lag.worst(now=0.5) == 0.0
    lag.woke(due_at=1.0, now=1.3)
    lag.woke(due_at=2.0, now=2.1)
    assert lag.worst(now=2.1) == pytest.approx(0.3)
    assert lag.worst(now=WINDOW + 1.0) == pytest.approx(0.3)  # still shown one window on
    assert lag.worst(now=2 * WINDOW + 1.0) == 0.0


def test_a_moment_overdue_before_the_loop_woke_counts_from_its_last_wake() -> None:
    lag = LoopLag(now=1000.0)
    lag.begin(now=1000.0)
    lag.woke(due_at=0.0, now=1000.2)  # a duty due from the start: not 1000 s late
    assert lag.worst(now=1000.2) == pytest.approx(0.2)
    lag.woke(due_at=999.0, now=1003.0)  # a turn of 2.8 s kept it waiting
    assert lag.worst(now=1003.0) == pytest.approx(2.8)


# --- the pool: final reports, restarts, states ----------------------------------------------


def exited_worker(pool: WorkerPool, returncode_signal: int | None, reports: list[bytes]
                  ) -> WorkerProcess:
    """A real process that has ended (by ``returncode_signal``, else exit 0) in slot 0 of
    lane default, whose status pipe holds ``reports`` unread."""
    status_r, status_w = os.pipe()
    wake_r, wake_w = os.pipe()
    for line in reports:
        os.write(status_w, line)
    os.close(status_w)
    os.close(wake_r)
    os.set_blocking(status_r, False)
    code = "pass" if returncode_signal is None else "import time; time.sleep(60)"
    popen = subprocess.Popen([sys.executable, "-c", code])
    if returncode_signal is not None:
        popen.send_signal(returncode_signal)
    popen.wait(timeout=30)
    lane = pool.config.lanes["default"]
    spec = protocol.WorkerSpec(
        worker_id="test-node:default#0:f00d", lane=lane, handlers={}, database_url="",
        schema=DEFAULT_SCHEMA, slot=0, generation=1, status_fd=-1, wake_fd=-1,
        shutdown_timeout=1.0, metrics=True)
    now = time.monotonic()
    board, board_fd = RunBoard.create(lane.concurrency)
    os.close(board_fd)
    process = WorkerProcess(spec, popen, wake_w, status_r, board, started=now, last_seen=now)
    pool.slots[("default", 0)] = Slot(lane, 0, 1, process=process)
    return process


def test_the_final_report_of_a_worker_that_exited_is_read_before_its_pipe_closes() -> None:
    pool = WorkerPool(Config(lanes={"default": LaneConfig("default")}), "", SelectLoop())
    final = WorkObserver(["send"], 30.0)
    final.claimed([job("send", T0, T0 + timedelta(seconds=30), n) for n in range(2)])
    earlier = protocol.StatusReport(work=WorkTotals()).to_line()
    last = protocol.StatusReport(work=final.totals).to_line()
    exited_worker(pool, None, [earlier, last])
    [exited] = pool.reap(stopping=True)
    assert exited.report.work is not None
    assert exited.report.work.to_json() == final.totals.to_json()
    assert pool.restarts == {}  # stopping: nothing is replaced


def test_a_crashed_slot_worker_counts_a_restart_and_its_slot_waits() -> None:
    pool = WorkerPool(Config(lanes={"default": LaneConfig("default")}), "", SelectLoop())
    exited_worker(pool, signal.SIGKILL, [])
    [exited] = pool.reap(stopping=False)
    assert exited.crashed
    assert pool.restarts == {("default", "crash"): 1}
    assert pool.worker_states() == {"default": {"restarting": 1}}


# --- the sampler, against PostgreSQL -------------------------------------------------------


def claim_one(conn: psycopg.Connection, lane: str, now: datetime | None = None) -> Job:
    [claimed_job] = queue.claim(conn, lane, "test-worker", 1, 30.0, now=now)
    return claimed_job


def fail(conn: psycopg.Connection, failed: Job, delay: float) -> queue.FailOutcome:
    return queue.fail(conn, [queue.Failure(failed.lease, "boom", delay, 8)])


def test_the_sampler_counts_each_state_of_a_lane(conn: psycopg.Connection) -> None:
    start = db_now(conn)
    jobd.enqueue(conn, "h", lane="a", run_at=start - timedelta(seconds=100))
    fail(conn, claim_one(conn, "a"), delay=3600)  # retrying in an hour
    jobd.enqueue(conn, "h", lane="a", run_at=start - timedelta(seconds=90), max_attempts=1)
    assert fail(conn, claim_one(conn, "a"), delay=1).dead  # in the dead-letter queue
    for seconds in (50, 40, 30):
        jobd.enqueue(conn, "h", lane="a", run_at=start - timedelta(seconds=seconds))
    claim_one(conn, "a")  # the one due for 50 s is claimed
    for _ in range(2):
        jobd.enqueue(conn, "h", lane="a", run_at=start + timedelta(hours=1))
    jobd.enqueue(conn, "h", lane="unsampled")
    enqueued_when_due(conn)

    sample = take_sample(conn, ["a", "b"], now=start)
    # A lane that has jobs is counted though not asked for (no config names it).
    assert set(sample.lanes) == {"a", "b", "unsampled"}
    assert sum(sample.lanes["unsampled"].depth.values()) == 1
    a = sample.lanes["a"]
    assert a.depth == {"due": 2, "scheduled": 2, "retrying": 1, "claimed": 1}
    assert a.dead == 1
    assert a.oldest_unclaimed_age == pytest.approx(40.0)
    b = sample.lanes["b"]
    assert b.depth == dict.fromkeys(DEPTH_STATES, 0)
    assert (b.dead, b.oldest_unclaimed_age) == (0, 0.0)
    # Two hours on, everything waiting is due, the retry included.
    later = take_sample(conn, ["a"], now=start + timedelta(hours=2)).lanes["a"]
    assert later.depth == {"due": 5, "scheduled": 0, "retrying": 0, "claimed": 1}
    assert later.oldest_unclaimed_age == pytest.approx(7240.0)


def test_a_job_enqueued_due_in_the_past_waits_from_its_enqueue(
    conn: psycopg.Connection,
) -> None:
    """A replayed event keeps its own timestamp as run_at, a day ago: the oldest-wait gauge
    and `jobd status` count from its enqueue, so they do not fire the stale-queue alert."""
    start = db_now(conn)
    jobd.enqueue(conn, "h", lane="replay", run_at=start - timedelta(days=1))
    sampled = take_sample(conn, ["replay"], now=start + timedelta(seconds=5)).lanes["replay"]
    assert sampled.oldest_unclaimed_age == pytest.approx(5.0, abs=1.0)
    status = {s.lane: s for s in views.lane_status(conn)}["replay"]
    assert status.oldest_unclaimed_age < 60


def test_the_pickup_percentiles_of_a_job_enqueued_due_in_the_past_count_from_its_enqueue(
    conn: psycopg.Connection,
) -> None:
    start = db_now(conn)
    jobd.enqueue(conn, "h", lane="replay", run_at=start - timedelta(days=1))
    claimed = claim_one(conn, "replay")
    queue.complete(conn, [claimed.lease])
    latency = views.lane_latency(conn, ["replay"], window=60, sample=100)["replay"]
    assert latency.finished == 1
    assert latency.pickup_p99 is not None and latency.pickup_p99 < 60


def test_a_lane_no_config_names_is_exported_so_an_alert_can_see_it(
    conn: psycopg.Connection,
) -> None:
    """JobdLaneUnserved fires on due jobs with no live worker: a lane that no node's config
    has must still have its depth exported, by every node."""
    jobd.enqueue(conn, "h", lane="ghost")
    text = exposition_of(empty_view(sample=take_sample(conn, ["default", "mail"])))
    assert value(text, "jobd_queue_depth", lane="ghost", state="due") == 1.0
    assert value(text, "jobd_queue_depth", lane="default", state="due") == 0.0


def test_pauses_are_exported_per_lane_and_handler(conn: psycopg.Connection) -> None:
    jobd.pause(conn, "default")
    jobd.pause(conn, "mail", "report")
    text = exposition_of(empty_view(sample=take_sample(conn, ["default", "mail"])))
    assert samples(text, "jobd_lane_paused") == {
        (("handler", ""), ("lane", "default")): 1.0,
        (("handler", ""), ("lane", "mail")): 0.0,
        (("handler", "report"), ("lane", "mail")): 1.0}
    jobd.resume(conn, "default")
    text = exposition_of(empty_view(sample=take_sample(conn, ["default", "mail"])))
    assert value(text, "jobd_lane_paused", lane="default", handler="") == 0.0


def test_paused_jobs_are_not_counted_as_waiting_for_the_pickup_slo(
    conn: psycopg.Connection,
) -> None:
    # The incident runbook pauses the poison handler: its jobs then wait by the operator's
    # choice, and counted, they kept the pickup SLO alert firing while the lane served the
    # rest of its work in milliseconds.
    start = db_now(conn)
    jobd.enqueue(conn, "poison", lane="a", run_at=start - timedelta(seconds=300))
    jobd.enqueue(conn, "h", lane="a", run_at=start - timedelta(seconds=2))
    conn.execute("UPDATE jobs SET created_at = run_at")  # enqueued when due

    def age() -> float:
        return take_sample(conn, ["a"], now=start).lanes["a"].oldest_unclaimed_age

    assert age() == pytest.approx(300.0, abs=1.0)
    jobd.pause(conn, "a", "poison")
    assert age() == pytest.approx(2.0, abs=1.0)
    jobd.pause(conn, "a")
    assert age() == 0.0
    jobd.resume(conn, "a")
    jobd.resume(conn, "a", "poison")
    assert age() == pytest.approx(300.0, abs=1.0)


def test_the_dlq_depth_of_a_lane_without_live_jobs_stays_exported(
    conn: psycopg.Connection,
) -> None:
    # The retention duty forgets the priorities of lanes without live jobs; the lane's dead
    # jobs stay, and so must its DLQ depth, in the gauges no config names it in.
    jobd.enqueue(conn, "h", lane="x")
    assert dlq.quarantine(conn, "h", "x") == {"x": 1}
    conn.execute("SELECT forget_unused_priorities('x')")
    text = exposition_of(empty_view(sample=take_sample(conn, ["default"])))
    assert value(text, "jobd_dlq_depth", lane="x") == 1.0


def test_expiries_swept_from_a_lane_this_node_does_not_configure_are_exported() -> None:
    text = exposition_of(empty_view(lanes=("default",), lease_expiries={"default": 0, "x": 3}))
    assert value(text, "jobd_lease_expiries_total", lane="x") == 3.0
    assert value(text, "jobd_lease_expiries_total", lane="default") == 0.0


def test_a_running_vacuum_is_not_taken_for_a_transaction_holding_back_vacuum(
        db_url: str, conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE public.slow_to_vacuum AS SELECT n FROM generate_series(1, 20000) n")
    conn.execute("DELETE FROM public.slow_to_vacuum")
    with psycopg.connect(db_url, autocommit=True) as vacuuming:
        # Throttled to a crawl: the VACUUM stays in pg_stat_progress_vacuum meanwhile.
        vacuuming.execute("SET vacuum_cost_delay = '100ms'")
        vacuuming.execute("SET vacuum_cost_limit = 1")
        pid = vacuuming.info.backend_pid
        runner = threading.Thread(target=lambda: suppress_cancel(
            vacuuming, "VACUUM public.slow_to_vacuum"))
        runner.start()
        try:
            wait_until(lambda: conn.execute(
                "SELECT count(*) FROM pg_stat_progress_vacuum WHERE pid = %s",
                (pid,)).fetchone() == (1,), 10, message="the vacuum to run")
            sample = take_sample(conn, [])
            assert (sample.oldest_transaction_age, sample.xmin_horizon_age) == (0.0, 0)
            assert conn.execute(query("horizon_holders")).fetchall() == []
        finally:
            conn.execute("SELECT pg_cancel_backend(%s)", (pid,))
            runner.join(10)


def suppress_cancel(conn: psycopg.Connection, statement: str) -> None:
    try:
        conn.execute(statement)
    except psycopg.errors.QueryCanceled:
        pass  # the test cancels it when done


def test_the_sampler_sees_a_transaction_that_holds_back_vacuum(
        db_url: str, conn: psycopg.Connection) -> None:
    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute("SELECT txid_current()")
        for _ in range(5):  # transaction ids spent since the holder took its own
            conn.execute("SELECT txid_current()")
        row = conn.execute("SELECT extract(epoch FROM now() - xact_start)::float8 "
                           "FROM pg_stat_activity WHERE pid = %s",
                           (holder.info.backend_pid,)).fetchone()
        assert row is not None
        held = take_sample(conn, [])
        assert held.oldest_transaction_age >= row[0] > 0
        assert held.xmin_horizon_age >= 5
        holder.execute("COMMIT")
    assert take_sample(conn, []).oldest_transaction_age == 0.0


def test_the_sampler_reports_dead_tuples_and_the_notification_queue(
        conn: psycopg.Connection) -> None:
    jobd.enqueue_many(conn, [jobd.JobSpec("h") for _ in range(20)])
    conn.execute("DELETE FROM jobs")
    wait_until(lambda: take_sample(conn, []).jobs_dead_tuples >= 20, timeout=20,
               interval=0.2, message="the deleted rows in pg_stat_user_tables")
    assert 0.0 <= take_sample(conn, []).notification_queue_usage < 1.0


def test_the_lease_sweep_counts_expiries_per_lane_and_forgets_a_rolled_back_turn(
        conn: psycopg.Connection) -> None:
    start = db_now(conn)
    jobd.enqueue(conn, "h", lane="a", run_at=start - timedelta(minutes=5))
    claim_one(conn, "a", now=start - timedelta(minutes=2))  # leased until 90 s ago
    policy = RetryPolicy(Backoff(1.0, 1.0), 8)
    sweep = LeaseSweep(lambda: 10.0, lambda _lane: policy, WakeRouter(), lambda: ["a"])
    with conn.transaction(force_rollback=True):
        sweep.run(conn, 0.0)
    sweep.rolled_back()
    assert sweep.expired == {"a": 0}
    sweep.run(conn, 0.0)
    assert sweep.expired == {"a": 1}
    assert recovery.sweep_expired_leases(conn, lambda _lane: policy).expired_by_lane == {}


# --- the worker's counting, driven in-process ----------------------------------------------


@pytest.fixture
def counting_worker(db_url: str) -> Iterator[worker.Worker]:
    """A worker loop with metrics on and no handler threads, connected, not started."""
    fds = [*os.pipe(), *os.pipe()]
    spec = protocol.WorkerSpec(
        worker_id="test-node:default#0:beef", lane=LaneConfig("default"),
        handlers={"send": "x:y"}, database_url=db_url, schema=DEFAULT_SCHEMA, slot=0,
        generation=1, status_fd=fds[1], wake_fd=fds[2], shutdown_timeout=1.0, metrics=True)
    subject = worker.Worker(spec, {})
    subject._ensure_connection()
    yield subject
    subject.link.close()
    if subject.settler is not None:
        subject.settler.close()
    for fd in fds:
        os.close(fd)


def test_written_outcomes_count_per_handler_with_their_run_times(
        counting_worker: worker.Worker, conn: psycopg.Connection) -> None:
    for handler in ("send", "send", "send", "other"):
        jobd.enqueue(conn, handler, max_attempts=1)
    done, dead, lost, unlisted = queue.claim(conn, "default", "test-node:default#0:beef", 4,
                                             30.0)
    stale = job(lost.handler, lost.run_at, lost.lease_until, lost.id, token=-1)
    counting_worker.counters.count_claimed([done, dead, lost, unlisted])
    for outcome in (Outcome(done, None, seconds=0.002), Outcome(dead, "boom", seconds=0.2),
                    Outcome(stale, None, seconds=0.02), Outcome(unlisted, None)):
        counting_worker.completer.add(outcome)
    counting_worker._settle_and_claim(claim=False)
    assert counting_worker.completer.pending == []
    work = counting_worker.counters.work_totals()
    assert work is not None
    send = work.handlers["send"]
    assert send.claimed == 3
    assert {name: send.outcome(name) for name in OUTCOMES} == {
        "done": 1, "failed": 0, "dead": 1, "lease_lost": 1, "released": 0, "cancelled": 0}
    assert send.duration.count == 3
    assert send.duration.total == pytest.approx(0.222)
    assert work.handlers[UNLISTED].outcome("done") == 1
    assert work.stale_completions == 1
    assert work.pickup.count == 4


def test_a_worker_without_metrics_reports_no_work(db_url: str) -> None:
    spec = protocol.WorkerSpec(
        worker_id="w", lane=LaneConfig("default"), handlers={}, database_url=db_url,
        schema=DEFAULT_SCHEMA, slot=0, generation=1, status_fd=-1, wake_fd=-1,
        shutdown_timeout=1.0)
    counters = Counters.for_spec(spec)
    counters.count_claimed([job("send", T0, T0 + timedelta(seconds=30))])
    assert (counters.claimed, counters.work_totals()) == (1, None)


# --- the daemon ----------------------------------------------------------------------------


HANDLERS_MODULE = '''\
"""Handlers for the metrics tests."""


def quick(job):
    pass


def boom(job):
    raise RuntimeError("boom")


def crash(job):
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
'''


def metrics_config(port: int, lanes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    config = make_config(lanes, handlers={"quick": "metricshandlers:quick",
                                          "boom": "metricshandlers:boom",
                                          "crash": "metricshandlers:crash"})
    config["metrics"] = {"listen": f"127.0.0.1:{port}"}
    return config


def start_daemon(daemons: Daemons, tmp_path: Path, lanes: dict[str, dict[str, Any]]
                 ) -> tuple[Daemon, str]:
    (tmp_path / "metricshandlers.py").write_text(HANDLERS_MODULE)
    port = free_port()
    daemon = daemons(metrics_config(port, lanes))
    daemon.wait_for_log("serving metrics")
    return daemon, f"127.0.0.1:{port}"


def scrape(target: str) -> str:
    return fetch(f"http://{target}/metrics")


@pytest.mark.slow
def test_a_starting_daemon_exports_every_family_at_zero(daemons: Daemons, tmp_path: Path
                                                        ) -> None:
    daemon, target = start_daemon(daemons, tmp_path, {"default": {}, "parked": {"workers": 0}})
    text = scrape(target)
    assert set(parsed(text)) == {name.removesuffix("_total") for name in FAMILY_NAMES}
    for lane in ("default", "parked"):
        for handler in ("boom", "quick", UNLISTED):
            assert value(text, "jobd_jobs_claimed_total", lane=lane, handler=handler) == 0
            for outcome in OUTCOMES:
                assert value(text, "jobd_jobs_completed_total", lane=lane, handler=handler,
                             outcome=outcome) == 0
        for state in DEPTH_STATES:
            assert value(text, "jobd_queue_depth", lane=lane, state=state) == 0
        assert value(text, "jobd_dlq_depth", lane=lane) == 0
    # The worker reports within its first second; the listener is up by then.
    wait_until(lambda: value(scrape(target), "jobd_workers", lane="default",
                             state="running") == 1, timeout=15,
               message=lambda: f"a running worker\n{daemon.tail()}")
    assert value(scrape(target), "jobd_listener_connected") == 1
    assert value(scrape(target), "jobd_workers", lane="parked", state="running") == 0
    assert not daemon.events("metrics are not served by this version; metrics.listen is "
                             "ignored")
    # A reload keeps the server where it is: a new address needs a restart.
    moved = metrics_config(free_port(), {"default": {}, "parked": {"workers": 0}})
    mark = daemon.reload(moved)
    daemon.wait_for_log("metrics.listen changes take effect on restart", since=mark)
    daemon.wait_for_log("config reloaded", since=mark)
    assert value(scrape(target), "jobd_listener_connected") == 1


def test_a_starting_daemon_reports_no_loop_lag_older_than_itself(
        daemons: Daemons, tmp_path: Path) -> None:
    # The duties start due at once (moment 0 of the monotonic clock): counted as lateness,
    # the first turns reported the machine's uptime as the loop's lag for 5 to 10 s.
    daemon, target = start_daemon(daemons, tmp_path, {"default": {}})

    def lag_within_life() -> bool:
        text = scrape(target)
        lag = samples(text, "jobd_supervisor_loop_lag_seconds").get(())
        if lag is None:
            return False  # nothing published before the loop's first turn
        # No lateness is older than the loop itself.
        assert lag <= time.monotonic() - daemon.started_at, lag
        return value(text, "jobd_workers", lane="default", state="running") == 1

    wait_until(lag_within_life, timeout=15,
               message=lambda: f"a running worker\n{daemon.tail()}")


def http_answer(target: str, method: str) -> tuple[int, dict[str, str], bytes]:
    """One request on a raw socket: the status, the headers (lower-case names) and every
    byte after them, so a body sent to a HEAD shows (http.client would not read it)."""
    host, port = target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(f"{method} /metrics HTTP/1.1\r\nHost: {target}\r\n"
                     "Connection: close\r\n\r\n".encode())
        received = b""
        while chunk := sock.recv(65536):  # the server closes after its answer
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(":", 1) for line in lines)
    return (int(status.split()[1]),
            {name.lower(): value.strip() for name, value in headers.items()}, body)


def test_the_endpoint_answers_head_as_get_without_the_body(daemons: Daemons, tmp_path: Path
                                                           ) -> None:
    """Load balancers and uptime checks probe with HEAD, which prometheus-client's
    application refused (405)."""
    _, target = start_daemon(daemons, tmp_path, {"default": {"workers": 0}})
    status, got, body = http_answer(target, "GET")
    assert status == 200 and body and "jobd_workers" in body.decode()
    status, headed, nothing = http_answer(target, "HEAD")
    assert (status, nothing) == (200, b"")
    assert headed["content-type"] == got["content-type"]
    # The length of the body a GET gets, not 0 (a gauge such as the loop lag may have
    # changed by a digit or two in between).
    assert got["content-length"] == str(len(body))
    assert abs(int(headed["content-length"]) - len(body)) < len(body) / 100
    status, allowed, _ = http_answer(target, "OPTIONS")
    assert status == 200 and "HEAD" in allowed["allow"].split(",")


def test_an_address_in_use_stops_the_start_with_one_line(daemons: Daemons, tmp_path: Path
                                                          ) -> None:
    """Exit code 1, a runtime failure that systemd's Restart=on-failure tries again (the
    port held by an old daemon still stopping, an address not up yet at boot); exit code 2
    is in the unit's RestartPreventExitStatus, which left the node down for good."""
    (tmp_path / "metricshandlers.py").write_text(HANDLERS_MODULE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = daemons(metrics_config(port, {"default": {}}))
        assert daemon.wait_exit(timeout=30) == 1
    lines = daemon.log_path.read_text().splitlines()
    assert lines == [f"jobd: metrics.listen 127.0.0.1:{port}: cannot listen: "
                     "Address already in use"]


@pytest.mark.slow
def test_a_counter_does_not_go_back_when_a_worker_is_killed(
        daemons: Daemons, tmp_path: Path, conn: psycopg.Connection) -> None:
    daemon, target = start_daemon(daemons, tmp_path, {"default": {}})
    [pid] = daemon.wait_workers_started("default", 1).values()
    jobd.enqueue_many(conn, [jobd.JobSpec("quick") for _ in range(5)])

    def claimed_now() -> float:
        return value(scrape(target), "jobd_jobs_claimed_total", lane="default",
                     handler="quick")

    wait_until(lambda: claimed_now() == 5, timeout=15,
               message=lambda: f"5 claims in the metrics\n{daemon.tail()}")
    mark = daemon.mark()
    os.kill(pid, signal.SIGKILL)
    daemon.wait_for_log("worker spawned", since=mark, lane="default")
    wait_until(lambda: value(scrape(target), "jobd_worker_restarts_total", lane="default",
                             reason="crash") == 1, timeout=5, message="the restart counted")
    text = scrape(target)
    assert value(text, "jobd_jobs_claimed_total", lane="default", handler="quick") == 5
    assert value(text, "jobd_jobs_completed_total", lane="default", handler="quick",
                 outcome="done") == 5
    daemon.wait_workers_started("default", 1, since=mark)
    jobd.enqueue_many(conn, [jobd.JobSpec("quick") for _ in range(3)])
    wait_until(lambda: claimed_now() == 8, timeout=15,
               message=lambda: f"8 claims in the metrics\n{daemon.tail()}")


def test_jobs_that_kill_their_worker_count_as_failed_and_dead(
        daemons: Daemons, tmp_path: Path, conn: psycopg.Connection) -> None:
    """Crash attribution fails the job that killed its worker: the dead worker cannot count
    that outcome, so the supervisor does. Before, a crash loop showed no failures at all in
    jobd_jobs_completed_total, `jobd status` and `jobd top` while the DLQ filled."""
    daemon, target = start_daemon(daemons, tmp_path, {"default": {"max_attempts": 2}})
    daemon.wait_workers_started("default", 1)
    job_id = jobd.enqueue(conn, "crash")

    def outcomes() -> tuple[float, float]:
        text = scrape(target)
        return (value(text, "jobd_jobs_completed_total", lane="default", handler="crash",
                      outcome="failed"),
                value(text, "jobd_jobs_completed_total", lane="default", handler="crash",
                      outcome="dead"))

    wait_until(lambda: outcomes() == (1, 1), timeout=30,
               message=lambda: f"one failed and one dead, got {outcomes()}\n{daemon.tail()}")
    assert daemon_support.job_state(conn, job_id) == "dead"

    def heartbeat_counters() -> dict[str, int]:
        row = conn.execute("SELECT counters -> 'default' FROM nodes").fetchone()
        return {} if row is None or row[0] is None else dict(row[0])

    # The node's heartbeat, whose rates `jobd status` and `jobd top` show, counts them too.
    wait_until(lambda: (heartbeat_counters().get("failed"),
                        heartbeat_counters().get("dead")) == (1, 1), timeout=15,
               message=lambda: f"the heartbeat's counters, got {heartbeat_counters()}")


@pytest.mark.slow
def test_prometheus_scrapes_the_daemon_as_jobs_run_fail_and_die(
        daemons: Daemons, tmp_path: Path, conn: psycopg.Connection) -> None:
    lanes = {"default": {"max_attempts": 2}, "parked": {"workers": 0}}
    daemon, target = start_daemon(daemons, tmp_path, lanes)
    prometheus = Prometheus(tmp_path, target).start()
    try:
        def context() -> str:
            return f"{prometheus.tail()}\n{daemon.tail()}"

        prometheus.wait_value('up{job="jobd"}', 1, context=context)
        claimed = 'jobd_jobs_claimed_total{lane="default",handler="quick"}'
        prometheus.wait_value(claimed, 0, context=context)

        # A due job nobody serves: the depth shows it, and its wait grows.
        jobd.enqueue(conn, "quick", lane="parked")
        prometheus.wait_value('jobd_queue_depth{lane="parked",state="due"}', 1,
                              context=context)
        age = 'jobd_oldest_unclaimed_age_seconds{lane="parked"}'
        first = wait_until(lambda: prometheus.value(age), 30, message="a waiting age")
        wait_until(lambda: (prometheus.value(age) or 0) > first, 30,
                   message=lambda: f"{age} to grow past {first}\n{context()}")
        jobd.enqueue(conn, "quick", run_at=db_now(conn) + timedelta(hours=1))
        prometheus.wait_value('jobd_queue_depth{lane="default",state="scheduled"}', 1,
                              context=context)

        # Jobs that run: claimed, done, timed, picked up.
        jobd.enqueue_many(conn, [jobd.JobSpec("quick") for _ in range(5)])
        prometheus.wait_value(claimed, 5, context=context)
        prometheus.wait_value(
            'jobd_jobs_completed_total{lane="default",handler="quick",outcome="done"}', 5,
            context=context)
        prometheus.wait_value(
            'jobd_job_duration_seconds_count{lane="default",handler="quick"}', 5,
            context=context)

        # A job that fails twice: one retry, then the dead-letter queue.
        jobd.enqueue(conn, "boom")
        boom = 'jobd_jobs_completed_total{{lane="default",handler="boom",outcome="{}"}}'
        prometheus.wait_value(boom.format("failed"), 1, context=context)
        prometheus.wait_value(boom.format("dead"), 1, context=context)
        prometheus.wait_value('jobd_jobs_claimed_total{lane="default",handler="boom"}', 2,
                              context=context)
        prometheus.wait_value('jobd_dlq_depth{lane="default"}', 1, context=context)
        prometheus.wait_value('jobd_pickup_delay_seconds_count{lane="default"}', 7,
                              context=context)
        assert prometheus.value('jobd_queue_depth{lane="default",state="due"}') == 0
        assert prometheus.value('sum(jobd_worker_restarts_total)') == 0
        rate = prometheus.value(f"increase({claimed}[1m])")
        assert rate is not None and rate > 0
    finally:
        prometheus.stop()

    checked = check_metrics(scrape(target))
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked


ALERT_RULES = Path(__file__).resolve().parent.parent / "contrib" / "prometheus" / "alerts.yml"


def lanes_alerted(prometheus: Prometheus, name: str) -> list[str]:
    return sorted(alert["labels"].get("lane", "") for alert in prometheus.alerts(name))


@pytest.mark.slow
def test_the_shipped_rules_see_an_unserved_lane_and_a_fleet_that_stopped_exporting(
        daemons: Daemons, tmp_path: Path, conn: psycopg.Connection) -> None:
    # The rules on a real scrape, beside promtool's series: a due job no worker serves makes
    # JobdLaneUnserved pend. Once the only daemon is gone, every jobd series goes stale,
    # that alert with them, though the job still waits: JobdMetricsAbsent must take over.
    daemon, target = start_daemon(daemons, tmp_path, {"default": {}, "parked": {"workers": 0}})
    prometheus = Prometheus(tmp_path, target, rules=ALERT_RULES).start()
    try:
        def context() -> str:
            return f"{prometheus.tail()}\n{daemon.tail()}"

        prometheus.wait_value('up{job="jobd"}', 1, context=context)
        jobd.enqueue(conn, "quick", lane="parked")
        wait_until(lambda: lanes_alerted(prometheus, "JobdLaneUnserved") == ["parked"], 30,
                   interval=0.25, message=lambda: f"JobdLaneUnserved for parked\n{context()}")
        assert prometheus.alerts("JobdMetricsAbsent") == []

        daemon.stop()
        prometheus.wait_value('up{job="jobd"}', 0, context=context)
        wait_until(lambda: prometheus.alerts("JobdMetricsAbsent"), 30, interval=0.25,
                   message=lambda: f"JobdMetricsAbsent once the daemon is gone\n{context()}")
        assert lanes_alerted(prometheus, "JobdLaneUnserved") == []
    finally:
        prometheus.stop()


def test_only_workers_that_take_jobs_count_as_live_in_the_heartbeat() -> None:
    """`jobd status` reads the heartbeat's live workers; the unserved-lane alert counts only
    `jobd_workers` starting or running. A hung or retiring worker counted as live there
    had status say the lane was served while the alert fired."""
    pool = WorkerPool(Config(lanes={"default": LaneConfig("default")}), "", SelectLoop())
    hung = exited_worker(pool, None, [])
    hung.reported = True
    hung.kill_reason = "silent past worker_timeout"
    retiring = pool.slots.pop(("default", 0)).process
    assert retiring is not None
    retiring.retiring = True
    pool.retiring.append(retiring)
    assert pool.snapshot()[0] == {"default": 0}
    assert pool.worker_states() == {"default": {"retiring": 1}}
    hung = exited_worker(pool, None, [])
    hung.kill_reason = "silent past worker_timeout"
    assert pool.snapshot()[0] == {"default": 0}
    hung.kill_reason = None
    assert pool.snapshot()[0] == {"default": 1}  # starting: no report yet
    hung.reported = True
    hung.report = protocol.StatusReport(mode=protocol.WorkerMode.DRAINING)
    assert pool.snapshot()[0] == {"default": 0}
    hung.report = protocol.StatusReport(mode=protocol.WorkerMode.RUNNING)
    assert pool.snapshot()[0] == {"default": 1}


def test_a_crash_explained_after_its_slot_respawned_still_comes_off_the_count() -> None:
    """Crash attribution may settle a crash after the restart delay (250 ms) is over: it
    waits up to a second for the dead worker's backends. Skipped then, every explained
    crash grew the slot's failures, and a steady poison doubled its restart delays."""
    pool = WorkerPool(Config(lanes={"default": LaneConfig("default")}), "", SelectLoop())
    exited_worker(pool, signal.SIGKILL, [])
    [exited] = pool.reap(stopping=False)
    slot = pool.slots[("default", 0)]
    assert slot.backoff.failures == 1
    # The slot's next worker, up before the forgive (a process of another pool stands in).
    slot.process = exited_worker(
        WorkerPool(Config(lanes={"default": LaneConfig("default")}), "", SelectLoop()),
        None, [])
    pool.forgive_crash(exited.worker_id)
    assert slot.backoff.failures == 0
