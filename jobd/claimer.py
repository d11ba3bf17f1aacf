"""The claim side of a worker: what to claim and when, the buffer of jobs claimed ahead of
free slots (the lane's ``prefetch``), and the rules for suspects. Decisions only: the
worker's loop does the round trips.

- A worker claims up to ``concurrency + prefetch`` jobs (prefetch: 3 x concurrency unless the
  lane sets it) and tops its buffer up once it is
  half empty, so claims come in batches while handlers see ``concurrency`` jobs at a time.
- Buffered jobs go back to the queue when the worker stops taking work (a drain, a
  retirement, a suspect to run alone) and after :data:`BUFFER_MAX_AGE` unstarted; a buffer
  given back for its age is not claimed back until a slot frees.
- A suspect (see ``recovery.settle_crashed_worker``) runs alone: it is asked for only by a
  worker that holds nothing, and nothing else is claimed while it runs.
"""

from __future__ import annotations

import collections
import time

import structlog

from jobd import jobs, queue
from jobd.config import LaneConfig
from jobd.protocol import WorkerMode

# Claimed jobs waiting for a free slot go back to the queue after this long: a buffer that
# sits still must not keep work from other workers, or priorities from being looked at anew.
BUFFER_MAX_AGE = 2.0

log = structlog.get_logger("jobd.claimer")


class Claimer:
    def __init__(self, lane: LaneConfig, worker_id: str) -> None:
        self.lane = lane
        self.worker_id = worker_id
        self.maybe_more = True  # there may be due work: claim when capacity allows
        # Oldest first, with the monotonic instant of their claim.
        self.buffer: collections.deque[tuple[jobs.Job, float]] = collections.deque()
        # Whether a suspect may be due in the lane: a new worker looks once; the supervisor
        # says so again (a SUSPECTS byte) when it makes some or one falls due.
        self.suspects_possible = True
        self.isolating: int | None = None  # the suspect this worker runs alone
        self.held_back = False  # the buffer went back for its age; no claim until a slot frees

    def leases(self) -> list[jobs.Lease]:
        return [job.lease for job, _claimed in self.buffer]

    def oldest_claim(self) -> float | None:
        return self.buffer[0][1] if self.buffer else None

    def request(self, mode: WorkerMode, running: int) -> queue.ClaimRequest | None:
        """What to claim now, given ``running`` jobs in the slots, or None."""
        if mode != WorkerMode.RUNNING or not self.maybe_more or self.isolating is not None:
            return None
        if self.held_back and running >= self.lane.concurrency:
            return None
        if self.suspects_possible and (running or self.buffer):
            # A suspect is due and runs only on a worker that holds nothing: claim nothing
            # more until the jobs in flight are done (the buffer goes back to the queue), so
            # it cannot wait behind a busy lane.
            return None
        prefetch = self.lane.buffer_size
        free = self.lane.concurrency + prefetch - running - len(self.buffer)
        if free <= 0 or len(self.buffer) > prefetch // 2:
            return None
        return queue.ClaimRequest(self.lane.name, self.worker_id, free,
                                  self.lane.visibility_timeout,
                                  suspect_first=self.suspects_possible and not running)

    def took(self, claimed: queue.Claimed, request: queue.ClaimRequest) -> list[jobs.Job]:
        """Record what a claim brought; returns the jobs to start at once (a suspect)."""
        if request.suspect_first and claimed.suspect is None:
            self.suspects_possible = False  # none due now; the supervisor says when again
        # A suspect runs alone; once it is done the worker is idle and asks for the next.
        self.maybe_more = (len(claimed.jobs) == request.limit
                           or claimed.suspect is not None)
        if claimed.suspect is not None:
            self.isolating = claimed.suspect.id
            log.info("running a suspect alone", job_id=claimed.suspect.id,
                     handler=claimed.suspect.handler)
            return [claimed.suspect]
        now = time.monotonic()
        self.buffer.extend((job, now) for job in claimed.jobs)
        return []

    def next_to_start(self, mode: WorkerMode, running: int) -> jobs.Job | None:
        if (self.buffer and running < self.lane.concurrency and mode == WorkerMode.RUNNING
                and self.isolating is None):
            return self.buffer.popleft()[0]
        return None

    def to_release(self, mode: WorkerMode, now: float) -> list[jobs.Job]:
        """Buffered jobs to give back now."""
        if mode != WorkerMode.RUNNING or self.suspects_possible:
            return [job for job, _claimed in self.buffer]
        return [job for job, claimed_at in self.buffer if claimed_at < now - BUFFER_MAX_AGE]

    def released(self, mode: WorkerMode, ids: set[int]) -> None:
        self.held_back = mode == WorkerMode.RUNNING and not self.suspects_possible
        self.drop(ids)

    def drop(self, ids: set[int]) -> None:
        """Forget buffered jobs (given back, or their lease lost)."""
        if any(job.id in ids for job, _claimed in self.buffer):
            self.buffer = collections.deque(e for e in self.buffer if e[0].id not in ids)

    def finished(self, job_id: int) -> None:
        """A job left its slot (done, or failed for its timeout)."""
        self.held_back = False
        if self.isolating == job_id:
            self.isolating = None
