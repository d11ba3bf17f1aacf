"""A worker process's start, before its loop: the log, the process title, the crash dumps,
and the handlers imported with the signals the loop will handle held back.

Apart from :mod:`jobd.worker` because it runs once, in a fixed order that matters (the log's
stream is taken before any handler module can touch descriptor 2), and none of it is the
loop's concern.
"""

from __future__ import annotations

import os
import signal

import setproctitle
import structlog

from jobd import crash_dumps, forks, logs, outbox
from jobd import handlers as handler_registry
from jobd.protocol import WorkerSpec
from jobd.worker_mode import HELD_AT_START

log = structlog.get_logger("jobd.worker")


def start_logging(spec: WorkerSpec) -> None:
    """Configure the log, the process title and the crash dumps, and hold the signals the
    loop will handle."""
    # The log's own copy of stderr: what handlers do to descriptor 2 does not reach it.
    log_stream = logs.private_stderr()
    logs.configure(spec.log_level, stream=log_stream,
                   process=f"worker {spec.lane.name}#{spec.slot}",
                   worker=spec.worker_id, pid=os.getpid())
    setproctitle.setproctitle(f"jobd: worker {spec.lane.name}#{spec.slot} starting")
    # A crash (or the supervisor's SIGABRT of a hung worker) dumps every thread's stack, into
    # the file the supervisor reads when the worker has exited (jobd.crash_dumps).
    crash_dumps.enable(spec.crash_fd, log_stream)
    logs.capture_handler_output(spec.log_level)
    # Held back while the handlers import (seconds, for a heavy application): the supervisor
    # spawned us with them held (HELD_AT_START); holding them again covers a worker started
    # by hand. Delivered once the loop handles them.
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_START)


def load_handlers(spec: WorkerSpec) -> dict[str, handler_registry.ResolvedHandler] | None:
    """Import the lane's handlers and the outbox's senders; None (logged) when one cannot
    be loaded, a boot failure."""
    try:
        resolved = handler_registry.resolve_all(spec.handlers)
        outbox.install(
            {name: r.func for name, r in handler_registry.resolve_all(
                spec.senders, handler_registry.SENDER).items()},
            spec.outbox_lane, spec.schema)
    except handler_registry.HandlerImportError as exc:
        log.error("boot failure", error=str(exc))
        return None
    if logs.keep_configuration():
        log.info("the handlers' modules configured structlog at import; this worker "
                 "keeps jobd's configuration, so their structlog records are written as "
                 "jobd's, naming their jobs")
    forks.watch()
    return resolved
