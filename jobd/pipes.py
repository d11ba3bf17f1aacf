"""Self-pipes and wake-up pipes: non-blocking byte signals between threads and processes."""

from __future__ import annotations

import os


def drain(fd: int) -> None:
    """Read and discard whatever is waiting on a non-blocking pipe."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass  # the pipe is empty: what a non-blocking read says once all is drained


def poke(fd: int, signal: bytes = b"!") -> None:
    """Write one byte to a non-blocking pipe. A full pipe already holds a wake-up and a
    broken one belongs to a process that is being reaped, so neither is an error."""
    try:
        os.write(fd, signal)
    except (BlockingIOError, BrokenPipeError):
        pass
