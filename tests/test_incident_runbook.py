"""The incident runbook (docs/operations.md, "During an incident") against a real daemon:
the situations an on-call engineer meets there, each one reproduced on its own."""

from __future__ import annotations

from collections.abc import Callable

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, job_state, make_config, wait_until

import jobd

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]


def test_a_handler_that_hangs_on_every_retry_cannot_wedge_its_worker_for_good(
        daemons: Daemons, effects_db: psycopg.Connection) -> None:
    # A handler that hangs past the lane's timeout on every attempt keeps its thread when it
    # is failed; its retry, claimed by the same worker, takes a second thread. Both threads
    # are held, so the worker must count both and exit wedged (to be replaced): before, the
    # retry's run replaced the first one's record and the worker went on claiming jobs that
    # no thread would ever start, the healthy handlers' jobs stuck in `claimed`.
    daemon = daemons(make_config({"default": {"workers": 1, "concurrency": 2,
                                              "timeout": "1s", "max_attempts": 2}}))
    daemon.wait_workers_started("default", 1)
    hung = jobd.enqueue(effects_db, "slow", {"seconds": 600})
    wait_until(lambda: job_state(effects_db, hung) == "dead", 20,
               message=lambda: f"the hanging job to be dead-lettered\n{daemon.tail()}")
    healthy = jobd.enqueue(effects_db, "ok")
    wait_until(lambda: job_state(effects_db, healthy) == "done", 20,
               message=lambda: f"the healthy job {healthy} to run (it is "
                               f"{job_state(effects_db, healthy)})\n{daemon.tail()}")
    daemon.wait_for_log("worker exited", lambda e: "wedged" in e.get("cause", ""),
                        timeout=10)
    # Its last words name what to pause: the handler holding its threads.
    wedged = daemon.wait_for_log("every slot is held by a handler that ignored its timeout; "
                                 "exiting", process=None)
    assert wedged["handlers"] == {"slow": 2}
