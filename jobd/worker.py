"""A worker process: claims jobs of one lane and runs them.

The supervisor starts it as ``python -m jobd.worker`` with a :class:`WorkerSpec` as JSON on
stdin (a fresh interpreter: no connection, lock or thread of the supervisor's crosses over).

One thread, the loop in :class:`Worker`, owns the database connection: it claims batches up to
free capacity, flushes completions and failures in batches, renews the leases of running jobs
in one statement, and tells the supervisor it is alive. Handlers run elsewhere: sync ones in a
thread pool of the lane's ``concurrency``, ``async def`` ones on an event loop thread. The loop
sleeps in ``select`` until the supervisor wakes it (new work in the lane), a handler finishes,
a signal arrives, or a timer is due; the jittered ``poll_interval`` is only a safety net.

Controls: the worker reads its lane's pauses when it connects and whenever the supervisor
says they changed (``jobd.claimer`` decides what a pause means for claiming and the buffer).
A job asked to stop (``jobd.cancel``) shows in the heartbeat's result: the worker tells its
handler (``job.cancelled``, or CancelledError for an async one), or finishes it unstarted if
it was still in the buffer.

Signals: SIGTERM drains (stop claiming, let jobs finish up to ``shutdown_timeout``, release
the rest); SIGUSR2 retires (finish every job, however long, then exit: used when a reload
replaces the worker); SIGQUIT or a second SIGTERM stops at once, releasing what it holds.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import setproctitle
import structlog

from jobd import handlers as handler_registry
from jobd import jobs, logs, outbox, pauses, pipes, protocol, queue, recovery
from jobd.claim_floors import full_scan_params
from jobd.claimer import BUFFER_MAX_AGE, Claimer
from jobd.completer import Completer, Counters
from jobd.db import ManagedConnection
from jobd.eventloop import SelectLoop
from jobd.handler_runner import HandlerRunner, Outcome
from jobd.protocol import (
    EXIT_BOOT_FAILURE,
    EXIT_OK,
    EXIT_WEDGED,
    StatusReport,
    WorkerMode,
    WorkerSpec,
)

REPORT_INTERVAL = 1.0  # seconds between liveness reports to the supervisor
SAFETY_POLL_FACTOR = 12  # a worker's own fallback poll, in lane poll_intervals

log = structlog.get_logger("jobd.worker")


@dataclass(slots=True)
class Running:
    job: jobs.Job
    started: float
    deadline: float | None
    abandoned: bool = False  # failed for its timeout; the thread has not returned yet
    lease_lost: bool = False  # a heartbeat found it expired and swept, or claimed again
    cancel_sent: bool = False  # the handler was told to stop (jobd.cancel)


@dataclass(slots=True)
class _Timers:
    next_poll: float = 0.0
    next_heartbeat: float = 0.0
    next_report: float = 0.0
    wake_at: list[float] = field(default_factory=list)  # retries of our own failed jobs


class Worker:
    def __init__(self, spec: WorkerSpec, resolved: dict[str, handler_registry.ResolvedHandler]):
        self.spec = spec
        self.lane = spec.lane
        self.handlers = resolved
        self.link = ManagedConnection(
            spec.database_url, spec.schema,
            protocol.backend_name(spec.worker_id,
                                  f"{spec.lane.name}/{spec.slot} node={spec.node}"),
            # The server may have run a claim whose result we never read.
            on_lost=self._claims_now_unknown,
            # A failed statement is retried with the same leases, which decide what still
            # applies (in a pipelined settle, statements before it may have committed).
            pause_after_failure=1.0, session=spec.session)
        self.inflight: dict[int, Running] = {}
        self.claimer = Claimer(spec.lane, spec.worker_id)
        # After an exchange failed, the next one writes outcomes apart from its claim, so a
        # claim that keeps failing cannot keep undoing them.
        self.separate_next = False
        # Set when a claim may have taken jobs whose rows never reached us (the connection
        # broke, or the rows could not be loaded): the loop then checks the jobs claimed in
        # our name against the ones it holds.
        self.claims_unknown = False
        # The lane's pauses must be read (again): at start, on a new connection, when the
        # supervisor says they changed, and at the safety poll while the lane is paused.
        self.controls_stale = True
        self.counters = Counters.for_spec(spec)
        self.completer = Completer(spec.lane, self.counters)
        self.timers = _Timers()
        self.mode = WorkerMode.RUNNING
        self.drain_deadline: float | None = None
        self.stop_now = False
        self.runner = HandlerRunner(spec, resolved)
        self.loop = SelectLoop()
        for fd in (spec.wake_fd, spec.status_fd):
            os.set_blocking(fd, False)
        self.loop.register(spec.wake_fd, self._on_wake)
        self.loop.register(self.runner.results_r, pipes.drain)

    @property
    def conn(self) -> psycopg.Connection | None:
        return self.link.conn

    # --- signals ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        # Ctrl-C in a terminal reaches the whole process group; the supervisor decides.
        self.loop.install_signals((signal.SIGTERM, signal.SIGUSR2, signal.SIGQUIT),
                                  ignored=(signal.SIGINT,))

    def _handle_signals(self) -> None:
        for signum in self.loop.take_signals():
            self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGQUIT or (signum == signal.SIGTERM
                                        and self.mode == WorkerMode.DRAINING):
            log.info("stopping at once", signal=signal.Signals(signum).name)
            self.stop_now = True
        elif signum == signal.SIGTERM:
            self.mode = WorkerMode.DRAINING
            self.drain_deadline = time.monotonic() + self.spec.shutdown_timeout
            log.info("draining", in_flight=len(self.inflight),
                     shutdown_timeout=self.spec.shutdown_timeout)
        elif signum == signal.SIGUSR2 and self.mode == WorkerMode.RUNNING:
            self.mode = WorkerMode.RETIRING
            log.info("retiring", in_flight=len(self.inflight))

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        now = time.monotonic()
        self.timers.next_poll = now + self._poll_delay()
        self.timers.next_heartbeat = now + self.lane.heartbeat
        self._report(force=True)
        while True:
            self.loop.wait(self._select_timeout())
            self._handle_signals()
            if self.stop_now:
                break
            self._ensure_connection()
            if self.claims_unknown and self.conn is not None:
                self._fail_claims_not_held()
            self._refresh_controls()
            self._collect_outcomes()
            self._fill_slots()
            self._expire_timeouts()
            self._renew_leases()
            self._release_buffer()
            self._settle_and_claim()
            self._arm_if_idle()
            self._report()
            if self._finished():
                break
            if len(self.inflight) >= self.lane.concurrency and all(
                    r.abandoned for r in self.inflight.values()):
                log.error("every slot is held by a handler that ignored its timeout; exiting")
                self._shutdown()
                return EXIT_WEDGED
        self._shutdown()
        return EXIT_OK

    def _finished(self) -> bool:
        if self.mode == WorkerMode.RUNNING:
            return False
        working = [r for r in self.inflight.values() if not r.abandoned]
        if not working and not self.completer.pending and not self.claimer.buffer:
            return True
        return (self.mode == WorkerMode.DRAINING and self.drain_deadline is not None
                and time.monotonic() >= self.drain_deadline)

    def _select_timeout(self) -> float:
        now = time.monotonic()
        moments = [self.timers.next_heartbeat, self.timers.next_report]
        # Moments that need the database are no sooner than it can be used again: a poll that
        # is overdue because the database is down must not turn the loop into a spin.
        database_ready = self.link.ready_at()
        if self.mode == WorkerMode.RUNNING:
            moments += [max(moment, database_ready)
                        for moment in (self.timers.next_poll, *self.timers.wake_at)]
        if self.conn is None or database_ready > now:
            moments.append(database_ready)
        if self.drain_deadline is not None:
            moments.append(self.drain_deadline)
        moments.extend(r.deadline for r in self.inflight.values()
                       if r.deadline is not None and not r.abandoned)
        settle_at = self.completer.due_at()
        if settle_at is not None:
            moments.append(max(settle_at, database_ready))
        for moment in (self.claimer.next_try_at, self.claimer.recheck_at):
            if moment is not None:
                moments.append(max(moment, database_ready))
        oldest_claim = self.claimer.oldest_claim()
        if oldest_claim is not None:
            moments.append(oldest_claim + BUFFER_MAX_AGE)
        return max(0.0, min(moments) - now)

    def _poll_delay(self) -> float:
        # The supervisor polls each lane every poll_interval and wakes its workers; a worker
        # polls by itself only much more rarely, in case the supervisor cannot. Jitter keeps
        # a fleet of idle workers from polling in lockstep.
        return self.lane.poll_interval * SAFETY_POLL_FACTOR * random.uniform(0.8, 1.2)

    def _on_wake(self, fd: int) -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if not data:
            # The supervisor is gone (even kill -9 closes its end): stop claiming and drain
            # like SIGTERM, whatever the mode. A retiring worker would otherwise finish
            # every job however long it takes, with no supervisor to account for it.
            self.loop.unregister(fd)
            log.warning("supervisor gone; draining", mode=str(self.mode),
                        in_flight=len(self.inflight))
            if self.mode != WorkerMode.DRAINING:
                self._on_signal(signal.SIGTERM)
            return
        log.debug("woken", lane=self.lane.name)
        self.claimer.maybe_more = True
        if protocol.SUSPECTS in data:
            self.claimer.suspects_possible = True
        if protocol.CONTROLS in data:
            self.controls_stale = True
        if protocol.CANCELS in data:
            self.timers.next_heartbeat = 0.0  # the renewal's result names the jobs

    # --- database --------------------------------------------------------------------------

    def _ensure_connection(self) -> None:
        if self.link.ensure():
            self.claimer.maybe_more = True
            self.claimer.disconnected()
            self.controls_stale = True

    def _refresh_controls(self) -> None:
        """Read the lane's pauses when they may have changed. While the lane is paused the
        worker claims nothing, so its safety poll becomes a look at the pauses instead."""
        now = time.monotonic()
        if self.claimer.lane_paused and now >= self.timers.next_poll:
            self.controls_stale = True
        if not self.controls_stale or self.conn is None:
            return
        state = self._db(lambda conn: pauses.lane_controls(conn, self.lane.name))
        if state is None:
            return  # tried again next turn
        self.controls_stale = False
        self.timers.next_poll = now + self._poll_delay()
        lane_paused, handlers = state
        was_paused = (self.claimer.lane_paused, self.claimer.paused_handlers)
        resumed = self.claimer.set_controls(lane_paused, handlers)
        if (lane_paused, handlers) != was_paused:
            log.info("lane pauses", lane=self.lane.name, lane_paused=lane_paused,
                     paused_handlers=sorted(handlers), resumed=resumed)
        # Armed, the worker would make every enqueue into the paused lane notify.
        if (lane_paused and self.claimer.armed and self._db(
                lambda conn: queue.disarm(conn, self.spec.worker_id)) is not None):
            self.claimer.armed = False

    def _db(self, operation: Callable[[psycopg.Connection], Any], what: str = "queue") -> Any:
        """Run ``operation`` on the connection; None when there is none or it failed."""
        return self.link.run(what, operation)

    def _claims_now_unknown(self) -> None:
        self.claims_unknown = True

    def _fail_claims_not_held(self) -> None:
        """Fail the jobs claimed under this worker's name that it does not hold: a claim whose
        rows never reached it. Without this they would wait for their lease to expire. They
        count as a failed attempt (retried after the backoff, dead when the budget is
        spent), so a job whose claim fails the same way every time cannot loop forever."""
        held = [r.job.lease for r in self.inflight.values()]
        held += [o.job.lease for o in self.completer.pending]
        held += self.claimer.leases()
        policy = self.lane.retry_policy
        outcome = self._db(lambda conn: recovery.fail_claims_not_held(
            conn, self.spec.worker_id, held,
            "claimed, but the claim's result never reached the worker", lambda _lane: policy))
        if outcome is None:
            return  # the database failed again; the flag stays and the loop tries again
        self.claims_unknown = False
        orphans = outcome.retried + outcome.dead
        if orphans:
            # Their retries wake a worker like any other: the jobs table's trigger announces
            # the new run_at and the supervisor sets a timer for it.
            log.warning("failed jobs claimed without reaching this worker", job_ids=orphans,
                        dead=outcome.dead)

    # --- claiming and running --------------------------------------------------------------

    def _claim_request(self) -> queue.ClaimRequest | None:
        """What to claim now, or None: only when running, with room, and maybe work."""
        now = time.monotonic()
        if any(t <= now for t in self.timers.wake_at) or now >= self.timers.next_poll:
            self.timers.wake_at = [t for t in self.timers.wake_at if t > now]
            self.claimer.maybe_more = True
        self.claimer.try_due(now)
        return self.claimer.request(self.mode, len(self.inflight))

    def _arm_if_idle(self) -> None:
        """Out of work: ask to be woken (see ``jobd.claimer``, wake-ups)."""
        now = time.monotonic()
        if self.conn is None or not self.claimer.wants_arm(self.mode, now):
            return
        floors = self.claimer.floors.params(now)
        result = self._db(lambda conn: queue.arm(conn, self.lane.name, self.spec.worker_id,
                                                 floors))
        if result is not None:
            self.claimer.arm_result(result, time.monotonic(),
                                    from_head=floors == full_scan_params())
            if result == "paused":
                self.controls_stale = True  # learn which pauses, and whether still so

    def _started(self, claimed: queue.Claimed, request: queue.ClaimRequest) -> None:
        self.timers.next_poll = time.monotonic() + self._poll_delay()
        taken = [claimed.suspect, *claimed.jobs] if claimed.suspect else claimed.jobs
        self.counters.count_claimed(taken)
        if taken:
            log.debug("claimed", lane=self.lane.name, job_ids=[job.id for job in taken])
        for job in self.claimer.took(claimed, request):
            self._start(job)
        self._fill_slots()

    def _fill_slots(self) -> None:
        """Start buffered jobs in the free slots: no round trip between one job and the next."""
        while (job := self.claimer.next_to_start(self.mode, len(self.inflight))) is not None:
            self._start(job)

    def _release_buffer(self) -> None:
        leaving = self.claimer.to_release(self.mode, time.monotonic())
        if not leaving:
            return
        leases = [job.lease for job in leaving]
        if self._db(lambda conn: queue.release(conn, leases)) is None:
            return  # the leases are still ours; tried again next turn
        gone = {job.id for job in leaving}
        self.claimer.released(self.mode, gone)
        self.counters.count_released(leaving)
        log.debug("released buffered jobs", job_ids=sorted(gone))

    def _start(self, job: jobs.Job) -> None:
        started = time.monotonic()
        deadline = started + self.lane.timeout if self.lane.timeout else None
        self.inflight[job.id] = Running(job, started, deadline)
        self.runner.start(job)

    def _collect_outcomes(self) -> None:
        for outcome in self.runner.collect():
            running = self.inflight.get(outcome.job.id)
            if running is None or running.job.lease_token != outcome.job.lease_token:
                # A run abandoned for its timeout whose job was claimed again since (here or
                # elsewhere): the late result changes nothing, and the new run stays held.
                continue
            del self.inflight[outcome.job.id]
            self.claimer.finished(outcome.job.id)
            if running.abandoned:
                continue  # already failed for its timeout; the late result changes nothing
            self.completer.add(outcome)

    def _expire_timeouts(self) -> None:
        now = time.monotonic()
        for running in self.inflight.values():
            if running.deadline is not None and now >= running.deadline and not running.abandoned:
                job = running.job
                if self.runner.is_async(job.handler):
                    continue  # asyncio.wait_for cancels it and reports the timeout itself
                running.abandoned = True
                # Failed for its timeout, it spends its attempt like any hung job; the thread
                # it holds must not keep the worker from claiming.
                self.claimer.finished(job.id)
                self.completer.add(Outcome(job, f"timed out after {self.lane.timeout:g}s"))
                log.warning("job timed out", job_id=job.id, handler=job.handler,
                            timeout=self.lane.timeout)

    def _settle_and_claim(self, claim: bool = True) -> None:
        """Write finished jobs' outcomes and claim more work: one round trip, one commit."""
        if self.conn is None:
            return
        request = self._claim_request() if claim else None
        if request is None and not (self.completer.pending and (
                not claim or self.completer.due(busy=self._busy()))):
            return
        batch = self.completer.batch()
        separate = self.separate_next
        written = self._db(lambda conn: queue.settle_and_claim(
            conn, batch.successes, batch.failures, request, separate=separate))
        if written is None:
            if request is not None:
                # The claim may have committed even if its rows did not reach us.
                self.claims_unknown = True
                self.separate_next = True
            return  # kept for the next connection: the leases still decide what applies
        self.separate_next = False
        completed, failed, claimed = written
        self.timers.wake_at.extend(self.completer.written(batch, completed, failed))
        # Freed capacity alone is no reason to claim: only a claim that came back full, a
        # wake-up, a timer or a poll says there may be more work (maybe_more).
        if request is not None:
            self._started(claimed, request)

    def _busy(self) -> bool:
        """More outcomes will come soon: jobs run or wait, and the worker takes work."""
        return self.mode == WorkerMode.RUNNING and bool(self.inflight or self.claimer.buffer)

    def _renew_leases(self) -> None:
        now = time.monotonic()
        if now < self.timers.next_heartbeat:
            return
        self.timers.next_heartbeat = now + self.lane.heartbeat
        held = [r.job.lease for r in self.inflight.values() if not r.abandoned and not r.lease_lost]
        held += self.claimer.leases()
        if not held:
            return
        renewed = self._db(lambda conn: queue.heartbeat(conn, held, self.lane.visibility_timeout))
        if renewed is None:
            return
        lost = []
        gone = set(renewed.lease_lost)
        # Buffered and swept (a worker too slow to renew): never started, just dropped.
        self.claimer.drop(gone)
        if renewed.cancelled:
            self._stop_cancelled(set(renewed.cancelled))
        for job_id in renewed.lease_lost:
            running = self.inflight.get(job_id)
            if running is None:
                continue
            running.lease_lost = True
            # A transactional job completes itself when it commits; its lease is gone then
            # and its outcome (done, or LeaseLost) is on the way. Only the others are lost.
            if not self.runner.is_transactional(running.job.handler):
                lost.append(job_id)
        if lost:
            log.warning("lease lost while running (expired and swept?)", job_ids=lost)

    def _stop_cancelled(self, ids: set[int]) -> None:
        """Jobs asked to stop (jobd.cancel): a buffered one is finished unstarted (its
        completion archives it as cancelled), a running one's handler is told."""
        for job in self.claimer.take(ids):
            self.completer.add(Outcome(job, None))
        told = []
        for job_id in sorted(ids):
            running = self.inflight.get(job_id)
            if running is not None and not running.cancel_sent and not running.abandoned:
                running.cancel_sent = True
                self.runner.cancel(running.job)
                told.append(job_id)
        if told:
            log.info("asked handlers to stop (cancel requested)", job_ids=told)

    # --- reporting and shutdown ------------------------------------------------------------

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.timers.next_report:
            return
        self.timers.next_report = now + REPORT_INTERVAL
        running, buffered = len(self.inflight), len(self.claimer.buffer)
        title = (f"jobd: worker {self.lane.name}#{self.spec.slot} "
                 f"busy {running}/{self.lane.concurrency}")
        if buffered:
            title += f" +{buffered} claimed ahead"
        if self.mode != WorkerMode.RUNNING:
            title += f" {self.mode}"
        setproctitle.setproctitle(title)
        # Busy and capacity count the buffer: a worker whose buffer is full claims nothing,
        # so waking it would only cost a round trip.
        report = StatusReport(running + buffered, self.lane.concurrency + self.lane.buffer_size,
                              self.mode, self.conn is not None, self.counters.as_dict(),
                              self.counters.work_totals())
        try:
            os.write(self.spec.status_fd, report.to_line())
        except (BlockingIOError, BrokenPipeError):
            pass  # the supervisor reads when it can; a missed report only delays its view

    def _shutdown(self) -> None:
        self._collect_outcomes()
        if self.conn is None:
            self.link.retry_at = 0.0  # one more try, whatever the backoff said
            self._ensure_connection()
        self._settle_and_claim(claim=False)
        unfinished = [r.job.lease for r in self.inflight.values() if not r.abandoned]
        unfinished += self.claimer.leases()
        if unfinished:
            released = self._db(lambda conn: queue.release(conn, unfinished))
            log.info("released unfinished jobs", job_ids=[lease.id for lease in unfinished],
                     released=len(released.applied) if released else 0)
        if self.claimer.armed:
            self._db(lambda conn: queue.disarm(conn, self.spec.worker_id))
        self._report(force=True)
        self.link.close()
        self.runner.close()


def main() -> int:
    spec = WorkerSpec.from_json(sys.stdin.read())
    logs.configure(spec.log_level, process=f"worker {spec.lane.name}#{spec.slot}",
                   worker=spec.worker_id, pid=os.getpid())
    setproctitle.setproctitle(f"jobd: worker {spec.lane.name}#{spec.slot} starting")
    faulthandler.enable()  # SIGABRT from the supervisor dumps every thread's stack
    logs.capture_handler_output(spec.log_level)
    try:
        resolved = handler_registry.resolve_all(spec.handlers)
        outbox.install(
            {name: r.func for name, r in handler_registry.resolve_all(spec.senders).items()},
            spec.outbox_lane, spec.schema)
    except handler_registry.HandlerImportError as exc:
        log.error("boot failure", error=str(exc))
        return EXIT_BOOT_FAILURE
    worker = Worker(spec, resolved)
    worker.install_signal_handlers()
    log.info("worker started", lane=spec.lane.name, generation=spec.generation,
             concurrency=spec.lane.concurrency)
    return worker.run()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Handler threads that ignored their timeout must not keep the process alive.
    os._exit(code)
