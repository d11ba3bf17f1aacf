"""Where a worker's stack dump goes when it dies of a signal, and how it reaches the log.

Python's faulthandler writes every thread's stack when the process gets SIGSEGV, SIGFPE,
SIGBUS, SIGILL or SIGABRT (the supervisor's abort of a hung worker): plain text, about 60
lines a crash. Written to the log's stream, those lines sat between the JSON records, where
a log collector that parses JSON took them for unparsed noise, and a crash loop (a poison
job segfaulting its worker on every attempt) filled the log with them.

So each worker gets a file of its own in memory (a memfd) from the supervisor, and its
faulthandler writes there. When the worker exits, the supervisor reads what it holds and
logs it as the ``stack`` field of the "worker exited" record: one JSON record per crash,
the dump inside it, cut to :data:`MAX_DUMP` characters (the crashing thread comes first).
"""

from __future__ import annotations

import faulthandler
import os
from typing import TextIO

from jobd import logs

# journald splits records longer than its LineMax (48K by default): the head of a dump (the
# crashing thread, most recent call first) is what matters.
MAX_DUMP = 16 * 1024


def create() -> int:
    """A new, empty dump file for one worker (closed at exec: the spawn passes it)."""
    return os.memfd_create("jobd-crash-dump", os.MFD_CLOEXEC)


def enable(dump_fd: int, fallback: TextIO) -> None:
    """In the worker: write stack dumps to ``dump_fd`` (moved to a private number), or to
    ``fallback`` (the log's stream) when the supervisor passed none (-1: a worker started
    by hand, or by a supervisor older than the field)."""
    if dump_fd < 0:
        faulthandler.enable(file=fallback)
        return
    # As the log's own descriptor: above the numbers a handler's own open() calls take, so a
    # handler that closes or reuses low descriptors does not get it.
    private = logs.private_copy(dump_fd)
    os.close(dump_fd)
    # faulthandler keeps the descriptor, not a file object: it must stay open (it does, for
    # the life of the process).
    faulthandler.enable(file=private)


def take(dump_fd: int) -> str:
    """In the supervisor, once the worker has exited: what it dumped ('' if nothing), and
    the file closed. -1 (none given): ''."""
    if dump_fd < 0:
        return ""
    try:
        os.lseek(dump_fd, 0, os.SEEK_SET)
        data = os.read(dump_fd, MAX_DUMP + 1)
    finally:
        os.close(dump_fd)
    text = data[:MAX_DUMP].decode("utf-8", errors="backslashreplace").strip()
    if len(data) > MAX_DUMP:
        text += "\n... (cut)"
    return text
