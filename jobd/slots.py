"""The running jobs of a worker: one :class:`Running` per job in a slot of the lane's
``concurrency``, from its start to the outcome the completer writes.

Starting pulls from the claimer's buffer, so a freed slot takes the next job without a round
trip. Where jobs are short (the claimer's buffer is above its floor) and every handler runs
on a thread, more jobs wait on deck (half the buffer: :meth:`Slots.deck_size`), in the
threads' queue: a thread that finishes takes the next one itself instead of waiting for the
loop to hand it over (two thread hand-offs and a pipe wake-up per job at 1 x 10), also while
the loop waits for a claim. A job on deck has not started: its timeout runs from its
thread's start, and whenever the buffer is acted on for anything but starting (given back,
asked to stop, a lease lost, shutdown) the deck goes back to the buffer first
(:meth:`Slots.take_back_deck`), so the buffer's rules apply to it unchanged.

A job leaves its slot when its handler's outcome arrives, or when it overruns the
lane's timeout: it is failed then (its attempt is spent like any hung job's), but the thread
that runs it stays taken until the handler returns, which is why an abandoned run still sits
here and counts toward :meth:`Slots.wedged` (in :attr:`Slots.held` once the worker claimed
its job again: a retry of a handler that hangs on every attempt takes a thread of its own).
An async run is cancelled at its timeout by its own deadline on the event loop; the worker
fails it itself :data:`ASYNC_GRACE` later, if it has not ended by then (it blocks the loop,
or swallowed the cancel).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from jobd import jobs, pipes
from jobd.claimer import Claimer
from jobd.completer import Completer
from jobd.config import LaneConfig
from jobd.handler_runner import HandlerRunner
from jobd.outcomes import Outcome
from jobd.protocol import WorkerMode

log = structlog.get_logger("jobd.worker")

# How long past the lane's timeout an async run may take to end by the cancel its own
# deadline sends (jobd.outcomes.within_timeout) before the worker fails it itself, as it
# fails a sync run: the handler blocked the event loop, or swallowed the CancelledError.
ASYNC_GRACE = 1.0


@dataclass(slots=True)
class Running:
    job: jobs.Job
    claimed_at: float  # monotonic: when its claim came back (the buffer's age rule)
    timeout: float | None  # the lane's, plus ASYNC_GRACE for an async handler
    started: float | None = None  # monotonic; None while it waits on deck
    taken_back: bool = False  # taken off the deck before a thread started it
    abandoned: bool = False  # failed for its timeout; the thread has not returned yet
    lease_lost: bool = False  # a heartbeat found it expired and swept, or claimed again
    cancel_sent: bool = False  # the handler was told to stop (jobd.cancel)

    @property
    def deadline(self) -> float | None:
        """When the run overruns the lane's timeout; None without one or before it starts."""
        if self.started is None or not self.timeout:
            return None
        return self.started + self.timeout


class Slots:
    """The jobs in the slots; outcomes go to the completer, freed slots to the claimer."""

    def __init__(self, lane: LaneConfig, runner: HandlerRunner, claimer: Claimer,
                 completer: Completer) -> None:
        self.lane = lane
        self.runner = runner
        self.claimer = claimer
        self.completer = completer
        self.inflight: dict[int, Running] = {}
        # Abandoned runs whose job this worker claimed again since: the new run has the job's
        # place in ``inflight``, but the old thread is still taken until its handler returns.
        self.held: list[Running] = []

    def __len__(self) -> int:
        """The slots taken: every run, abandoned ones included (their threads are busy)."""
        return len(self.inflight) + len(self.held)

    def start(self, job: jobs.Job, claimed_at: float | None = None) -> None:
        earlier = self.inflight.get(job.id)
        if earlier is not None and earlier.abandoned:
            self.held.append(earlier)
        timeout = self.lane.timeout or None
        if timeout and self.runner.is_async(job.handler):
            timeout += ASYNC_GRACE
        running = Running(job, time.monotonic() if claimed_at is None else claimed_at,
                          timeout)
        self.inflight[job.id] = running
        self.runner.start(running)

    def fill(self, mode: WorkerMode) -> None:
        """Start buffered jobs in the free slots, and on deck: no round trip between one job
        and the next."""
        room = self.lane.concurrency + self.deck_size()
        claimer, inflight = self.claimer, self.inflight
        while (taken := claimer.next_to_start(mode, len(inflight), room)) is not None:
            self.start(*taken)

    def deck_size(self) -> int:
        """How many jobs may wait on deck now: half the buffer the claimer claims for, and
        at least ``concurrency``, while the jobs are short (an adapted buffer grew above its
        floor, or a fixed one, the lane's ``prefetch``, holds less than the horizon's work:
        :mod:`jobd.prefetch`; a fixed buffer without a deck drained 1 x 10 at 0.6 x) and
        no handler is async (the event loop takes every job at once), else none. Half, so
        that the threads have work while the loop waits for a claim, which it sends once
        the buffer is down to half: with ``concurrency`` alone (10 jobs, a third of a
        millisecond at 1 x 10) they ran dry early in each claim's round trip."""
        prefetch = self.claimer.prefetch
        if self.runner.threads_only and (prefetch.size > prefetch.floor or prefetch.short):
            return max(self.lane.concurrency, prefetch.size // 2)
        return 0

    def on_deck(self) -> list[tuple[jobs.Job, float]]:
        """The jobs waiting on deck, with their claim times, in the order they were handed
        over (a thread may start one at any moment: this is a snapshot)."""
        return [(r.job, r.claimed_at) for r in self._deck()]

    def oldest_on_deck(self) -> float | None:
        """When the oldest job on deck was claimed, or None with none on deck."""
        return min((r.claimed_at for r in self._deck()), default=None)

    def _deck(self, suspect_too: bool = False) -> Iterator[Running]:
        """The runs waiting on deck; a suspect waiting for its thread only with
        ``suspect_too``."""
        isolating = None if suspect_too else self.claimer.isolating
        return (r for r in self.inflight.values()
                if r.started is None and r.job.id != isolating)

    def recall_deck(self, mode: WorkerMode, now: float) -> None:
        """Take the deck back if the buffer's rules would give back any job on it (a drain,
        a pause, a suspect due, its age): at once, so that no thread starts it meanwhile."""
        if self.claimer.would_release(mode, self.on_deck(), now):
            self.take_back_deck()

    def take_back_deck(self, suspect_too: bool = False) -> None:
        """Put the jobs on deck back at the front of the buffer, in their order: none of
        them starts after this (see ``HandlerRunner.take_back``). A suspect waiting for its
        thread is not taken back unless ``suspect_too`` (the worker exits): it was claimed to
        run alone, whatever else the loop does."""
        waiting = list(self._deck(suspect_too))
        if not waiting:
            return
        taken = self.runner.take_back(waiting)
        for running in taken:
            del self.inflight[running.job.id]
        self.claimer.buffer.put_back([(r.job, r.claimed_at) for r in taken])

    @property
    def results_fd(self) -> int:
        """Readable when handlers have delivered outcomes (the runner's self-pipe)."""
        return self.runner.results_r

    def turn_over(self, mode: WorkerMode) -> None:
        """Take the delivered outcomes and start buffered jobs in the slots they free, with
        no database work: what the loop does while an exchange waits for the server."""
        pipes.drain(self.results_fd)  # before collect: a poke after it is never lost
        self.collect()
        self.fill(mode)

    def collect(self) -> None:
        """Take the handlers' outcomes: each frees its slot and waits in the completer."""
        for outcome in self.runner.collect():
            running = self.inflight.get(outcome.job.id)
            if running is None or running.job.lease_token != outcome.job.lease_token:
                # A run abandoned for its timeout whose job was claimed again since (here or
                # elsewhere): the late result changes nothing, and the new run stays held.
                self._release_held(outcome.job)
                continue
            del self.inflight[outcome.job.id]
            self.claimer.finished(outcome.job.id)
            if running.abandoned:
                continue  # already failed for its timeout; the late result changes nothing
            self.completer.add(outcome)

    def _release_held(self, job: jobs.Job) -> None:
        """The thread of an abandoned run superseded by a new claim of its job is free."""
        self.held = [r for r in self.held
                     if (r.job.id, r.job.lease_token) != (job.id, job.lease_token)]

    def expire_timeouts(self, now: float) -> list[jobs.Job]:
        """Fail the runs past their deadline. Returns the transactional ones among them:
        their transactions are to be ended before the failures are written (the worker does
        it, exactly_once.end_abandoned), or they would go on holding the job's effect key,
        and every retry would wait on it past its own timeout."""
        ended = []
        for running in self._working():
            deadline = running.deadline
            if deadline is None or now < deadline:
                continue
            job = running.job
            running.abandoned = True
            # Failed for its timeout, it spends its attempt like any hung job; the thread
            # it holds must not keep the worker from claiming.
            self.claimer.finished(job.id)
            self.completer.add(Outcome(job, f"timed out after {self.lane.timeout:g}s"))
            log.warning("job timed out", job_id=job.id, handler=job.handler,
                        timeout=self.lane.timeout)
            if self.runner.is_transactional(job.handler):
                ended.append(job)
        return ended

    def deadlines(self) -> list[float]:
        """When runs still in their time overrun it (the loop wakes then to fail them)."""
        if not self.lane.timeout:
            return []  # asked at every turn; without a timeout no run has a deadline
        deadlines = (r.deadline for r in self._working())
        return [deadline for deadline in deadlines if deadline is not None]

    def lost_leases(self, job_ids: list[int]) -> list[int]:
        """Mark the runs whose lease a renewal found gone; returns the ones now lost. A
        transactional job completes itself when it commits: its lease is gone then and its
        outcome (done, or LeaseLost) is on the way, so it is not counted lost here."""
        lost = []
        for job_id in job_ids:
            running = self.inflight.get(job_id)
            if running is None:
                continue
            running.lease_lost = True
            if not self.runner.is_transactional(running.job.handler):
                lost.append(job_id)
        return lost

    def tell_cancel(self, job_ids: set[int]) -> list[int]:
        """Tell the handlers of running jobs asked to stop, once each; returns those told."""
        told = []
        for job_id in sorted(job_ids):
            running = self.inflight.get(job_id)
            if running is not None and not running.cancel_sent and not running.abandoned:
                running.cancel_sent = True
                self.runner.cancel(running.job)
                told.append(job_id)
        return told

    def all_leases(self) -> list[jobs.Lease]:
        """Every lease in the slots, abandoned runs included: jobs this worker holds."""
        return [r.job.lease for r in self.inflight.values()]

    def renewable_leases(self) -> list[jobs.Lease]:
        """The leases a heartbeat keeps: runs still working whose lease is not known lost."""
        return [r.job.lease for r in self._working() if not r.lease_lost]

    def unfinished_leases(self) -> list[jobs.Lease]:
        """The leases to give back at shutdown (an abandoned run's job is failed already)."""
        return [r.job.lease for r in self._working()]

    def working(self) -> int:
        """Runs not abandoned: the ones a drain or retirement waits for."""
        return sum(1 for _running in self._working())

    def wedged(self) -> bool:
        """Every thread is held by a handler that ignored its timeout: nothing can run.
        (Counted, not compared with the whole: jobs waiting behind them never start.)"""
        held = sum(1 for r in self.inflight.values() if r.abandoned) + len(self.held)
        return held >= self.lane.concurrency

    def holding_handlers(self) -> dict[str, int]:
        """The handlers whose abandoned runs hold threads, with how many each holds: what the
        operator pauses when the worker exits wedged."""
        held: dict[str, int] = {}
        for run in [*(r for r in self.inflight.values() if r.abandoned), *self.held]:
            held[run.job.handler] = held.get(run.job.handler, 0) + 1
        return held

    def running(self) -> int:
        """Jobs a thread or the event loop has started and not finished."""
        return sum(1 for r in self.inflight.values() if r.started is not None) + len(self.held)

    def _working(self) -> Iterator[Running]:
        return (r for r in self.inflight.values() if not r.abandoned)
