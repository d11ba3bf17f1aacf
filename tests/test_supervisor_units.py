"""The supervisor's pure parts: restart backoff, exit descriptions, how the worker pool takes
an exit and a failed spawn (with real child processes), wake-up payloads and the systemd
notification protocol (against a real AF_UNIX datagram socket)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog

from jobd import workerpool
from jobd.config import RESTART_BASE, Config, LaneConfig
from jobd.eventloop import SelectLoop
from jobd.protocol import WorkerSpec, describe_exit
from jobd.restarts import SlotBackoff, restart_reason
from jobd.run_board import RunBoard
from jobd.sdnotify import Notifier
from jobd.wakeup import Wakeup, parse_payload
from jobd.workerpool import Slot, WorkerPool, WorkerProcess

# --- SlotBackoff ---------------------------------------------------------------------------


def test_restart_delay_doubles_from_one_second_up_to_a_minute() -> None:
    backoff = SlotBackoff()
    delays = [backoff.record_exit(uptime=0.5) for _ in range(9)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert backoff.failures == 9


def test_a_healthy_uptime_resets_the_slot() -> None:
    backoff = SlotBackoff()
    for _ in range(4):
        backoff.record_exit(uptime=1.0)
    assert backoff.record_exit(uptime=30.0) == 0.0
    assert backoff.failures == 0
    assert backoff.record_exit(uptime=29.9) == 1.0
    assert backoff.record_exit(uptime=0.0) == 2.0


def test_custom_base_cap_and_healthy_uptime() -> None:
    backoff = SlotBackoff(base=0.5, cap=3.0, healthy_uptime=5.0)
    assert [backoff.record_exit(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.record_exit(5.0) == 0.0
    assert backoff.record_exit(4.9) == 0.5


def test_a_crash_pinned_on_its_job_does_not_grow_the_backoff() -> None:
    backoff = SlotBackoff()
    assert backoff.record_exit(0.5) == 1.0  # died holding several jobs: suspects
    for _ in range(5):  # each suspect that kills its worker alone is pinned, then forgiven
        assert backoff.record_exit(0.5) == 2.0
        assert backoff.forgive() == 1.0
    assert backoff.failures == 1
    assert backoff.record_exit(0.5) == 2.0  # an unpinned crash grows it as before


def test_a_long_crash_loop_stays_at_the_cap() -> None:
    backoff = SlotBackoff()
    for _ in range(2000):
        delay = backoff.record_exit(0.0)
    assert delay == 60.0


# --- describe_exit -------------------------------------------------------------------------


@pytest.mark.parametrize(("returncode", "description"), [
    (-signal.SIGKILL, "killed by SIGKILL"),
    (-signal.SIGTERM, "killed by SIGTERM"),
    (-signal.SIGABRT, "killed by SIGABRT"),
    (-signal.SIGSEGV, "killed by SIGSEGV"),
    (-200, "killed by signal 200"),
    (0, "exit code 0"),
    (1, "exit code 1"),
    (3, "exit code 3 (boot failure)"),
    (4, "exit code 4 (wedged by timed-out jobs)"),
])
def test_describe_exit(returncode: int, description: str) -> None:
    assert describe_exit(returncode) == description


def test_status_0_without_a_shutdown_is_told_apart_and_counts_as_a_crash() -> None:
    assert describe_exit(0, shut_down=False) == "exit code 0 without shutting down"
    assert describe_exit(1, shut_down=False) == "exit code 1"
    assert restart_reason(0, None, shut_down=True) == "exited"
    assert restart_reason(0, None, shut_down=False) == "crash"


# --- the worker pool: exits --------------------------------------------------------------


def one_slot_pool() -> WorkerPool:
    lane = LaneConfig("default", workers=1, concurrency=1)
    pool = WorkerPool(Config(lanes={"default": lane}), "", SelectLoop())
    pool.build()
    return pool


def exited_with_status_0(pool: WorkerPool, shut_down: bool) -> Slot:
    """Put in the pool's slot a worker that has exited with status 0, its run board marked
    as a worker's shutdown marks it, or not (a handler's os._exit(0))."""
    slot = pool.slots[("default", 0)]
    board, board_fd = RunBoard.create(slot.lane.concurrency)
    if shut_down:
        worker_side = RunBoard(board_fd, slot.lane.concurrency)
        worker_side.mark_shut_down()
        worker_side.close()
    os.close(board_fd)
    status_r, status_w = os.pipe()
    wake_r, wake_w = os.pipe()
    for fd in (status_w, wake_r):
        os.close(fd)
    os.set_blocking(status_r, False)
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait(timeout=30)
    spec = WorkerSpec(worker_id="test-node:default#0:0", lane=slot.lane, handlers={},
                      database_url="", schema="jobd", slot=0, generation=1, status_fd=-1,
                      wake_fd=-1, shutdown_timeout=1.0)
    now = time.monotonic()
    slot.process = WorkerProcess(spec, popen, wake_w, status_r, board, started=now,
                                 last_seen=now)
    return slot


def test_status_0_without_the_shutdown_mark_is_a_crash_and_the_slot_backs_off() -> None:
    pool = one_slot_pool()
    slot = exited_with_status_0(pool, shut_down=False)
    [exited] = pool.reap(stopping=False)
    assert exited.crashed  # crash attribution fails its job, spending the attempt
    assert exited.reason == "exit code 0 without shutting down"
    assert pool.restarts == {("default", "crash"): 1}
    assert slot.backoff.failures == 1
    assert slot.spawn_at >= time.monotonic() + 0.1  # the base delay (250 ms), not at once


def test_status_0_after_the_workers_shutdown_is_a_clean_exit() -> None:
    pool = one_slot_pool()
    slot = exited_with_status_0(pool, shut_down=True)
    [exited] = pool.reap(stopping=False)
    assert not exited.crashed  # its jobs are given back
    assert exited.reason == "exit code 0"
    assert pool.restarts == {("default", "exited"): 1}
    assert slot.backoff.failures == 0
    assert slot.spawn_at <= time.monotonic()


def test_an_exited_workers_final_report_that_cannot_be_read_is_logged() -> None:
    """Its last counts are missing from the node's totals: the operator is told, and the
    exit is taken as any other."""
    pool = one_slot_pool()
    slot = exited_with_status_0(pool, shut_down=True)
    assert slot.process is not None
    os.close(slot.process.status_r)
    # A directory: reading it fails with EISDIR, as a broken status pipe would fail.
    slot.process.status_r = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    with structlog.testing.capture_logs() as logs:
        [exited] = pool.reap(stopping=False)
    assert exited.reason == "exit code 0"
    [warning] = [r for r in logs if r["event"] == "could not read an exited worker's final report"]
    assert warning["log_level"] == "warning" and warning["lane"] == "default"
    assert "Is a directory" in warning["error"]


def test_a_worker_is_judged_hung_by_the_worker_timeout_it_was_started_with() -> None:
    """Its loop gives a silent connection up before the worker_timeout it was started with
    (db.worker_reply_cap). A reload that shortens worker_timeout retires it, but it may run
    on for long, finishing its jobs: judged by the shorter timeout, a wait its loop was
    allowed got it aborted as hung, its running job failed as if it had killed it."""
    lane = LaneConfig("default", workers=1, concurrency=1)
    pool = WorkerPool(Config(lanes={"default": lane}, worker_timeout=60.0), "", SelectLoop())
    pool.build()
    slot = pool.slots[("default", 0)]
    board, board_fd = RunBoard.create(1)
    os.close(board_fd)
    status_r, status_w = os.pipe()
    wake_r, wake_w = os.pipe()
    for fd in (status_w, wake_r):
        os.close(fd)
    popen = subprocess.Popen(["sleep", "60"])
    spec = WorkerSpec(worker_id="test-node:default#0:0", lane=lane, handlers={},
                      database_url="", schema="jobd", slot=0, generation=1, status_fd=-1,
                      wake_fd=-1, shutdown_timeout=1.0, worker_timeout=60.0)
    now = time.monotonic()
    old = slot.process = WorkerProcess(spec, popen, wake_w, status_r, board, started=now,
                                       last_seen=now)
    try:
        pool.apply(Config(lanes={"default": lane}, worker_timeout=10.0))
        assert old.retiring and old in pool.retiring
        old.last_seen = now - 20.0  # silent for longer than the new timeout, not the old
        pool.last_liveness_check = now
        pool.check_liveness(now + 0.5)
        assert old.kill_reason is None
        old.last_seen = now - 61.0
        pool.check_liveness(now + 1.0)
        assert old.kill_reason is not None and "worker_timeout 60s" in old.kill_reason
    finally:
        popen.kill()
        popen.wait(timeout=30)
        board.close()
        os.close(status_r)
        os.close(wake_w)


# --- the worker pool: a failed spawn ------------------------------------------------------


def open_descriptors() -> int:
    # Garbage of earlier tests (an unclosed selector in a reference cycle) is collected
    # first: collected between two counts, it would close descriptors this test never opened.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_a_failed_spawn_leaks_nothing_and_is_retried_after_the_restart_delay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = one_slot_pool()
    slot = pool.slots[("default", 0)]

    def at_the_process_limit(*_args: object, **_kwargs: object) -> subprocess.Popen[bytes]:
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", at_the_process_limit)
    before = open_descriptors()
    # Taken before each spawn: the delay runs from the failure, and a loaded machine may
    # take a while between the failure and the assertions below.
    failed_after = time.monotonic()
    with structlog.testing.capture_logs() as logged:
        pool.spawn_due()  # does not raise: the supervisor's loop goes on
        pool.spawn_due()  # not due again yet
    assert open_descriptors() == before  # the pipes and the run board are closed again
    assert slot.process is None
    [failure] = [e for e in logged if e["event"].startswith("worker spawn failed")]
    assert (failure["log_level"], failure["lane"]) == ("error", "default")
    assert "Resource temporarily unavailable" in failure["error"]
    assert slot.backoff.failures == 1
    assert pool.next_spawn_at() == slot.spawn_at >= failed_after + RESTART_BASE
    # Once the delay is over it spawns again, and a second failure waits longer.
    failed_after = slot.spawn_at = time.monotonic()
    pool.spawn_due()
    assert slot.backoff.failures == 2
    assert slot.spawn_at >= failed_after + 2 * RESTART_BASE
    assert open_descriptors() == before


def test_a_worker_gone_before_it_reads_its_spec_is_left_to_the_reaper() -> None:
    """The child died before reading its spec: the broken pipe is logged, the pipe closed,
    and the exit is reaped like any other (a crash, with the restart delay)."""
    spec = WorkerSpec(worker_id="test-node:default#0:0", lane=LaneConfig("default"),
                      handlers={}, database_url="", schema="jobd", slot=0, generation=1,
                      status_fd=-1, wake_fd=-1, shutdown_timeout=1.0)
    gone = subprocess.Popen([sys.executable, "-c", "import os; os.close(0)"],
                            stdin=subprocess.PIPE)
    gone.wait(timeout=30)
    with structlog.testing.capture_logs() as logged:
        workerpool._hand_over_spec(gone, spec)
    assert gone.stdin is not None and gone.stdin.closed
    assert [e["event"] for e in logged if e["log_level"] == "error"] == [
        "could not hand a new worker its spec"]


# --- wake-up payloads ----------------------------------------------------------------------


@pytest.mark.parametrize(("payload", "expected"), [
    ("default", Wakeup("default", None)),
    ("mail.out:eu-1", Wakeup("mail.out:eu-1", None)),
    ("default@1767225600", Wakeup("default", 1767225600.0)),
    ("reports@1767225600.123456", Wakeup("reports", 1767225600.123456)),
    ("", None),
    ("@1767225600", None),
    ("default@", None),
    ("default@soon", None),
    ("default@1@2", None),
    ("default#1", Wakeup("default", None, 1)),
    ("bulk#20000", Wakeup("bulk", None, 20000)),
    ("default#", None),
    ("default#many", None),
    ("#3", None),
])
def test_parse_payload(payload: str, expected: Wakeup | None) -> None:
    assert parse_payload(payload) == expected


# --- sd_notify -----------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = tmp_path / "notify.sock"
    if len(str(path)) >= 104:  # sun_path is 108 bytes
        pytest.skip(f"tmp_path too long for an AF_UNIX address: {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    try:
        yield str(path), sock
    finally:
        sock.close()


def receive(sock: socket.socket) -> dict[str, str]:
    lines = sock.recv(65536).decode("utf-8").split("\n")
    return dict(line.split("=", 1) for line in lines)


def assert_nothing_more(sock: socket.socket) -> None:
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(65536)


def test_ready_status_stopping_and_watchdog(notify_socket: tuple[str, socket.socket]) -> None:
    address, sock = notify_socket
    with Notifier(address) as notifier:
        notifier.ready("default 2/2 workers busy 0")
        assert receive(sock) == {"READY": "1", "STATUS": "default 2/2 workers busy 0"}
        notifier.status("default 2/2 workers busy 1")
        assert receive(sock) == {"STATUS": "default 2/2 workers busy 1"}
        notifier.stopping("draining")
        assert receive(sock) == {"STOPPING": "1", "STATUS": "draining"}
        notifier.watchdog()
        assert receive(sock) == {"WATCHDOG": "1"}
    assert_nothing_more(sock)


def test_stopping_can_ask_systemd_for_more_time(notify_socket: tuple[str, socket.socket]
                                               ) -> None:
    address, sock = notify_socket
    with Notifier(address) as notifier:
        notifier.stopping("draining", extend_timeout=330.25)
    assert receive(sock) == {"STOPPING": "1", "STATUS": "draining",
                             "EXTEND_TIMEOUT_USEC": "330250000"}
    assert_nothing_more(sock)


def test_reloading_carries_the_monotonic_clock_in_microseconds(
    notify_socket: tuple[str, socket.socket],
) -> None:
    address, sock = notify_socket
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    with Notifier(address) as notifier:
        notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    message = receive(sock)
    assert set(message) == {"RELOADING", "MONOTONIC_USEC"}
    assert message["RELOADING"] == "1"
    assert before <= int(message["MONOTONIC_USEC"]) <= after


def test_the_address_comes_from_notify_socket(
    notify_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, sock = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    with Notifier() as notifier:
        notifier.ready("up")
    assert receive(sock) == {"READY": "1", "STATUS": "up"}


def test_an_address_with_at_is_in_the_abstract_namespace() -> None:
    name = f"jobd-test-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        with Notifier("@" + name) as notifier:
            assert notifier.address == "\0" + name
            notifier.status("abstract")
            assert receive(sock) == {"STATUS": "abstract"}


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    notifier = Notifier()
    assert notifier.address == ""
    assert notifier.watchdog_interval is None
    notifier.ready("x")
    notifier.reloading()
    notifier.status("x")
    notifier.stopping("x")
    notifier.watchdog()


def test_a_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    with Notifier(str(tmp_path / "gone.sock")) as notifier:
        notifier.ready("nobody listens")
        notifier.status("still fine")
        # Nobody to retry for: the loop is not woken again and again for it.
        assert notifier.retry_at(time.monotonic()) is None


def test_a_full_notify_queue_never_blocks_and_state_changes_arrive_later(
    notify_socket: tuple[str, socket.socket],
) -> None:
    """A reader that stops reading (systemd busy, a datagram queue of 10) must not stall the
    supervisor inside sendto: STATUS updates that do not fit are dropped, READY=1 and
    STOPPING=1 wait and arrive, in order, once the reader takes messages again."""
    address, sock = notify_socket
    with Notifier(address) as notifier:
        finished = threading.Event()

        def flood() -> None:
            for n in range(2000):  # far more than any datagram queue holds
                notifier.status(f"update {n}")
            notifier.ready("up")
            notifier.stopping("draining")
            finished.set()

        threading.Thread(target=flood, daemon=True).start()
        assert finished.wait(10), "sending to a full notify socket blocked"
        assert notifier.retry_at(time.monotonic()) is not None
        received = []
        sock.settimeout(0.05)
        while True:  # the reader catches up
            try:
                received.append(sock.recv(65536))
            except TimeoutError:
                break
        notifier.flush()
        assert notifier.pending == []
        sock.settimeout(2.0)
        assert receive(sock) == {"READY": "1", "STATUS": "up"}
        assert receive(sock) == {"STOPPING": "1", "STATUS": "draining"}
        assert all(message.startswith(b"STATUS=update") for message in received)


def test_a_watchdog_ping_the_reader_could_not_take_is_sent_again_soon(
    notify_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Dropped, the next ping came a whole interval later: at half the timeout, exactly the
    # timeout after the last one delivered.
    address, sock = notify_socket
    monkeypatch.setenv("WATCHDOG_USEC", "40000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    from jobd.config import Config
    from jobd.supervisor import Supervisor
    supervisor = Supervisor(Config(), "postgresql:///unused")
    supervisor.notifier = Notifier(address)
    try:
        for _ in range(5000):  # far more than any datagram queue holds
            if not supervisor.notifier.watchdog():
                break  # the queue is full
        else:
            pytest.fail("the notify socket's queue never filled")
        before = time.monotonic()
        supervisor.next_watchdog = 0.0
        supervisor._watchdog()  # the queue is full: not delivered
        assert supervisor.next_watchdog <= before + 1.0
        sock.settimeout(0.05)
        with contextlib.suppress(TimeoutError):
            while True:
                sock.recv(65536)  # the reader catches up
        supervisor.next_watchdog = 0.0
        supervisor._watchdog()
        assert supervisor.next_watchdog >= time.monotonic() + 9.0  # a quarter of 40 s
        sock.settimeout(2.0)
        assert receive(sock) == {"WATCHDOG": "1"}
    finally:
        supervisor.notifier.close()


def test_an_unforeseen_failure_to_read_the_config_refuses_the_reload_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Not a mistake in the file (those are ConfigErrors, one line each) but a defect: the
    supervisor runs on, and the log carries the traceback to report."""
    from jobd import supervisor as supervisor_module
    from jobd.config import Config

    def broken_load(path: str) -> Config:
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(supervisor_module, "load", broken_load)
    supervisor = supervisor_module.Supervisor(replace(Config(), path=str(tmp_path / "c.yaml")),
                                              "postgresql:///unused")
    try:
        with structlog.testing.capture_logs() as logs:
            supervisor.reload()
    finally:
        supervisor.notifier.close()
    [refused] = [r for r in logs if r["event"] == "reload refused; still running the previous "
                                                  "config"]
    assert refused["error"] == "RuntimeError: unforeseen"
    assert isinstance(refused["exc_info"], RuntimeError)
    assert supervisor.pending_reload is None


@pytest.mark.parametrize(("usec", "pid", "interval"), [
    ("2000000", None, 0.5),
    ("2000000", "self", 0.5),
    ("2000000", "other", None),
    ("", None, None),
    ("soon", None, None),
])
def test_watchdog_interval_is_a_quarter_of_the_timeout_for_this_process(
    monkeypatch: pytest.MonkeyPatch, usec: str, pid: str | None, interval: float | None
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is None:
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() if pid == "self" else 1))
    assert Notifier("").watchdog_interval == interval


# --- the supervisor's database helper ------------------------------------------------------


def test_a_deadlock_fails_the_duty_but_keeps_the_supervisors_connection(db_url: str) -> None:
    """A deadlock or serialization failure is an OperationalError like a dropped connection,
    but the connection survives it: the supervisor must not throw it away (and with it the
    node's view of the database for a reconnect delay)."""
    from jobd.config import Config
    from jobd.supervisor import Supervisor

    supervisor = Supervisor(Config(), db_url)
    link = supervisor.link
    link.ensure()
    conn = link.conn
    assert conn is not None
    for sqlstate in ("40P01", "40001", "57014"):  # deadlock, serialization, statement timeout
        failed = link.run("duty", lambda c, s=sqlstate: c.execute(
            f"DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{s}'; END $$"))
        assert failed is None
        assert link.conn is conn and not conn.closed
    assert link.run("duty", lambda c: c.execute("SELECT 1").fetchone()) == (1,)
    # The supervisor's statements are bounded.
    assert link.run("duty", lambda c: c.execute("SHOW statement_timeout").fetchone()) == ("10s",)
    # A connection that really broke is dropped and retried later.
    killer = link.run("pid", lambda c: c.execute("SELECT pg_backend_pid()").fetchone())
    assert killer is not None
    with psycopg.connect(db_url, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", killer)
    assert link.run("duty", lambda c: c.execute("SELECT 1")) is None
    assert link.conn is None
    supervisor.listener.close()
    conn.close()


@pytest.mark.parametrize("change", [
    {"outbox_lane": "mail"}, {"shutdown_timeout": 60.0}, {"log_level": "debug"},
], ids=["outbox-lane", "shutdown-timeout", "log-level"])
def test_a_reload_of_a_setting_every_worker_carries_replaces_every_lanes_workers(
        change: dict[str, Any]) -> None:
    # A worker keeps the settings it was started with: kept, the old outbox lane would keep
    # getting the deliveries, and a drain would stop handlers at the old shutdown_timeout
    # while the supervisor waited for the new one.
    config = Config(lanes={"default": LaneConfig("default"), "mail": LaneConfig("mail")})
    pool = workerpool.WorkerPool(config, "", SelectLoop())
    pool.build()
    before = dict(pool.slots)
    pool.apply(replace(config, **change))
    assert sorted(pool.slots) == sorted(before)
    assert not any(pool.slots[key] is before[key] for key in before)
    assert {slot.generation for slot in pool.slots.values()} == {pool.generation}
    unchanged = dict(pool.slots)
    pool.apply(replace(config, **change))
    assert all(pool.slots[key] is unchanged[key] for key in unchanged)
