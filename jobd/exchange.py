"""A worker's round trips on the claim side: outcomes written and more work claimed in one
statement and one commit (``queue.settle_and_claim``), buffered jobs given back, arming for
a wake-up when the lane runs dry. A claim whose answer is lost is :mod:`jobd.claim_repair`'s
to look into.

What to claim and when is :class:`jobd.claimer.Claimer`'s decision, which outcomes go in a
batch :class:`jobd.completer.Completer`'s; this module does the statements and hands their
answers back to them. With a :class:`jobd.settler.Settler` the outcomes go on its
connection instead, written while the claims go on the link: the answer comes back in a
later turn of the loop. After a failure there, or to write the last outcomes before the
worker exits, they go with the claims again.
"""

from __future__ import annotations

import time

import psycopg
import structlog

from jobd import claim_floors, fastpath, jobs, queue, unanswered
from jobd.claim_repair import ClaimRepair
from jobd.claimer import Claimer
from jobd.completer import Batch, Completer, Counters
from jobd.db import ManagedConnection
from jobd.outcomes import Outcome
from jobd.protocol import WorkerMode, WorkerSpec
from jobd.settler import Settler
from jobd.slots import Slots
from jobd.worker_controls import Controls
from jobd.worker_timers import Timers

log = structlog.get_logger("jobd.worker")

# A spacing of scans from the head (seconds) that the log mentions: shorter ones come and go
# with a busy machine's round trips.
SPACING_WORTH_SAYING = 10.0
# The weight of the newest round trip in the moving average of the usual one.
ROUND_TRIP_WEIGHT = 0.1


class Exchange:
    """The claim side's statements; the flags say what the last failure left to repair."""

    def __init__(self, spec: WorkerSpec, link: ManagedConnection, claimer: Claimer,
                 completer: Completer, counters: Counters, slots: Slots, timers: Timers,
                 controls: Controls, repair: ClaimRepair, settler: Settler | None = None
                 ) -> None:
        self.spec = spec
        self.lane = spec.lane
        self.link = link
        self.claimer = claimer
        self.completer = completer
        self.counters = counters
        self.slots = slots
        self.timers = timers
        self.controls = controls
        self.repair = repair
        self.settler = settler
        # After an exchange failed, the next one writes outcomes apart from its claim, so a
        # claim that keeps failing cannot keep undoing them.
        self.separate_next = False
        # Seconds a claim round trip from the floors takes, a moving average.
        self.usual_round_trip = 0.0
        # The session is new (the worker's first, or one after a lost connection): its first
        # scan from the head plans its statements and reads a cold cache, and is not what
        # such scans cost (see _round_trip_took).
        self.session_is_new = True

    def session_began(self) -> None:
        """The link has a new connection: its first scan from the head is not charged."""
        self.session_is_new = True

    def settle_and_claim(self, mode: WorkerMode, claim: bool = True) -> None:
        """Write finished jobs' outcomes and claim more work: one round trip, one commit;
        with a settler, the outcomes on its connection and the claim here, side by side."""
        # The last write before exiting (claim=False) waits for the batch on its way, and
        # writes what is left here.
        self.take_settled(wait=not claim)
        if self.link.conn is None:
            return
        request = self._claim_request(mode) if claim else None
        # Outcomes that came while a batch is on its way wait for its answer.
        outcomes_due = bool(self.completer.pending) and not self.completer.handed_over and (
            not claim or request is not None
            or self.completer.due(busy=self._busy(mode), capacity=self.claimer.capacity))
        if (outcomes_due and claim and self.settler is not None
                and self.settler.usable(time.monotonic())):
            self.settler.submit(self.completer.hand_over())
            outcomes_due = False
        if request is None and not outcomes_due:
            return
        batch = self.completer.batch() if outcomes_due else Batch()
        separate = self.separate_next
        # While the server commits (most of the round trip), the slots keep turning over:
        # finished jobs' outcomes are collected for the next batch and buffered jobs start.
        # Without it a worker ran at most one slotful of jobs per commit. Not in the last
        # write before the worker exits (claim=False): what it does not write, it releases,
        # and an outcome collected meanwhile would be neither.
        turn_over = fastpath.WhileWaiting(self.slots.results_fd,
                                          lambda: self.slots.turn_over(mode)) if claim else None
        sent_at = time.monotonic()
        settled: list[tuple[queue.WriteOutcome, queue.FailOutcome]] = []
        written = self.link.run("queue", lambda conn: unanswered.recheck(
            conn, self.spec.worker_id, batch.unanswered, queue.settle_and_claim(
                conn, batch.successes, batch.failures, request, separate=separate,
                while_waiting=turn_over, settled_before_failure=settled)))
        if request is not None:
            # Without the wait for a limited lane's budget lock: other claims' turns are
            # not what a scan from the head costs.
            waited = 0.0 if written is None else written[2].budget_wait
            self._round_trip_took(claim_floors.kind(request.floors),
                                  max(0.0, time.monotonic() - sent_at - waited))
        if written is None:
            if request is not None:
                # The claim may have committed even if its rows did not reach us.
                self.repair.claims_unknown = True
                self.separate_next = True
            if settled:
                # The outcomes committed before the failure: written, not to be sent again
                # (the fence would answer "lease lost" for every one of them).
                completed, failed = settled[0]
                self.timers.wake_at.extend(self.completer.written(batch, completed, failed))
            elif outcomes_due:
                # Kept for the next connection: the leases decide what applies, and what
                # the fence refuses then is looked up.
                self.completer.went_unanswered(batch)
            return
        self.separate_next = False
        completed, failed, claimed = written
        if outcomes_due:
            self.timers.wake_at.extend(self.completer.written(batch, completed, failed))
        # Freed capacity alone is no reason to claim: only a claim that came back full, a
        # wake-up, a timer or a poll says there may be more work (maybe_more).
        if request is not None:
            self._started(mode, claimed, request, sent_at)

    def take_settled(self, wait: bool = False) -> None:
        """The settler's answer for the batch on its way, if it has one (``wait``: block for
        it): counted and logged as any batch, or, not written, put back for the next."""
        answer = None if self.settler is None else self.settler.take(wait)
        if answer is None:
            return
        batch, written = answer
        if written is None:
            self.completer.not_written(batch)
            return
        completed, failed, _claimed = written
        self.timers.wake_at.extend(self.completer.written(batch, completed, failed))

    def _claim_request(self, mode: WorkerMode) -> queue.ClaimRequest | None:
        """What to claim now, or None: only when running, with room, and maybe work."""
        if self._outcomes_backed_up():
            return None
        now = time.monotonic()
        if self.timers.take_due(now):
            self.claimer.maybe_more = True
        self.claimer.try_due(now)
        return self.claimer.request(mode, len(self.slots))

    def _outcomes_backed_up(self) -> bool:
        """Backpressure: while the settler's batch is on its way, a worker's worth of
        outcomes (all it can hold) waiting behind it stops the claims until the answer
        comes (which wakes the loop). Without it a batch stuck on a lock would let finished
        jobs pile up unwritten, their leases not renewed, for as long as it waits."""
        return (self.settler is not None and self.settler.busy
                and len(self.completer.pending) >= self.claimer.capacity)

    def _busy(self, mode: WorkerMode) -> bool:
        """More outcomes will come soon: jobs run or wait, and the worker takes work."""
        return mode == WorkerMode.RUNNING and bool(len(self.slots) or self.claimer.buffer)

    def _started(self, mode: WorkerMode, claimed: queue.Claimed,
                 request: queue.ClaimRequest, sent_at: float) -> None:
        self.timers.poll_later(time.monotonic())
        taken = [claimed.suspect, *claimed.jobs] if claimed.suspect else claimed.jobs
        self.counters.count_claimed(taken)
        if taken:
            log.debug("claimed", lane=self.lane.name, job_ids=[job.id for job in taken])
        slots_free = len(self.slots) < self.lane.concurrency  # the deck's jobs count too
        for job in self.claimer.took(claimed, request, slots_free, sent_at):
            self.slots.start(job)
        self.slots.fill(mode)

    def release_buffer(self, mode: WorkerMode) -> None:
        """Give back the buffered jobs the claimer no longer wants to hold, the ones on
        deck included (taken back first: jobd.slots), and again those whose last release
        went unanswered."""
        now = time.monotonic()
        self.slots.recall_deck(mode, now)
        leaving = self.claimer.to_release(mode, now)
        if leaving:
            # Out of the buffer before the statement goes: a release can commit and its
            # answer be lost with the connection, and then another worker may be running
            # the job already. Started here too, it would run twice at once.
            self.claimer.giving_back(leaving)
        if self.claimer.releasing:
            self._give_back(mode, self.claimer.releasing)

    def _give_back(self, mode: WorkerMode, leaving: list[jobs.Job]) -> None:
        """Release ``leaving``. Fenced, so sent again after a lost answer it applies only
        where the first did not; either way the jobs are no longer this worker's to start.
        A job it leaves because it was asked to stop is finished as cancelled now, as a
        heartbeat's news of the cancel would have it (LeaseKeeper.stop_cancelled): dropped,
        it would stay claimed, renewed by nobody, until the lease sweep ended it."""
        leases = [job.lease for job in leaving]
        stopping = self.link.run("queue", lambda conn: release_unless_stopping(conn, leases))
        if stopping is None:
            return  # out of the buffer still: sent again next turn, started never
        self.claimer.released(mode, {job.id for job in leaving})
        given_back = [job for job in leaving if job.id not in stopping]
        for job in leaving:
            if job.id in stopping:
                self.completer.add(Outcome(job, None))  # its completion archives it cancelled
        self.counters.count_released(given_back)
        log.debug("released buffered jobs", job_ids=sorted(job.id for job in given_back),
                  asked_to_stop=sorted(stopping))

    def arm_if_idle(self, mode: WorkerMode) -> None:
        """Out of work: ask to be woken (see ``jobd.claimer``, wake-ups)."""
        now = time.monotonic()
        if self.link.conn is None or not self.claimer.wants_arm(mode, now):
            return
        floors = self.claimer.floors.params(now)
        probe = claim_floors.kind(floors)
        result = self.link.run("queue", lambda conn: queue.arm(
            conn, self.lane.name, self.spec.worker_id, floors, self.claimer.handlers.lacking))
        self._round_trip_took(probe, time.monotonic() - now)
        if result is not None:
            self.claimer.arm_result(result, time.monotonic(), probe)
            if result == "paused":
                self.controls.stale = True  # learn which pauses, and whether still so

    def _round_trip_took(self, probe: str, seconds: float) -> None:
        """A claim or an arming whose probe was of kind ``probe`` took ``seconds`` (failed
        ones too: a statement timeout says as much about the cost). A scan from the head is
        charged what it took beyond the usual round trip, since the same round trip also
        writes outcomes and commits; the log says when that spaces such scans out well past
        a second, and when they are back to once a second. The first scan from the head of
        a new session is not charged."""
        if probe != claim_floors.HEAD:
            self.usual_round_trip += ROUND_TRIP_WEIGHT * (seconds - self.usual_round_trip)
            return
        if self.session_is_new:
            # A fresh worker's first claim is a scan from the head on a new session, and
            # with no round trip measured yet all of its time (the planning, a cold cache, a
            # busy machine at start) read as the scan's: 50 ms spaced the next ones 25 s
            # apart, and a job due behind the floors waited that long.
            self.session_is_new = False
            return
        floors = self.claimer.floors
        before = floors.full_scan_spacing
        spacing = floors.head_scan_took(max(0.0, seconds - self.usual_round_trip))
        # Info, not a warning: one slow round trip (a stalled flush) does it too, and the
        # horizon's holder is what the supervisor warns about (jobd.duties.horizon_watch).
        if spacing >= SPACING_WORTH_SAYING > before:
            log.info("claims from the head of the lane take long; spacing them out",
                     lane=self.lane.name, head_scan_ms=round(seconds * 1000, 1),
                     every_s=round(spacing, 1), look_back_s=claim_floors.LOOK_BACK)
        elif not floors.spaced_out and before >= SPACING_WORTH_SAYING:
            log.info("claims from the head of the lane are quick again", lane=self.lane.name,
                     head_scan_ms=round(seconds * 1000, 1))


def release_unless_stopping(conn: psycopg.Connection, leases: list[jobs.Lease]) -> set[int]:
    """Release ``leases`` and return the jobs among them that the release left because they
    were asked to stop (release_jobs does not give those back). The others were given back,
    by this release or by an earlier one whose answer was lost, or were not ours any more."""
    kept = set(queue.release(conn, leases).lease_lost)
    return set(queue.asked_to_stop(conn, [lease for lease in leases if lease.id in kept]))
