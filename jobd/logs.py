"""Structured logging: JSON lines when stderr is not a terminal, readable text when it is.

In a worker, what handlers print and what they log through the standard ``logging`` module
becomes records of the same stream (:func:`capture_handler_output`), so an operator reading
the JSON lines never meets raw text between them, and each record names its job.

structlog's configuration is global, and a worker imports the application: a module that
calls ``structlog.configure`` at import (as structlog's documentation shows) would replace
jobd's. The worker puts jobd's back after the import (:func:`keep_configuration`), and the
records made of handler output are written by a logger bound to jobd's configuration alone,
whatever the global one says later: one that prints to ``sys.stdout``, which is itself turned
into records, had every worker of the node wait forever on structlog's print lock.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import resource
import sys
import threading
from collections.abc import MutableMapping
from contextvars import ContextVar
from typing import Any, TextIO

import structlog

_job = threading.local()
# Async handlers share the event loop's thread: each task names its job in its own context.
_task_job: ContextVar[dict[str, Any] | None] = ContextVar("jobd_task_job", default=None)

# What configure() set last (structlog.configure's keyword arguments), or None before.
_configured: dict[str, Any] | None = None


def bind_job(job_id: int, handler: str) -> None:
    """Name the job this thread runs in every record it logs, until :func:`unbind_job`.
    A thread-local rather than context variables: it costs next to nothing per job, and a
    worker runs tens of thousands of jobs a second."""
    _job.fields = {"job_id": job_id, "handler": handler}


def unbind_job() -> None:
    _job.fields = None


def bind_task_job(job_id: int, handler: str) -> None:
    """Name the job in every record the calling asyncio task logs (its context is its own,
    so nothing to undo when it ends)."""
    _task_job.set({"job_id": job_id, "handler": handler})


def _add_job(_logger: Any, _method: str, event: MutableMapping[str, Any]
             ) -> MutableMapping[str, Any]:
    fields = getattr(_job, "fields", None) or _task_job.get()
    if fields:
        for key, value in fields.items():
            event.setdefault(key, value)
    return event


def configure(level: str = "info", *, reconfigurable: bool = False,
              stream: TextIO | None = None, **static: object) -> None:
    """Configure structlog for this process; ``static`` fields go into every event, which
    are written to ``stream`` (default: ``sys.stderr`` as it is now).

    Static fields (process role, worker id, pid) are added by a processor rather than bound
    in context variables, so events logged from handler threads carry them too.
    ``reconfigurable``: a later call applies to loggers already used (the supervisor's
    level follows a reload). Otherwise each logger keeps, from its first use, what it was
    configured with: a worker logs from its hot path, and is replaced to change level.
    """

    def add_static(_logger: Any, _method: str, event: MutableMapping[str, Any]
                   ) -> MutableMapping[str, Any]:
        for key, value in static.items():
            event.setdefault(key, value)
        return event

    out = sys.stderr if stream is None else stream
    renderer: structlog.types.Processor
    if out.isatty():
        renderer = structlog.dev.ConsoleRenderer()
    else:
        renderer = structlog.processors.JSONRenderer()
    global _configured
    _configured = {
        "processors": [
            structlog.contextvars.merge_contextvars,
            _add_job,
            add_static,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        "wrapper_class": structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())),
        # One write per line: the supervisor and its workers share stderr, and two lines
        # written piecemeal by two processes would interleave.
        "logger_factory": _TolerantWriteLoggerFactory(out),
        "cache_logger_on_first_use": not reconfigurable,
    }
    structlog.configure(**_configured)


class _TolerantWriteLogger(structlog.WriteLogger):
    """structlog's WriteLogger, except that a record its stream refuses is dropped instead
    of raised into the code that logged it.

    The reader of the daemon's stderr can go away: ``jobd run 2>&1 | head``, a journald
    restarted under an older systemd, a log file on a full disk. Raised, the error ended
    the supervisor (exit 1, its workers left to drain) at its next record, and failed each
    worker's loop at its first, so the slot crash-looped. The daemon's work does not depend
    on its log being read; the records are lost, the jobs are not."""

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (OSError, ValueError):
            # OSError: EPIPE, EIO, ENOSPC...; ValueError: the stream was closed.
            pass

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _TolerantWriteLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *_args: Any) -> _TolerantWriteLogger:
        return _TolerantWriteLogger(self._file)


# The lowest descriptor private_stderr() takes: above those that daemonizing code closes
# (``for fd in range(3, 256): os.close(fd)``), where the limit on open files allows.
PRIVATE_FD_FLOOR = 256


def private_stderr() -> TextIO:
    """A stream on a copy of descriptor 2 that this process keeps for its own log.

    A worker runs user code, and descriptor 2 is only a number: a handler that closes it
    (``os.close(2)``), or puts a file or a socket there (``os.dup2``, or any open() after
    the close, which takes the lowest free number), had every later record of the worker,
    and a stack dump on SIGABRT, lost or written into that file or socket. The copy sits
    high, closed at exec, and nothing but the log writes to it."""
    fd = private_copy(2)
    # As Python's own stderr: line by line, and no record is lost to an encoding error.
    return os.fdopen(fd, "w", buffering=1, encoding=sys.stderr.encoding or "utf-8",
                     errors="backslashreplace")


def private_copy(fd: int) -> int:
    """A copy of ``fd`` at :data:`PRIVATE_FD_FLOOR` or above (closed at exec), where the
    limit on open files leaves room for it; else at the lowest free number."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft == resource.RLIM_INFINITY or soft > 2 * PRIVATE_FD_FLOOR
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, PRIVATE_FD_FLOOR if room else 3)


def keep_configuration() -> bool:
    """Put back what :func:`configure` set if code run since replaced structlog's
    configuration (an application module's ``structlog.configure`` at import); True if it
    had been replaced. Loggers the replacement bound meanwhile keep it."""
    if _configured is None:
        return False
    current = structlog.get_config()
    if all(current[key] is value for key, value in _configured.items()):
        return False
    structlog.configure(**_configured)
    return True


def _own_logger() -> Any:
    """A logger bound to :func:`configure`'s settings, never to structlog's global
    configuration, which user code may change at any time."""
    assert _configured is not None, "logs.configure() first"
    return _configured["wrapper_class"](_configured["logger_factory"](),
                                        processors=_configured["processors"], context={})


_STDLIB_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
                  logging.ERROR: "error", logging.CRITICAL: "critical"}


class _ToStructlog(logging.Handler):
    """Standard-library log records, re-emitted as structlog events."""

    def __init__(self) -> None:
        super().__init__()
        self._log = _own_logger()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info:
                fields["exception"] = "".join(
                    logging.Formatter().formatException(record.exc_info))
            level = _STDLIB_LEVELS.get(record.levelno, "info")
            getattr(self._log, level)(message, **fields)
        except Exception:
            self.handleError(record)


class _LineWriter(io.TextIOBase):
    """A text stream whose complete lines become log records (``stream``: stdout/stderr).

    Each thread keeps its own partial line, so two handlers printing at once do not mix.
    """

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._partial = threading.local()
        self._log = _own_logger()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        pending = getattr(self._partial, "text", "") + text
        *lines, self._partial.text = pending.split("\n")
        for line in lines:
            self._log.info(line, stream=self.stream)
        return len(text)

    def flush(self) -> None:
        pending = getattr(self._partial, "text", "")
        if pending:
            self._partial.text = ""
            self._log.info(pending, stream=self.stream)


def capture_handler_output(level: str) -> None:
    """Route print() and standard logging of user code into this process's structured log.

    Call after :func:`configure`: structlog writes to the stderr it was configured with,
    which stays the real one.
    """
    root = logging.getLogger()
    root.handlers = [_ToStructlog()]
    root.setLevel(logging.getLevelName(level.upper()))
    sys.stdout = _LineWriter("stdout")
    sys.stderr = _LineWriter("stderr")
