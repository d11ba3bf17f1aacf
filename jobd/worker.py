"""A worker process: claims jobs of one lane and runs them.

The supervisor starts it as ``python -m jobd.worker`` with a :class:`WorkerSpec` as JSON on
stdin (a fresh interpreter: no connection, lock or thread of the supervisor's crosses over).

One thread, the loop in :meth:`Worker.run`, owns the database connection and takes its steps
in order each turn; the pieces it drives each keep one concern:

- :mod:`jobd.claimer`: what to claim and when; the buffer claimed ahead of free slots;
- :mod:`jobd.exchange`: the round trips (outcomes and claim in one commit, give-backs, arming);
- :mod:`jobd.completer`: outcomes in batches, and the accounting of what was written;
- :mod:`jobd.slots`: the running jobs (start, outcomes, timeouts, cancels);
- :mod:`jobd.handler_runner`: the handlers, on threads (sync) or an event loop (async,
  :mod:`jobd.async_handlers`), each run ending in an outcome (:mod:`jobd.outcomes`);
- :mod:`jobd.leases`: lease renewal, which also reports lost leases and cancels;
- :mod:`jobd.claim_repair`: the repair after a claim whose answer was lost;
- :mod:`jobd.worker_controls`, :mod:`jobd.worker_mode`, :mod:`jobd.worker_timers`,
  :mod:`jobd.worker_wakes`, :mod:`jobd.worker_status`: pauses, signals, when to wake, what a
  wake-up asks, the report to the supervisor; :mod:`jobd.worker_boot`, the process's start.

The loop sleeps in ``select`` until the supervisor wakes it (new work in the lane), a handler
finishes, a signal arrives, or a timer is due; the jittered ``poll_interval`` is only a
safety net.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace

import psycopg
import structlog

from jobd import exactly_once, jobs, pipes, protocol, queue, worker_boot, worker_wakes
from jobd import handlers as handler_registry
from jobd.claim_buffer import BUFFER_MAX_AGE
from jobd.claim_repair import ClaimRepair
from jobd.claimer import Claimer
from jobd.completer import Completer, Counters
from jobd.db import ManagedConnection, SessionSettings, worker_reply_cap, worker_session
from jobd.eventloop import SelectLoop
from jobd.exchange import Exchange
from jobd.handler_runner import HandlerRunner
from jobd.leases import LeaseKeeper
from jobd.protocol import EXIT_BOOT_FAILURE, EXIT_LOOP_FAILED, EXIT_OK, EXIT_WEDGED, WorkerSpec
from jobd.settler import Settler, settles_apart
from jobd.slots import Running, Slots
from jobd.worker_controls import Controls
from jobd.worker_mode import HANDLED_SIGNALS, HELD_AT_START, Lifecycle
from jobd.worker_status import REPORT_INTERVAL, StatusReporter
from jobd.worker_timers import Timers, select_timeout

log = structlog.get_logger("jobd.worker")


class Worker:
    """The loop and the pieces it drives, wired together; each step is theirs."""

    def __init__(self, spec: WorkerSpec, resolved: dict[str, handler_registry.ResolvedHandler]
                 ) -> None:
        self.spec = spec
        self.lane = spec.lane
        self.link = ManagedConnection(
            spec.database_url, spec.schema,
            protocol.worker_connection_name(spec),
            # The server may have run a claim whose result we never read.
            on_lost=self._claims_now_unknown,
            # A failed statement is retried with the same leases, which decide what still
            # applies (in a pipelined settle, statements before it may have committed).
            pause_after_failure=1.0, session=_loop_session(spec))
        self.claimer = Claimer(spec.lane, spec.worker_id, frozenset(resolved))
        self.counters = Counters.for_spec(spec)
        self.completer = Completer(spec.lane, self.counters)
        self.runner = HandlerRunner(spec, resolved)
        self.slots = Slots(spec.lane, self.runner, self.claimer, self.completer)
        self.timers = Timers(spec.lane)
        self.controls = Controls(spec, self.link, self.claimer, self.timers)
        self.settler = Settler(spec) if settles_apart(spec) else None
        self.repair = ClaimRepair(spec, self.link, self.claimer, self.completer, self.slots)
        self.exchange = Exchange(spec, self.link, self.claimer, self.completer, self.counters,
                                 self.slots, self.timers, self.controls, self.repair,
                                 self.settler)
        self.leases = LeaseKeeper(spec.lane, self.link, self.slots, self.claimer,
                                  self.completer)
        self.status = StatusReporter(spec, self.counters, self.runner.board)
        self.lifecycle = Lifecycle(spec.shutdown_timeout)
        self.loop = SelectLoop()
        for fd in (spec.wake_fd, spec.status_fd):
            os.set_blocking(fd, False)
        self.loop.register(spec.wake_fd, self._on_wake)
        self.loop.register(self.runner.results_r, pipes.drain)
        if self.settler is not None:
            self.loop.register(self.settler.wake_fd, pipes.drain)

    @property
    def conn(self) -> psycopg.Connection | None:
        return self.link.conn

    @property
    def inflight(self) -> dict[int, Running]:
        return self.slots.inflight

    @property
    def claims_unknown(self) -> bool:
        return self.repair.claims_unknown

    def install_signal_handlers(self) -> None:
        # Ctrl-C in a terminal reaches the whole process group; the supervisor decides.
        self.loop.install_signals(HANDLED_SIGNALS, ignored=(signal.SIGINT,))

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        now = time.monotonic()
        self.timers.poll_later(now)
        self.leases.start(now)
        self._report(force=True)
        while True:
            self.loop.wait(self._select_timeout())
            for signum in self.loop.take_signals():
                self.lifecycle.on_signal(signum, len(self.slots))
            if self.lifecycle.stop_now:
                break
            self._ensure_connection()
            if self.claims_unknown and self.conn is not None:
                self.repair.repair_lost_claims()
            self._refresh_controls()
            # A drain or a pause just learnt of: no thread may start a job on deck meanwhile.
            self.slots.recall_deck(self.lifecycle.mode, time.monotonic())
            self._collect_outcomes()
            self.slots.fill(self.lifecycle.mode)
            self._end_timed_out(self.slots.expire_timeouts(time.monotonic()))
            self.runner.watch_event_loop(time.monotonic())
            self._renew_leases()
            self._release_buffer()
            self._settle_and_claim()
            self.exchange.arm_if_idle(self.lifecycle.mode)
            self._report()
            if self._finished():
                break
            if self.slots.wedged():
                log.error("every slot is held by a handler that ignored its timeout; exiting",
                          handlers=self.slots.holding_handlers())
                self._shutdown()
                return EXIT_WEDGED
        self._shutdown()
        return EXIT_OK

    def _finished(self) -> bool:
        if self.lifecycle.mode == protocol.WorkerMode.RUNNING:
            return False  # asked at every turn: a running worker holds work or not, it goes on
        holds_work = bool(self.slots.working() or self.completer.pending
                          or self.claimer.buffer or self.claimer.releasing)
        return self.lifecycle.finished(holds_work, time.monotonic())

    def _select_timeout(self) -> float:
        claimer, running = self.claimer, self.lifecycle.mode == protocol.WorkerMode.RUNNING
        # The deck's jobs go back by the buffer's age rule too (Exchange.release_buffer);
        # they came from the buffer's front, so the oldest claim is the deck's if it has any.
        oldest_claim = self.slots.oldest_on_deck()
        if oldest_claim is None and claimer.buffer:
            oldest_claim = claimer.buffer[0][1]
        local = [self.leases.next_at, self.status.next_at, self.lifecycle.drain_deadline,
                 *self.slots.deadlines(),
                 None if oldest_claim is None else oldest_claim + BUFFER_MAX_AGE]
        # The poll and retries only matter to a worker that takes work.
        database = [*((self.timers.next_poll, *self.timers.wake_at) if running else ()),
                    self.completer.due_at(), claimer.arming.next_try_at,
                    claimer.arming.recheck_at, self.repair.due_at()]
        return select_timeout(time.monotonic(), local=local, database=database,
                              database_ready=self.link.ready_at(),
                              connected=self.conn is not None)

    def _on_wake(self, fd: int) -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if not data:
            # The supervisor is gone (even kill -9 closes its end): stop claiming and drain.
            self.loop.unregister(fd)
            self.lifecycle.supervisor_gone(len(self.slots))
            return
        log.debug("woken", lane=self.lane.name)
        worker_wakes.apply(data, self.claimer, self.controls, self.leases)

    # --- the steps (each one call, so a test can drive the loop turn by turn) --------------

    def _ensure_connection(self) -> None:
        if self.link.ensure():
            self.repair.connected()
            self.exchange.session_began()
            self.leases.renew_now()
            self.claimer.maybe_more = True
            self.claimer.arming.disconnected()
            self.controls.stale = True

    def _claims_now_unknown(self) -> None:
        self.repair.connection_lost()

    def _refresh_controls(self) -> None:
        self.controls.refresh(time.monotonic())

    def _collect_outcomes(self) -> None:
        self.slots.collect()

    def _end_timed_out(self, timed_out: list[jobs.Job]) -> None:
        """End the transactions of transactional runs failed for their timeout, before their
        failures are written (later in this turn). A handler that keeps running statements,
        each within the server's per-statement and idle bounds, would otherwise hold its
        transaction, and the job's effect key with it, for as long as it runs: every retry
        waits on that key until its own timeout, and the job goes dead. Ended, the late run
        fails at its next statement, and its thread is free again. Without a connection the
        lease sweep is the backstop (the job's failure waits for the connection too)."""
        if not timed_out:
            return
        ended = self.link.run("queue", lambda conn: exactly_once.end_transactions(conn, timed_out))
        if ended:
            log.info("ended the transactions of timed-out jobs",
                     job_ids=[job.id for job in timed_out], ended=ended)

    def _renew_leases(self) -> None:
        self.leases.renew(time.monotonic())

    def _release_buffer(self) -> None:
        self.exchange.release_buffer(self.lifecycle.mode)

    def _settle_and_claim(self, claim: bool = True) -> None:
        self.exchange.settle_and_claim(self.lifecycle.mode, claim)

    def _report(self, force: bool = False) -> None:
        running = self.slots.running()
        self.status.report(time.monotonic(), self.lifecycle.mode, running,
                           len(self.claimer.buffer) + len(self.slots) - running,
                           self.claimer.capacity, self.conn is not None, force)

    def _shutdown(self) -> None:
        """Write what finished, give back what did not, and close."""
        self.slots.take_back_deck(suspect_too=True)  # no thread may start a job given back
        self._collect_outcomes()
        if self.conn is None:
            self.link.retry_at = 0.0  # one more try, whatever the backoff said
            self._ensure_connection()
        self._settle_and_claim(claim=False)
        self._warn_unrecorded()
        unfinished = (self.slots.unfinished_leases() + self.claimer.buffer.leases()
                      + [job.lease for job in self.claimer.releasing])
        if unfinished:
            released = self.link.run("queue", lambda conn: queue.release(conn, unfinished))
            job_ids = [lease.id for lease in unfinished]
            if released is None:
                # The lease sweep of a node that reaches the database fails them once their
                # leases expire: each spends an attempt.
                log.warning("exiting without giving back unfinished jobs: the write to the "
                            "database failed; they stay claimed until their leases expire, then "
                            "are retried", job_ids=job_ids,
                            visibility_timeout=self.spec.lane.visibility_timeout)
            else:
                log.info("released unfinished jobs", job_ids=job_ids,
                         released=len(released.applied))
        if self.claimer.arming.armed:
            self.link.run("queue", lambda conn: queue.disarm(conn, self.spec.worker_id))
        self._report(force=True)
        if self.settler is not None:
            self.settler.close()
        self.link.close()
        self.runner.close()
        # Last: an exit without this mark (os._exit(0) in a handler, say) is a crash to the
        # supervisor, whatever the exit code.
        if self.runner.board is not None:
            self.runner.board.mark_shut_down()

    def _warn_unrecorded(self) -> None:
        """Say which finished jobs' outcomes the last write could not record: they run
        again once their leases expire (an operator looking for a job run twice starts
        here)."""
        unrecorded = [outcome.job.id for outcome in self.completer.pending]
        if unrecorded:
            log.warning("exiting without recording finished jobs: the write to the "
                        "database failed; they stay claimed until their leases expire, then run "
                        "again", job_ids=unrecorded,
                        visibility_timeout=self.spec.lane.visibility_timeout)


def _loop_session(spec: WorkerSpec) -> SessionSettings:
    """The session of the connection the loop waits on: a worker's, whose waits end before
    the supervisor would take the loop for hung (db.worker_reply_cap). The settler's thread
    and the handlers' connections do not hold up the loop, and keep their bounds."""
    session = worker_session(spec.session)
    if spec.worker_timeout is None:
        return session
    return replace(session, reply_cap=worker_reply_cap(spec.worker_timeout, REPORT_INTERVAL))


def main() -> int:
    spec = WorkerSpec.from_json(sys.stdin.read())
    worker_boot.start_logging(spec)
    resolved = worker_boot.load_handlers(spec)
    if resolved is None:
        return EXIT_BOOT_FAILURE
    worker = Worker(spec, resolved)
    worker.install_signal_handlers()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_START)
    log.info("worker started", lane=spec.lane.name, generation=spec.generation,
             concurrency=spec.lane.concurrency)
    try:
        return worker.run()
    except Exception:
        # One record with the traceback, not one per line of it through the captured
        # stderr: a handler that closed the worker's pipes or sockets, or used up its
        # descriptors, ends here, and the supervisor replaces the worker.
        log.exception("the worker's loop failed; the worker exits and is replaced",
                      lane=spec.lane.name)
        return EXIT_LOOP_FAILED


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Handler threads that ignored their timeout must not keep the process alive.
    os._exit(code)
