"""The jobs a worker claimed ahead of its free slots (the lane's ``prefetch``), oldest first,
each with the monotonic instant its claim came back: which starts next, and which go back
to the queue unstarted (older than :data:`BUFFER_MAX_AGE`, or of a handler this worker does
not run now). :class:`jobd.claimer.Claimer` decides when to ask; the buffer answers. It is
a deque, so the loop reads its head and its length directly.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence

from jobd import jobs

# Claimed jobs waiting for a free slot go back to the queue after this long: a buffer that
# sits still must not keep work from other workers, or priorities from being looked at anew.
BUFFER_MAX_AGE = 2.0

Entry = tuple[jobs.Job, float]
# Whether this worker starts jobs of a handler now; None: it starts every handler's.
RunsHere = Callable[[str], bool] | None


class ClaimBuffer(collections.deque[Entry]):
    def __init__(self) -> None:
        super().__init__()
        self.started = 0  # jobs taken into a slot since the worker began (the start rate)

    def leases(self) -> list[jobs.Lease]:
        return [job.lease for job, _claimed in self]

    def add(self, claimed: Iterable[jobs.Job], now: float) -> None:
        self.extend((job, now) for job in claimed)

    def pop_next(self, runs_here: RunsHere) -> Entry | None:
        """Take out the oldest job that may start here; the others stay until they are
        given back (:meth:`to_give_back`)."""
        if runs_here is None:
            if not self:
                return None
            self.started += 1
            return self.popleft()
        for index, entry in enumerate(self):
            if runs_here(entry[0].handler):
                del self[index]
                self.started += 1
                return entry
        return None

    def put_back(self, entries: Sequence[Entry]) -> None:
        """Jobs taken off the deck, back at the front with their claim times (not started
        after all: the start rate does not count them twice). They were the oldest, so the
        buffer stays oldest first."""
        self.extendleft(reversed(entries))
        self.started -= len(entries)

    def take(self, ids: set[int]) -> list[jobs.Job]:
        """Remove the jobs ``ids`` and return them (asked to stop: jobd.cancel)."""
        taken = [job for job, _claimed in self if job.id in ids]
        if taken:
            self.drop(ids)
        return taken

    def drop(self, ids: set[int]) -> None:
        """Forget jobs (given back, or their lease lost)."""
        if any(job.id in ids for job, _claimed in self):
            kept = [entry for entry in self if entry[0].id not in ids]
            self.clear()
            self.extend(kept)

    def to_give_back(self, now: float, runs_here: RunsHere) -> list[jobs.Job]:
        """The jobs to give back now for their age or their handler. Asked at every turn of
        the loop: with every handler running here, only the head's age can say yes."""
        stale = now - BUFFER_MAX_AGE
        if runs_here is None:
            if not self or self[0][1] >= stale:
                return []
            return [job for job, claimed_at in self if claimed_at < stale]
        return [job for job, claimed_at in self
                if claimed_at < stale or not runs_here(job.handler)]


def any_to_give_back(entries: Iterable[Entry], now: float, runs_here: RunsHere) -> bool:
    """Whether :meth:`ClaimBuffer.to_give_back` would name any of ``entries`` (jobs on
    deck) were they buffered."""
    stale = now - BUFFER_MAX_AGE
    if runs_here is None:
        return any(claimed_at < stale for _job, claimed_at in entries)
    return any(claimed_at < stale or not runs_here(job.handler)
               for job, claimed_at in entries)
