"""A handler that forks, and whose child comes back into the worker's code.

A child made by ``os.fork()`` in a handler is a copy of the worker: its handler thread, the
worker's database sockets, pipes and run board (shared memory). Code that forks is meant to
end the child with ``os._exit`` (multiprocessing does; an ``exec`` ends it too), but a child
that returns from the handler, or raises out of it, runs on as the worker: it writes the
outcome to the board it shares with its parent, commits or rolls back a transactional
handler's transaction on the parent's socket, then waits forever for another job, a hung
copy of the worker outside its supervisor's reach (it ignores SIGTERM as workers do).

So a worker notes every fork (:func:`watch`), and each handler call checks on its way back
(:func:`call`, :func:`leave_if_forked`): a forked child that gets there logs it and ends
with ``os._exit``, before it touches anything of its parent's. The parent's job goes on as
usual. The cost per job is the read of a module global.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("jobd.worker")

T = TypeVar("T")

# The exit status of such a child: what the handler that forked it reads from waitpid().
EXIT_FORKED_CHILD = 70  # EX_SOFTWARE

_worker_pid: int | None = None  # set in a worker process by watch(); None elsewhere
_forked = False  # True in a child forked from the worker


def watch() -> None:
    """Note, in this worker process, every fork a handler makes (once, at the worker's
    start)."""
    global _worker_pid
    if _worker_pid is None:
        _worker_pid = os.getpid()
        os.register_at_fork(after_in_child=_note_fork)


def _note_fork() -> None:
    global _forked
    _forked = True


def call(func: Callable[..., T], *args: Any) -> T:
    """``func(*args)`` (a handler); a forked child that comes back from it exits."""
    try:
        return func(*args)
    finally:
        leave_if_forked(args[0] if args else None)


def leave_if_forked(job: Any = None) -> None:
    """In a child forked from the worker by a handler: say so and exit at once, running no
    cleanup (no ``finally`` of the worker's, no ``atexit``, no finalizer that could close the
    parent's connections on the server). Elsewhere: nothing."""
    if not _forked:
        return
    try:
        log.error("a process forked by a handler returned into jobd instead of ending with "
                  "os._exit(); it exits now (its parent's job runs on)",
                  job_id=getattr(job, "id", None), handler=getattr(job, "handler", None),
                  pid=os.getpid(), worker_pid=_worker_pid, exit_code=EXIT_FORKED_CHILD)
    finally:
        os._exit(EXIT_FORKED_CHILD)
