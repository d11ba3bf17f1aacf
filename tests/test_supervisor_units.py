"""The supervisor's pure parts: restart backoff, exit descriptions, wake-up payloads and the
systemd notification protocol (against a real AF_UNIX datagram socket)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from jobd.protocol import describe_exit
from jobd.restarts import SlotBackoff
from jobd.sdnotify import Notifier
from jobd.wakeup import Wakeup, parse_payload

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


@pytest.mark.parametrize(("usec", "pid", "interval"), [
    ("2000000", None, 1.0),
    ("2000000", "self", 1.0),
    ("2000000", "other", None),
    ("", None, None),
    ("soon", None, None),
])
def test_watchdog_interval_is_half_the_timeout_for_this_process(
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
