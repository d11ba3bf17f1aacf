"""The daemon's log as an operator meets it: a stream nobody reads any more does not stop
the daemon."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, job_state, make_config, wait_until

import jobd

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

Daemons = Callable[..., Daemon]

LOG_HANDLERS = '''\
def boom(job):
    raise RuntimeError("boom")
'''

HANDLERS = {**daemon_support.HANDLERS, "boom": "loghandlers:boom"}


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
