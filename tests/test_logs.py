"""The daemon's log as an operator meets it: a stream nobody reads any more does not stop
the daemon; a herd of failing jobs does not flood it; a handler that exits with status 3 is
a crash; a failure line masks the passwords a handler's error quotes."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, job_row, job_state, make_config, wait_until
from structlog.testing import capture_logs

import jobd
from jobd.db import mask_passwords_in_text
from jobd.failure_log import BURST, WINDOW, FailureLog

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

Daemons = Callable[..., Daemon]

LOG_HANDLERS = '''\
import os
import signal
import time


def boom(job):
    raise RuntimeError("boom")


class OperationalError(Exception):
    pass


def leaky(job):
    raise OperationalError("no route to postgresql://app:Hunter2@db/app")


def segfault(job):
    """Ends its worker as a crash in a C extension would (the signal may reach another
    thread: this one waits for it, so the dump finds it here)."""
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(30)


def exit_three(job):
    """Ends its worker with status 3, as a C library's exit(3) would."""
    os._exit(3)
'''

HANDLERS = {**daemon_support.HANDLERS, "boom": "loghandlers:boom",
            "exit_three": "loghandlers:exit_three", "leaky": "loghandlers:leaky",
            "segfault": "loghandlers:segfault"}


def new_daemon(daemons: Daemons) -> Daemon:
    daemon = daemons()
    (daemon.dir / "loghandlers.py").write_text(LOG_HANDLERS)
    return daemon


def wait_state(conn: psycopg.Connection, job_id: int, state: str, daemon: Daemon) -> None:
    wait_until(lambda: job_state(conn, job_id) == state, 20,
               message=lambda: f"job {job_id} to be {state} (it is {job_state(conn, job_id)})"
                               f"; daemon running: {daemon.running()}")


@pytest.mark.slow
def test_a_log_nobody_reads_any_more_does_not_stop_the_daemon(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # `jobd run 2>&1 | head`, or a journald that went away: before, the supervisor exited
    # with status 1 at its next record (its workers left to drain), and a worker's loop
    # failed at its first, so its slot crash-looped.
    daemon = new_daemon(daemons)
    daemon.write_config(make_config({"default": {"workers": 1}}, handlers=HANDLERS))
    read_end, write_end = os.pipe()
    daemon.proc = subprocess.Popen(
        daemon.command(), stdin=subprocess.DEVNULL, stdout=write_end, stderr=write_end,
        cwd=daemon.dir, env=daemon.env(), start_new_session=True)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        seen = b""
        while b'"worker started"' not in seen:
            line = reader.readline()
            assert line, f"the daemon's log ended before a worker started:\n{seen.decode()}"
            seen += line
    # Nobody reads the log now: every record from here on meets a closed pipe.
    failing = jobd.enqueue(effects_db, "boom", {}, max_attempts=1)  # logs "dead-lettered"
    wait_state(effects_db, failing, "dead", daemon)
    job_id = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, job_id, "done", daemon)
    assert daemon.running()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(30) == 0


@pytest.mark.slow
def test_a_daemon_started_with_stdout_and_stderr_closed_runs_and_stops_cleanly(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # `jobd run -c F >&- 2>&-`: before, the daemon exited with status 1 at its first record
    # (Python has no sys.stderr then), or, with only stdout closed, at its last flush.
    daemon = new_daemon(daemons)
    daemon.write_config(make_config({"default": {"workers": 1}}, handlers=HANDLERS))
    daemon.proc = subprocess.Popen(
        ["sh", "-c", 'exec "$@" >&- 2>&-', "sh", *daemon.command()],
        stdin=subprocess.DEVNULL, cwd=daemon.dir, env=daemon.env(), start_new_session=True)
    job_id = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, job_id, "done", daemon)
    failing = jobd.enqueue(effects_db, "boom", {}, max_attempts=1)
    wait_state(effects_db, failing, "dead", daemon)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit(30) == 0


# --- failures beyond the log's budget are counted, not logged one by one -------------------


def test_failures_beyond_the_burst_are_held_and_written_as_one_line_when_the_window_ends(
) -> None:
    failures = FailureLog()
    with capture_logs() as logged:
        admitted = [failures.admit(100.0) for _ in range(BURST)]
        assert all(admitted)
        for dead in (False, False, True):
            assert not failures.admit(100.5)
            failures.hold("default", "boom", dead, "RuntimeError: boom")
        assert not failures.admit(101.0)
        failures.hold("default", "other", False, "ValueError: x")
        failures.flush(100.0 + WINDOW - 0.1)
        assert logged == []
        failures.flush(100.0 + WINDOW)
    [summary] = logged
    assert summary["log_level"] == "error"  # dead jobs among them
    assert (summary["lane"], summary["retried_count"], summary["dead_count"]) == (
        "default", 3, 1)
    assert summary["handlers"] == {
        "boom": {"retried": 2, "dead": 1, "error": "RuntimeError: boom"},
        "other": {"retried": 1, "dead": 0, "error": "ValueError: x"}}
    # A new window: single failures are written again.
    assert failures.admit(100.0 + WINDOW + 1)


def test_failures_held_when_the_worker_stops_are_written_at_once() -> None:
    failures = FailureLog()
    for _ in range(BURST):
        failures.admit(0.0)
    assert not failures.admit(0.0)
    failures.hold("default", "boom", False, "RuntimeError: boom")
    with capture_logs() as logged:
        failures.flush(1.0, force=True)
    [summary] = logged
    assert (summary["log_level"], summary["retried_count"], summary["dead_count"]) == (
        "warning", 1, 0)


@pytest.mark.slow
def test_a_herd_of_failing_jobs_is_logged_within_the_budget_and_every_one_is_counted(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Before, one line per failed attempt and per dead job: 50,000 jobs failing three times
    # were 150,000 lines at 2,900 a second, over journald's default rate limit.
    jobs = 300
    daemon = new_daemon(daemons).start(
        make_config({"default": {"workers": 1, "concurrency": 8}}, handlers=HANDLERS))
    ids = jobd.enqueue_many(effects_db, [jobd.JobSpec("boom", {}, max_attempts=1)] * jobs)
    wait_until(lambda: effects_db.execute(
        "SELECT count(*) FROM jobd.all_jobs WHERE id = ANY(%s) AND state = 'dead'",
        (ids,)).fetchone() == (jobs,), 60, message="every job to be dead")

    def dead_in_log() -> tuple[int, int]:
        one_by_one = len(daemon.events("job dead-lettered", process=None))
        counted = sum(e["dead_count"] for e in daemon.events(process=None)
                      if e["event"].startswith("job failures not logged one by one"))
        return one_by_one, counted

    wait_until(lambda: sum(dead_in_log()) == jobs, WINDOW + 20,
               message=lambda: f"every dead job in the log, one by one or counted: "
                               f"{dead_in_log()}")
    one_by_one, counted = dead_in_log()
    assert one_by_one <= 2 * BURST  # one window, maybe two, of one worker
    assert counted == jobs - one_by_one


# --- what the log says a worker's exit was ---------------------------------------------------


@pytest.mark.slow
def test_a_handler_that_exits_with_status_3_is_a_crash_not_a_boot_failure(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Status 3 is also what a worker that cannot import a handler exits with. Before, three
    # such jobs in a row halted the lane ("lane halted: its workers fail to boot; fix the
    # config and send SIGHUP"), and no job of it ran until a reload.
    daemon = new_daemon(daemons).start(make_config(
        {"default": {"workers": 1, "concurrency": 1}},
        supervisor={"restart_backoff": {"base": "100ms", "cap": "1s"}}, handlers=HANDLERS))
    for _ in range(4):
        poison = jobd.enqueue(effects_db, "exit_three", {}, max_attempts=1)
        wait_state(effects_db, poison, "dead", daemon)
    job_id = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, job_id, "done", daemon)
    exits = daemon.events("worker exited")
    assert len(exits) == 4
    assert {e["cause"] for e in exits} == {"exit code 3"}
    assert not daemon.events("lane halted: its workers fail to boot; fix the config and send "
                             "SIGHUP")
    assert "exit code 3" in job_row(effects_db, poison)["last_error"]


@pytest.mark.slow
def test_workers_that_cannot_import_their_handlers_still_halt_the_lane(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # The other side of the test above: a worker that never reported exits with status 3
    # because it could not load its handlers, and three in a row halt the lane.
    daemon = new_daemon(daemons)
    (daemon.dir / "breakable.py").write_text(
        "import os\n"
        "if os.path.exists(os.path.join(os.path.dirname(__file__), 'broken')):\n"
        "    raise ImportError('broken on purpose')\n"
        "def ok(job):\n"
        "    pass\n")
    daemon.start(make_config(
        {"default": {"workers": 1}},
        supervisor={"restart_backoff": {"base": "100ms", "cap": "1s"}},
        handlers={**HANDLERS, "breakable": "breakable:ok"}))
    [pid] = daemon.wait_workers_started("default", 1).values()
    (daemon.dir / "broken").write_text("")
    os.kill(pid, signal.SIGKILL)
    daemon.wait_for_log("lane halted: its workers fail to boot; fix the config and send SIGHUP",
                        timeout=30, lane="default")
    causes = [e["cause"] for e in daemon.events("worker exited")]
    assert causes[1:] == ["exit code 3 (boot failure)"] * 3


# --- what a failure line may quote -----------------------------------------------------------


@pytest.mark.parametrize(("text", "masked"), [
    ("OperationalError: cannot reach postgresql://app:s3cr@t@db:5432/x",
     "OperationalError: cannot reach postgresql://app:***@db:5432/x"),
    ("ConnectionError: redis://:hunter2@cache:6379/0 refused",
     "ConnectionError: redis://:***@cache:6379/0 refused"),
    ("ProgrammingError: bad dsn host=db password=hunter2 user=x",
     "ProgrammingError: bad dsn host=db password=*** user=x"),
    ("two: http://u:p1@h/x and http://v:p2@h2/y", "two: http://u:***@h/x and http://v:***@h2/y"),
    ("KeyError: 'password'", "KeyError: 'password'"),
    ("see https://example.com/a:b@c", "see https://example.com/a:b@c"),
])
def test_passwords_a_handler_quotes_in_its_error_are_masked(text: str, masked: str) -> None:
    assert mask_passwords_in_text(text) == masked


@pytest.mark.slow
def test_a_failure_line_masks_a_password_the_handlers_error_quotes(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(make_config({"default": {}}, handlers=HANDLERS))
    job_id = jobd.enqueue(effects_db, "leaky", {}, max_attempts=1)
    wait_state(effects_db, job_id, "dead", daemon)
    dead = daemon.wait_for_log("job dead-lettered", process=None, job_id=job_id)
    assert dead["error"] == "OperationalError: no route to postgresql://app:***@db/app"
    assert "Hunter2" not in daemon.log_path.read_text()


def test_a_workers_stack_dump_is_one_field_of_its_exit_record_not_loose_lines(
        daemons: Daemons, effects_db: psycopg.Connection) -> None:
    """faulthandler's dump of a worker killed by a signal (about 60 lines of plain text) was
    written between the JSON records, unparsed by log collectors and repeated by a crash
    loop; it is now the ``stack`` of the "worker exited" record."""
    daemon = new_daemon(daemons).start(make_config(
        {"default": {"workers": 1, "max_attempts": 1}}, handlers=HANDLERS))
    mark = daemon.mark()
    job_id = jobd.enqueue(effects_db, "segfault")
    exited = daemon.wait_for_log("worker exited", since=mark, timeout=20)
    assert exited["cause"] == "killed by SIGSEGV"
    stack = exited["stack"]
    assert "Fatal Python error: Segmentation fault" in stack
    assert "loghandlers.py" in stack and " in segfault" in stack, stack
    wait_state(effects_db, job_id, "dead", daemon)
    daemon.wait_workers_started("default", 1, since=mark)
    daemon.stop()
    loose = [line for line in daemon.log_path.read_text().splitlines()
             if line.strip() and not line.startswith("{")]
    assert loose == []


def test_a_worker_under_a_low_open_files_limit_still_gets_its_dump_file(
        daemons: Daemons, effects_db: psycopg.Connection) -> None:
    """The dump file moves to a high descriptor number, as the log's stream does, where
    the limit on open files leaves room; under a limit of 200 (a unit's LimitNOFILE), it
    must take a low one rather than fail the worker's start."""
    daemon = new_daemon(daemons)
    daemon.write_config(make_config({"default": {"workers": 1, "max_attempts": 1}},
                                    handlers=HANDLERS))
    limited = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
               "(200, 200)); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    command = daemon.command()
    with open(daemon.log_path, "ab") as stderr:
        daemon.proc = subprocess.Popen(
            [command[0], "-c", limited, *command[1:]], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=daemon.dir, env=daemon.env(),
            start_new_session=True)
    daemon.wait_workers_started("default", 1)
    mark = daemon.mark()
    job_id = jobd.enqueue(effects_db, "segfault")
    exited = daemon.wait_for_log("worker exited", since=mark, timeout=20)
    assert "Fatal Python error: Segmentation fault" in exited["stack"]
    wait_state(effects_db, job_id, "dead", daemon)
    ok = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, ok, "done", daemon)
