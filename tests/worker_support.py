"""A worker process's loop, in-process: built from a spec as the supervisor would start it,
connected to the test's database, not started, so a test drives its steps turn by turn."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from jobd import handlers, protocol, worker
from jobd.config import LaneConfig
from jobd.db import DEFAULT_SCHEMA


@contextlib.contextmanager
def connected_worker(db_url: str, lane: LaneConfig, worker_id: str,
                     resolved: Mapping[str, handlers.ResolvedHandler] | None = None,
                     ) -> Iterator[tuple[worker.Worker, int]]:
    """A worker of ``lane`` running ``resolved`` (none: no threads, no pools, and every job
    it starts fails), connected; and the write end of its wake pipe, as the supervisor holds
    it. Closed on the way out."""
    status_r, status_w = os.pipe()
    wake_r, wake_w = os.pipe()
    spec = protocol.WorkerSpec(
        worker_id=worker_id, lane=lane, handlers={}, database_url=db_url,
        schema=DEFAULT_SCHEMA, slot=0, generation=1, status_fd=status_w, wake_fd=wake_r,
        shutdown_timeout=1.0,
        # As the supervisor decides it for a node of this one lane.
        settles_apart=lane.settles_apart(len(os.sched_getaffinity(0)), lane.workers))
    subject = worker.Worker(spec, dict(resolved or {}))
    if resolved is None:
        # No handlers: the loop tests start every job they claim, and each run fails at once
        # ("no handler named ..."), a handler that costs no thread. A worker of a daemon
        # leaves such jobs to other nodes instead (tests/test_lacking_handlers.py).
        subject.claimer.handlers.known = None
    subject._ensure_connection()
    assert subject.conn is not None
    try:
        yield subject, wake_w
    finally:
        if subject.conn is not None:
            subject.conn.close()
        if subject.settler is not None:
            subject.settler.close()
        for fd in (status_r, status_w, wake_r, wake_w):
            os.close(fd)
