"""The jobs a worker process is running, in memory its supervisor shares with it.

When a worker dies, the database knows which jobs it held, not which of them it had
started: with the jobs it claimed ahead (``jobd.prefetch``: up to 500) in its buffer and on
deck, crash attribution made every one of them a suspect to run alone, and a lane stalled
behind them for minutes. The board tells the supervisor which were running, so only those
can be blamed (``recovery.settle_crashed_worker``); the others are given back unharmed.

One 8-byte slot per run that may be in progress at once: one per handler thread (thread
``i`` owns slot ``THREADS + i``), as many again for ``async def`` handlers' tasks, which take
a free one from the event loop's thread. A job's id is written before its handler is called
and cleared when it returns (0 is empty: job ids start at 1). Each thread also keeps the id
of the job it ran last (slot ``THREADS + concurrency + i``), which counts as running too: a
handler that signals its own process (``os.kill(os.getpid(), SIGSEGV)``) may return before
the signal ends the process. Each slot has one writer at a time, so there is no lock, and
the supervisor reads the board only once the worker has exited. Slot ``OVERFLOW`` counts
async runs that found no free slot: a board that missed one cannot clear any job, and crash
attribution then suspects every job held, as without a board.

The board's last slot is the worker's word that it shut down: written at the end of its
shutdown, once it has given back what it held. A worker the supervisor did not ask to stop
may still exit with status 0 (a handler calling ``os._exit(0)``, a C library calling
``exit(0)``); without the mark, that exit is a crash like any other (``jobd.workerpool``).
A worker started by a supervisor older than the mark finds no slot for it and writes none
(that supervisor does not read it).

One slot is read while the worker lives: ``IDLE`` counts the times the worker ran out of work
(nothing running, nothing claimed ahead), written by its loop alone. The supervisor's wake
router counts what it routed to a worker as load until the worker's next report, once a
second (``jobd.wake_routing``); a count that moved says that load is done. Then an idle
lane's wake-ups go to the worker that has just finished, whose process, connection and
server backend are warm, rather than to each worker in turn, and the supervisor learns it
without a message, a read of shared memory when it routes.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

_SLOT_BYTES = 8  # a signed 64-bit integer in the machine's order: both sides run here
OVERFLOW = 0
IDLE = 1
THREADS = 2  # the first handler thread's slot


@dataclass(frozen=True, slots=True)
class Running:
    """What a dead worker's board said: the jobs it was running, and whether that is all of
    them (False when an async run found no free slot)."""

    job_ids: frozenset[int]
    complete: bool


SHUT_DOWN_MARK = 1  # the value of the last slot once the worker has shut down


class RunBoard:
    """A worker's board: two slots per handler thread (its job, its last job),
    ``concurrency`` for async runs, the idle count and the shutdown mark."""

    def __init__(self, fd: int, concurrency: int) -> None:
        self.concurrency = concurrency
        # A board from a supervisor older than the shutdown mark is one slot short: map what
        # there is (the worker then writes no mark).
        self._map = mmap.mmap(fd, min(_size(concurrency), os.fstat(fd).st_size))
        # Item assignment on a cast view: the cheapest write Python has (about 20 ns, half
        # of struct.pack_into); a handler thread makes three per job.
        self._slots = memoryview(self._map).cast("q")
        # Async slots free to take; used from the event loop's thread alone.
        first_async = THREADS + 2 * concurrency
        self._free_async = list(range(first_async + concurrency - 1, first_async - 1, -1))

    @classmethod
    def create(cls, concurrency: int) -> tuple[RunBoard, int]:
        """A new, empty board and the descriptor to pass to the worker (close it once
        passed: the mapping stays). On OSError (out of descriptors or memory) nothing stays
        open."""
        fd = _shared_file()
        try:
            os.ftruncate(fd, _size(concurrency))
            return cls(fd, concurrency), fd
        except OSError:
            os.close(fd)
            raise

    def thread_started(self, thread: int, job_id: int) -> None:
        self._slots[THREADS + thread] = job_id

    def thread_ended(self, thread: int, job_id: int) -> None:
        self._slots[THREADS + self.concurrency + thread] = job_id
        self._slots[THREADS + thread] = 0

    def async_started(self, job_id: int) -> int | None:
        """The slot the run took, or None if none was free (counted as an overflow)."""
        if not self._free_async:
            self._slots[OVERFLOW] += 1
            return None
        slot = self._free_async.pop()
        self._slots[slot] = job_id
        return slot

    def async_ended(self, slot: int | None) -> None:
        if slot is not None:
            self._slots[slot] = 0
            self._free_async.append(slot)

    def went_idle(self) -> None:
        """The worker's loop: it has just run out of work."""
        self._slots[IDLE] += 1

    def idle_count(self) -> int:
        """The times the worker ran out of work so far (the supervisor's read, any time)."""
        return int(self._slots[IDLE])

    def mark_shut_down(self) -> None:
        """The worker's loop, at the very end of its shutdown: it has given back what it
        held, and exits on purpose (asked to, or wedged: its exit code says which)."""
        if len(self._slots) > self._shut_down_slot:
            self._slots[self._shut_down_slot] = SHUT_DOWN_MARK

    def shut_down(self) -> bool:
        """Whether the worker finished its shutdown (the supervisor's read, after it exited)."""
        return (len(self._slots) > self._shut_down_slot
                and self._slots[self._shut_down_slot] == SHUT_DOWN_MARK)

    def running(self) -> Running:
        """The jobs on the board now (the supervisor's read, after the worker exited)."""
        values = self._slots.tolist()
        return Running(frozenset(v for v in values[THREADS:self._shut_down_slot] if v),
                       values[OVERFLOW] == 0)

    @property
    def _shut_down_slot(self) -> int:
        return THREADS + 3 * self.concurrency

    def close(self) -> None:
        self._slots.release()  # the map cannot close while a view of it is exported
        self._map.close()


def _size(concurrency: int) -> int:
    return (THREADS + 3 * concurrency + 1) * _SLOT_BYTES  # + 1: the shutdown mark


def _shared_file() -> int:
    """An anonymous file to map: a memfd where there is one (Linux), else an unlinked
    temporary file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("jobd-run-board", os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as file:
        return os.dup(file.fileno())
