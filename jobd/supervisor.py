"""The supervisor: starts lane-pinned workers, keeps them alive, and runs the daemon's duties.

Shape (after gunicorn's arbiter and supervisord): signal handlers only record the signal; one
loop sleeps in ``select`` on the signal pipe, the workers' status pipes and the LISTEN
connection, and does everything else itself:

- spawns ``workers`` processes per lane (``python -m jobd.worker``, a fresh interpreter, so no
  connection or thread crosses over) and restarts those that exit, with per-slot exponential
  backoff that resets after a healthy uptime;
- kills a worker whose liveness reports stop for ``worker_timeout`` (SIGABRT, then SIGKILL);
- fails the jobs a dead worker held at once, naming the signal or exit code, so a job that
  kills its worker reaches the dead-letter queue in seconds instead of after lease expiry;
- turns enqueue notifications and scheduled run_at instants into wake-ups of the lane's
  workers;
- every ``duty_interval``: the lease-expiry sweep and the node heartbeat; hourly: archive
  partitions and retention.

SIGHUP reloads the config (refused, keeping the old one, if invalid); workers whose settings
changed retire (finish what they hold) while a new generation starts. SIGTERM/SIGINT drain;
a second one stops fast.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import secrets
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, astuple, dataclass, field, replace
from datetime import timedelta
from typing import TypeVar

import psycopg
import setproctitle
import structlog
from psycopg.types.json import Jsonb

from jobd import archive, pipes, queue, schedules
from jobd.config import Config, LaneConfig, load
from jobd.db import connect, connection_lost, first_line
from jobd.errors import ConfigError, DatabaseUnavailable
from jobd.handlers import HandlerCheck, check_in_subprocess
from jobd.migrate import available
from jobd.queries import query
from jobd.restarts import SlotBackoff
from jobd.sdnotify import Notifier
from jobd.wakeup import Listener
from jobd.worker import EXIT_BOOT_FAILURE, EXIT_WEDGED, WorkerSpec

EXIT_OK = 0
EXIT_BOOT_FAILURE_SUPERVISOR = 3

ABORT_GRACE = 5.0  # after SIGABRT, how long a hung worker gets before SIGKILL
KILL_GRACE = 5.0  # after the drain timeout, how long before stragglers are SIGKILLed
BOOT_FAILURES_BEFORE_FATAL = 3
MAINTENANCE_INTERVAL = 3600.0
SUPERVISOR_STATEMENT_TIMEOUT = 10.0  # seconds; no duty statement may hold the loop longer
SUPERVISOR_LOCK_TIMEOUT = 2.0
LISTENER_PROBE_INTERVAL = 60.0
NODE_STALE_AFTER = 3600.0
WAKE_MARGIN = 0.01  # seconds

log = structlog.get_logger("jobd.supervisor")
T = TypeVar("T")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    meaning = {EXIT_BOOT_FAILURE: " (boot failure)", EXIT_WEDGED: " (wedged by timed-out jobs)"}
    return f"exit code {returncode}{meaning.get(returncode, '')}"


@dataclass(eq=False)
class WorkerProcess:
    spec: WorkerSpec
    popen: subprocess.Popen[bytes]
    wake_w: int
    status_r: int
    started: float
    last_seen: float
    status: dict[str, object] = field(default_factory=dict)
    buffer: bytes = b""
    kill_at: float | None = None  # SIGKILL due (after SIGABRT, or after the drain timeout)
    kill_reason: str | None = None
    release_on_exit: bool = False  # killed at the drain deadline: give its jobs back
    retiring: bool = False

    @property
    def lane(self) -> str:
        return self.spec.lane.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    def counters(self) -> dict[str, int]:
        counters = self.status.get("counters")
        return dict(counters) if isinstance(counters, dict) else {}


@dataclass(frozen=True, slots=True)
class Attribution:
    """A worker that exited with jobs possibly still claimed in its name, to settle."""

    worker_id: str
    lane: str
    reason: str
    release: bool  # stopped by us: give its jobs back; else it crashed


@dataclass
class Slot:
    lane: LaneConfig
    index: int
    generation: int
    backoff: SlotBackoff = field(default_factory=SlotBackoff)
    process: WorkerProcess | None = None
    spawn_at: float = 0.0
    boot_failures: int = 0


class Supervisor:
    def __init__(self, config: Config, database_url: str, notifier: Notifier | None = None):
        self.config = config
        self.url = database_url
        self.schema = config.schema
        self.instance = f"{config.node_name}:{os.getpid()}:{secrets.token_hex(3)}"
        self.notifier = notifier or Notifier()
        self.selector = selectors.DefaultSelector()
        self.signals: list[int] = []
        self._signal_r, self._signal_w = os.pipe()
        self.slots: dict[tuple[str, int], Slot] = {}
        self.retiring: list[WorkerProcess] = []
        self.fatal_lanes: dict[str, str] = {}
        self.generation = 0
        self.conn: psycopg.Connection | None = None
        self.conn_retry_at = 0.0
        self.listener = Listener(database_url, self.schema)
        self.listener_fd: int | None = None
        self.lane_wake_at: dict[str, float] = {}  # monotonic instants of scheduled work
        # lane -> jobs due (None: wake every worker of the lane)
        self.lanes_to_wake: dict[str, int | None] = {}
        self.lanes_with_suspects: set[str] = set()  # their workers are told to look
        # (monotonic instant, lane) of suspects' retries: their workers are told to look then.
        self.suspect_wake_at: list[tuple[float, str]] = []
        self.next_lane_poll = 0.0
        self.pending_attribution: list[Attribution] = []
        self.exited_counters: dict[str, dict[str, int]] = {}
        self.db_clock_offset = 0.0  # database epoch minus local epoch
        self.next_duty = 0.0
        self.schedules_synced = False
        self.next_schedule_tick: float | None = None  # monotonic instant of the next fire
        self.next_maintenance = 0.0
        self.next_listener_probe = time.monotonic() + LISTENER_PROBE_INTERVAL
        self.next_watchdog = 0.0
        self.stopping = False
        self.stop_deadline: float | None = None
        # A reload whose handlers are being import-checked in the background.
        self.pending_reload: tuple[Config, HandlerCheck] | None = None
        self.last_status = ""

    # --- signals ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        for fd in (self._signal_r, self._signal_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._signal_w)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, self._record_signal)
        self.selector.register(self._signal_r, selectors.EVENT_READ, pipes.drain)

    def _record_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def _handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGHUP:
                self.reload()
            elif signum in (signal.SIGTERM, signal.SIGINT):
                self.begin_stop(signal.Signals(signum).name)
            # SIGCHLD needs nothing: it only woke the loop, which reaps below.

    # --- start and the loop ----------------------------------------------------------------

    def check_boot(self) -> list[str]:
        """Problems that must stop the daemon before anything starts."""
        return check_in_subprocess({**self.config.worker_handlers(),
                                    **self.config.outbox_senders})

    def run(self) -> int:
        problems = self.check_boot()
        if problems:
            for problem in problems:
                log.error("boot failure", error=problem)
            return EXIT_BOOT_FAILURE_SUPERVISOR
        self.install_signal_handlers()
        self._ensure_connection()
        self._ensure_listener()
        self._build_slots(self.config.lanes.values())
        self._spawn_due()
        log.info("supervisor started", node=self.config.node_name, instance=self.instance,
                 lanes={name: lane.workers for name, lane in self.config.lanes.items()})
        if self.config.metrics_listen is not None:
            # Accepted so configs written for the documented format load, but nothing listens
            # yet: say so rather than leave an operator probing an empty port.
            log.warning("metrics are not served by this version; metrics.listen is ignored",
                        listen=self.config.metrics_listen)
        self.notifier.ready(self._status_text())
        while True:
            for key, _events in self.selector.select(self._select_timeout()):
                key.data(key.fd)
            self._handle_signals()
            self._finish_reload()
            self._reap()
            self._enforce_kills()
            if self.stopping:
                if not self._all_processes():
                    break
                self._enforce_stop_deadline()
            else:
                self._check_liveness()
                self._spawn_due()
            self._ensure_connection()
            self._ensure_listener()
            self._receive_wakeups()
            self._poll_lanes()
            self._wake_lanes()
            self._run_duties()
            self._update_status()
            self.notifier.flush()
        self._finish()
        return EXIT_OK

    def _select_timeout(self) -> float:
        now = time.monotonic()
        moments = [now + 1.0]
        # Duties need the database: while it is away they wait for the next connection try,
        # or an overdue duty would turn the loop into a spin.
        database_ready = self.conn_retry_at if self.conn is None else 0.0
        database_moments = [self.next_duty, self.next_lane_poll]
        if self.next_schedule_tick is not None:
            database_moments.append(self.next_schedule_tick)
        moments += [max(moment, database_ready) for moment in database_moments]
        if not self.stopping:
            moments += [slot.spawn_at for slot in self.slots.values()
                        if slot.process is None and slot.lane.name not in self.fatal_lanes]
        moments += self.lane_wake_at.values()
        moments += [at for at, _lane in self.suspect_wake_at[:1]]
        moments += [p.kill_at for p in self._all_processes() if p.kill_at is not None]
        if self.notifier.watchdog_interval:
            moments.append(self.next_watchdog)
        if self.pending_reload is not None:
            moments.append(self.pending_reload[1].deadline)
        notify_retry = self.notifier.retry_at(now)
        if notify_retry is not None:
            moments.append(notify_retry)
        return max(0.0, min(moments) - now)

    def _all_processes(self) -> list[WorkerProcess]:
        live = [slot.process for slot in self.slots.values() if slot.process is not None]
        return live + self.retiring

    # --- database --------------------------------------------------------------------------

    def _ensure_connection(self) -> None:
        if self.conn is not None and not self.conn.closed:
            return
        if time.monotonic() < self.conn_retry_at:
            return
        try:
            self.conn = connect(self.url, self.schema, application_name="jobd supervisor")
            # The loop must not hang on the database: every duty statement is bounded.
            self.conn.execute(query("supervisor_session"), {
                "statement_timeout": f"{SUPERVISOR_STATEMENT_TIMEOUT * 1000:.0f}",
                "lock_timeout": f"{SUPERVISOR_LOCK_TIMEOUT * 1000:.0f}"})
        except DatabaseUnavailable as exc:
            log.warning("database unavailable", error=str(exc))
            self.conn = None
            self.conn_retry_at = time.monotonic() + 5.0

    def _db(self, what: str, operation: Callable[[psycopg.Connection], T]) -> T | None:
        """Run ``operation(conn)``; a failure is logged and answered with None."""
        if self.conn is None:
            return None
        try:
            return operation(self.conn)
        except psycopg.Error as exc:
            if not connection_lost(self.conn):
                # A deadlock, a serialization failure or a timeout: the statement failed,
                # the connection did not. The duty runs again on its next turn.
                log.error("database statement failed", during=what, error=first_line(exc))
                return None
            log.warning("database connection lost", during=what, error=first_line(exc))
            self.conn.close()
            self.conn = None
            self.conn_retry_at = time.monotonic() + 1.0
        return None

    def _ensure_listener(self) -> None:
        if self.listener.conn is None and self.listener_fd is not None:
            self.selector.unregister(self.listener_fd)
            self.listener_fd = None
        if self.listener.ensure():
            self.listener_fd = self.listener.fileno()
            assert self.listener_fd is not None
            self.selector.register(self.listener_fd, selectors.EVENT_READ, lambda _fd: None)
            # Notifications sent while we were not listening are lost: look at every lane.
            self.next_lane_poll = 0.0

    def _receive_wakeups(self) -> None:
        for wakeup in self.listener.receive():
            if wakeup.at_epoch is None:
                self._request_wake(wakeup.lane, wakeup.due)
            else:
                self._wake_lane_at(wakeup.lane, wakeup.at_epoch)
        now = time.monotonic()
        if now >= self.next_listener_probe:
            self.next_listener_probe = now + LISTENER_PROBE_INTERVAL
            self.listener.check()

    def _wake_lane_at(self, lane: str, at_epoch: float) -> None:
        at = self._monotonic_at(at_epoch)
        current = self.lane_wake_at.get(lane)
        if current is None or at < current:
            self.lane_wake_at[lane] = at

    def _monotonic_at(self, at_epoch: float) -> float:
        """The monotonic instant at which a database-clock epoch instant has passed. The
        margin absorbs the error of the measured clock offset, so the claim that a wake-up
        then triggers finds the job due by the database clock."""
        delay = at_epoch + WAKE_MARGIN - (time.time() + self.db_clock_offset)
        return time.monotonic() + max(0.0, delay)

    def _request_wake(self, lane: str, due: int | None = None) -> None:
        """Wake workers of ``lane``: enough for ``due`` jobs, or all of them (None)."""
        pending = self.lanes_to_wake.get(lane, 0)
        if due is None or pending is None:
            self.lanes_to_wake[lane] = None
        else:
            self.lanes_to_wake[lane] = pending + due

    def _wake_all(self, lanes: Iterable[str]) -> None:
        for lane in lanes:
            self._request_wake(lane)

    def _poll_lanes(self) -> None:
        """The fallback poll: one statement tells, per lane, whether work is due or when.

        Notifications are the fast path; this catches what they miss (the LISTEN connection
        was down, another node retried a job, a timer was lost in a reload).
        """
        now = time.monotonic()
        if now < self.next_lane_poll or not self.config.lanes:
            return
        interval = min(lane.poll_interval for lane in self.config.lanes.values())
        # Jitter keeps the supervisors of a fleet from polling in lockstep.
        self.next_lane_poll = now + interval * random.uniform(0.8, 1.2)
        rows = self._db("lane poll", lambda conn: conn.execute(
            query("lane_heads"), {"lanes": list(self.config.lanes), "now": None}).fetchall())
        for lane, head, db_now, suspects in rows or []:
            if suspects:
                self.lanes_with_suspects.add(lane)
            if head is None:
                continue
            if head <= db_now:
                self._request_wake(lane)
            else:
                self._wake_lane_at(lane, head)

    def _wake_lanes(self) -> None:
        now = time.monotonic()
        for lane, at in list(self.lane_wake_at.items()):
            if at <= now:
                del self.lane_wake_at[lane]
                self._request_wake(lane)
        while self.suspect_wake_at and self.suspect_wake_at[0][0] <= now:
            _at, lane = heapq.heappop(self.suspect_wake_at)
            self.lanes_with_suspects.add(lane)
        for lane in self.lanes_with_suspects:
            for process in self._workers_to_wake(lane, None):
                pipes.poke(process.wake_w, pipes.SUSPECTS)
        self.lanes_with_suspects.clear()
        for lane, due in self.lanes_to_wake.items():
            woken = self._workers_to_wake(lane, due)
            for process in woken:
                pipes.poke(process.wake_w)
            log.debug("waking workers", lane=lane, due=due, pids=[p.pid for p in woken])
        self.lanes_to_wake.clear()

    def _workers_to_wake(self, lane: str, due: int | None) -> list[WorkerProcess]:
        """The lane's workers with the most free capacity, as many as ``due`` jobs need.

        Waking every worker for one job makes all but one claim nothing; on a small machine
        those empty claims compete with the job for CPU.
        """
        workers = [p for p in self._all_processes() if p.lane == lane and not p.retiring]
        if due is None:
            return workers
        workers.sort(key=lambda p: _as_int(p.status.get("busy")) - p.spec.lane.concurrency)
        needed = max(1, -(-due // max(1, workers[0].spec.lane.concurrency))) if workers else 0
        chosen = workers[:needed]
        for process in chosen:
            # Count the wake-up as load until the next report, so the next one picks another.
            process.status["busy"] = _as_int(process.status.get("busy")) + min(
                due, process.spec.lane.concurrency)
        return chosen

    # --- spawning --------------------------------------------------------------------------

    def _build_slots(self, lanes: Iterable[LaneConfig]) -> None:
        self.generation += 1
        for lane in lanes:
            for index in range(lane.workers):
                self.slots[(lane.name, index)] = self._new_slot(lane, index)

    def _new_slot(self, lane: LaneConfig, index: int) -> Slot:
        backoff = SlotBackoff(self.config.restart_backoff.base, self.config.restart_backoff.cap,
                              self.config.healthy_uptime)
        return Slot(lane, index, self.generation, backoff)

    def _spawn_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            if slot.process is None and slot.spawn_at <= now and slot.lane.name not in \
                    self.fatal_lanes:
                slot.process = self._spawn(slot)

    def _spawn(self, slot: Slot) -> WorkerProcess:
        wake_r, wake_w = os.pipe()
        status_r, status_w = os.pipe()
        spec = WorkerSpec(
            worker_id=f"{self.config.node_name}:{slot.lane.name}#{slot.index}:"
                      f"{secrets.token_hex(4)}",
            lane=slot.lane, handlers=self.config.worker_handlers(),
            senders=dict(self.config.outbox_senders), outbox_lane=self.config.outbox_lane,
            database_url=self.url,
            schema=self.schema, slot=slot.index, generation=slot.generation,
            status_fd=status_w, wake_fd=wake_r, shutdown_timeout=self.config.shutdown_timeout,
            log_level=self.config.log_level,
        )
        popen = subprocess.Popen(
            [sys.executable, "-m", "jobd.worker"], stdin=subprocess.PIPE,
            pass_fds=(wake_r, status_w), close_fds=True,
        )
        assert popen.stdin is not None
        popen.stdin.write(spec.to_json().encode())
        popen.stdin.close()
        os.close(wake_r)
        os.close(status_w)
        os.set_blocking(wake_w, False)
        os.set_blocking(status_r, False)
        now = time.monotonic()
        process = WorkerProcess(spec, popen, wake_w, status_r, started=now, last_seen=now)
        self.selector.register(status_r, selectors.EVENT_READ,
                               lambda _fd, p=process: self._read_status(p))
        log.info("worker spawned", lane=slot.lane.name, slot=slot.index, pid=popen.pid,
                 worker=spec.worker_id, generation=slot.generation)
        return process

    def _read_status(self, process: WorkerProcess) -> None:
        try:
            data = os.read(process.status_r, 65536)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(process.status_r)
            return
        process.last_seen = time.monotonic()
        process.buffer += data
        *lines, process.buffer = process.buffer.split(b"\n")
        for line in lines[-1:]:  # only the newest report matters
            try:
                process.status = json.loads(line)
            except json.JSONDecodeError:
                log.warning("unreadable worker report", pid=process.pid)

    # --- exits and liveness ----------------------------------------------------------------

    def _reap(self) -> None:
        for slot in self.slots.values():
            process = slot.process
            if process is not None and process.popen.poll() is not None:
                slot.process = None
                self._on_exit(process, slot)
        for process in list(self.retiring):
            if process.popen.poll() is not None:
                self.retiring.remove(process)
                self._on_exit(process, None)
        self._attribute_pending()

    def _on_exit(self, process: WorkerProcess, slot: Slot | None) -> None:
        returncode = process.popen.returncode
        cause = describe_exit(returncode)
        uptime = time.monotonic() - process.started
        self._close_process_fds(process)
        base = self.exited_counters.setdefault(process.lane, {})
        for key, value in process.counters().items():
            base[key] = base.get(key, 0) + int(value)
        crashed = returncode != 0 and not process.release_on_exit
        reason = process.kill_reason or cause
        report = log.error if crashed else log.info
        report("worker exited", lane=process.lane, pid=process.pid,
               worker=process.spec.worker_id, cause=reason, uptime=round(uptime, 1))
        # A crashed worker's jobs fail now (their attempt counted, error named); a worker
        # we stopped gives its jobs back. Either way nobody waits for the lease to expire.
        self.pending_attribution.append(Attribution(
            process.spec.worker_id, process.lane,
            f"worker {process.spec.worker_id} (pid {process.pid}) died: {reason}",
            release=not crashed,
        ))
        if slot is None or self.stopping:
            return
        if returncode == EXIT_BOOT_FAILURE:
            slot.boot_failures += 1
            if slot.boot_failures >= BOOT_FAILURES_BEFORE_FATAL:
                self.fatal_lanes[slot.lane.name] = "workers cannot start (boot failure)"
                log.error("lane halted: its workers fail to boot; fix the config and send "
                          "SIGHUP", lane=slot.lane.name)
                return
        else:
            slot.boot_failures = 0
        delay = slot.backoff.record_exit(uptime) if returncode != 0 else 0.0
        slot.spawn_at = time.monotonic() + delay
        if delay:
            log.warning("worker restart backing off", lane=slot.lane.name, slot=slot.index,
                        delay=delay, failures=slot.backoff.failures)

    def _close_process_fds(self, process: WorkerProcess) -> None:
        for fd in (process.status_r, process.wake_w):
            try:
                self.selector.unregister(fd)
            except (KeyError, ValueError):
                pass
            try:
                os.close(fd)
            except OSError:
                pass

    def _attribute_pending(self) -> None:
        if not self.pending_attribution:
            return
        remaining = []
        for attribution in self.pending_attribution:
            def settle(conn: psycopg.Connection, attribution: Attribution = attribution) -> bool:
                if attribution.release:
                    self._release_jobs_of(conn, attribution.worker_id)
                else:
                    self._settle_crash(conn, attribution)
                return True

            if self._db("crash attribution", settle) is None:
                remaining.append(attribution)
        self.pending_attribution = remaining

    def _release_jobs_of(self, conn: psycopg.Connection, worker_id: str) -> None:
        rows = conn.execute(query("jobs_held_by"), {"worker": worker_id}).fetchall()
        released = queue.release(conn, [queue.Lease(r[0], r[1]) for r in rows])
        if released.applied:
            log.info("released the jobs of a stopped worker", worker=worker_id,
                     job_ids=released.applied)
            self._wake_all(self.config.lanes)

    def _settle_crash(self, conn: psycopg.Connection, attribution: Attribution) -> None:
        worker_id, reason = attribution.worker_id, attribution.reason
        outcome = queue.settle_crashed_worker(conn, worker_id, reason, self.config.retry_policy)
        self._wake_for_retries(outcome.failed)
        # A worker only claims from its own lane: that is where the suspects are. Suspects
        # are claimed only by workers told to look: now, and when a suspect's retry is due.
        if outcome.suspects:
            self.lanes_with_suspects.add(attribution.lane)
        for run_at in outcome.failed.retry_at.values():
            heapq.heappush(self.suspect_wake_at,
                           (self._monotonic_at(run_at.timestamp()), attribution.lane))
        if outcome.suspects:
            log.warning("a worker died running several jobs; each runs alone next, to find "
                        "the one that killed it (their attempts are given back)",
                        worker=worker_id, reason=reason, suspect_job_ids=outcome.suspects)
        elif outcome.failed.retried or outcome.failed.dead:
            log.warning("failed the job that killed its worker", worker=worker_id,
                        reason=reason, retried_job_ids=outcome.failed.retried,
                        dead_job_ids=outcome.failed.dead)

    def _enforce_kills(self) -> None:
        """SIGKILL the workers whose grace after SIGABRT has run out."""
        now = time.monotonic()
        for process in self._all_processes():
            if process.kill_at is not None and now >= process.kill_at:
                self._signal(process, signal.SIGKILL)
                process.kill_at = None

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for process in self._all_processes():
            if process.kill_at is not None or process.kill_reason is not None:
                continue  # already being aborted
            silent = now - process.last_seen
            if silent > self.config.worker_timeout:
                process.kill_reason = (f"hung: no liveness report for {silent:.0f}s "
                                       f"(worker_timeout {self.config.worker_timeout:g}s)")
                log.error("worker hung; aborting it", lane=process.lane, pid=process.pid,
                          silent=round(silent, 1))
                self._signal(process, signal.SIGABRT)
                process.kill_at = now + ABORT_GRACE

    def _signal(self, process: WorkerProcess, signum: int) -> None:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass

    # --- duties ----------------------------------------------------------------------------

    def _run_duties(self) -> None:
        now = time.monotonic()
        if self.notifier.watchdog_interval and now >= self.next_watchdog:
            self.notifier.watchdog()
            self.next_watchdog = now + self.notifier.watchdog_interval
        if self.conn is None:
            return
        if not self.schedules_synced:
            self.schedules_synced = self._db("schedule sync", self._sync_schedules) or False
        if now >= self.next_duty:
            self.next_duty = now + self.config.duty_interval
            swept = self._db("duties", self._duty_transaction)
            if swept:
                self._wake_all(self.config.lanes)
        elif self.next_schedule_tick is not None and now >= self.next_schedule_tick:
            self.next_schedule_tick = None
            self._db("schedules", self._materialize)
        if now >= self.next_maintenance:
            self.next_maintenance = now + MAINTENANCE_INTERVAL
            self._db("archive maintenance", self._maintain_archive)

    def _duty_transaction(self, conn: psycopg.Connection) -> int:
        """One transaction: lease-expiry sweep, node heartbeat, due schedule occurrences."""
        with conn.transaction():
            outcome = queue.expire_leases(conn, self.config.retry_policy)
            row = conn.execute(query("node_heartbeat"), self._node_row()).fetchone()
            self._materialize(conn)
            # After the tick: the refresh never waits for a schedule lock, so it cannot
            # close a lock cycle with the locks the tick took.
            schedules.refresh(conn, self.instance, self.config.schedules,
                              schedules.declaration_ttl(self.config.duty_interval))
        if row is not None:
            self.db_clock_offset = float(row[0]) - time.time()
        self._wake_for_retries(outcome)
        swept = len(outcome.retried) + len(outcome.dead)
        if swept:
            log.warning("expired leases swept", retried=outcome.retried, dead=outcome.dead)
        return swept

    def _wake_for_retries(self, outcome: queue.FailOutcome) -> None:
        """Wake each lane when the earliest of the retries the supervisor recorded falls due."""
        for lane, run_at in outcome.next_retry_by_lane.items():
            self._wake_lane_at(lane, run_at.timestamp())

    def _sync_schedules(self, conn: psycopg.Connection) -> bool:
        result = schedules.sync(conn, self.config.schedules, self.instance,
                                schedules.declaration_ttl(self.config.duty_interval))
        schedules.report_sync(result)
        self._materialize(conn)
        return True

    def _materialize(self, conn: psycopg.Connection) -> None:
        result = schedules.tick(conn)
        if result.enqueued:
            self._wake_all(self.config.lanes)
        if result.next_fire_at is None:
            self.next_schedule_tick = None
            return
        delay = result.next_fire_at.timestamp() - (time.time() + self.db_clock_offset)
        # A floor keeps a slightly early timer (clock offset error) from spinning.
        self.next_schedule_tick = time.monotonic() + max(0.05, delay)

    def _node_row(self) -> dict[str, object]:
        workers: dict[str, int] = {}
        counters: dict[str, dict[str, int]] = {
            lane: dict(values) for lane, values in self.exited_counters.items()}
        for process in self._all_processes():
            workers[process.lane] = workers.get(process.lane, 0) + 1
            lane_counters = counters.setdefault(process.lane, {})
            for key, value in process.counters().items():
                lane_counters[key] = lane_counters.get(key, 0) + int(value)
        return {"instance": self.instance, "node": self.config.node_name, "pid": os.getpid(),
                "workers": Jsonb(workers), "counters": Jsonb(counters)}

    def _maintain_archive(self, conn: psycopg.Connection) -> None:
        done = archive.apply_retention(conn, timedelta(seconds=self.config.archive_retention))
        conn.execute(query("prune_nodes"), {"older_than": NODE_STALE_AFTER})
        schedules.prune_ledger(conn)
        if any(astuple(done)):
            log.info("archive maintenance", **asdict(done))

    # --- reload ----------------------------------------------------------------------------

    def reload(self) -> None:
        """SIGHUP: read the file now; import-check its handlers in the background
        (:meth:`_finish_reload` applies it when the check is done). A newer SIGHUP replaces
        a check still running."""
        if self.stopping:
            return
        self.notifier.reloading()
        path = self.config.path
        try:
            if path is None:
                raise ConfigError("the daemon was started without a config file")
            new = load(path)
        except Exception as exc:
            # ConfigError for every mistake in the file; anything else (an unforeseen read
            # or parse failure) is refused the same way: a reload must never stop a running
            # supervisor, whose workers would then run on without it.
            error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            self._refuse_reload(error)
            return
        if self.pending_reload is not None:
            self.pending_reload[1].cancel()
        paths = {**new.worker_handlers(), **new.outbox_senders}
        self.pending_reload = (new, HandlerCheck(paths))

    def _finish_reload(self) -> None:
        if self.pending_reload is None:
            return
        new, check = self.pending_reload
        problems = check.poll()
        if problems is None:
            return  # still importing; SIGCHLD wakes the loop when it is done
        self.pending_reload = None
        if problems:
            self._refuse_reload("; ".join(problems))
            return
        if (new.database_url, new.schema) != (self.config.database_url, self.config.schema):
            log.warning("database.url and database.schema changes take effect on restart")
            new = _with_database(new, self.config)
        self._apply(new)
        log.info("config reloaded", lanes={n: lane.workers for n, lane in new.lanes.items()},
                 generation=self.generation)
        self.notifier.ready(self._status_text())

    def _refuse_reload(self, error: str) -> None:
        log.error("reload refused; still running the previous config", error=error)
        self.notifier.ready(self._status_text())

    def _cancel_reload(self) -> None:
        if self.pending_reload is not None:
            self.pending_reload[1].cancel()
            self.pending_reload = None

    def _apply(self, new: Config) -> None:
        old = self.config
        handlers_changed = (new.worker_handlers(), new.outbox_senders) != (
            old.worker_handlers(), old.outbox_senders)
        self.fatal_lanes.clear()
        self.generation += 1
        for (lane_name, index), slot in list(self.slots.items()):
            lane = new.lanes.get(lane_name)
            replaced = lane is None or handlers_changed or _settings_differ(lane, slot.lane)
            if replaced or index >= (lane.workers if lane else 0):
                del self.slots[(lane_name, index)]
                if slot.process is not None:
                    self._retire(slot.process)
        self.config = new
        for lane in new.lanes.values():
            for index in range(lane.workers):
                if (lane.name, index) not in self.slots:
                    self.slots[(lane.name, index)] = self._new_slot(lane, index)
        self.schedules_synced = False  # the next duty pass writes the new schedules
        self.next_lane_poll = 0.0  # look at every lane, new ones included

    def _retire(self, process: WorkerProcess) -> None:
        process.retiring = True
        self.retiring.append(process)
        self._signal(process, signal.SIGUSR2)
        log.info("worker retiring", lane=process.lane, pid=process.pid,
                 worker=process.spec.worker_id)

    # --- stop ------------------------------------------------------------------------------

    def begin_stop(self, signal_name: str) -> None:
        if self.stopping:
            log.warning("second stop signal: stopping fast", signal=signal_name)
            for process in self._all_processes():
                self._signal(process, signal.SIGQUIT)
            self.stop_deadline = time.monotonic() + KILL_GRACE
            return
        self.stopping = True
        self._cancel_reload()
        self.stop_deadline = time.monotonic() + self.config.shutdown_timeout + KILL_GRACE
        self.notifier.stopping("draining")
        log.info("draining", signal=signal_name, shutdown_timeout=self.config.shutdown_timeout,
                 workers=len(self._all_processes()))
        for process in self._all_processes():
            # Retiring workers would finish everything; on shutdown they drain like the rest.
            self._signal(process, signal.SIGTERM)

    def _enforce_stop_deadline(self) -> None:
        if self.stop_deadline is None or time.monotonic() < self.stop_deadline:
            return
        for process in self._all_processes():
            if process.popen.poll() is None:
                log.warning("worker did not stop in time; killing it", pid=process.pid)
                process.release_on_exit = True
                self._signal(process, signal.SIGKILL)
        self.stop_deadline = None

    def _finish(self) -> None:
        self._attribute_pending()
        self._db("leave", lambda conn: conn.execute(query("node_leave"),
                                                    {"instance": self.instance}))
        # Its schedules stop counting as declared by it at once, not after the expiry.
        self._db("withdraw schedules", lambda conn: schedules.withdraw(conn, self.instance))
        self.listener.close()
        self.notifier.flush()  # a last try for STOPPING=1; never waits
        self.notifier.close()
        if self.conn is not None:
            self.conn.close()
        log.info("stopped")

    # --- status ----------------------------------------------------------------------------

    def _status_text(self) -> str:
        parts = []
        for name in sorted(self.config.lanes):
            processes = [p for p in self._all_processes() if p.lane == name and not p.retiring]
            busy = sum(_as_int(p.status.get("busy")) for p in processes)
            state = f" HALTED: {self.fatal_lanes[name]}" if name in self.fatal_lanes else ""
            parts.append(f"{name} {len(processes)}/{self.config.lanes[name].workers} workers "
                         f"busy {busy}{state}")
        if self.retiring:
            parts.append(f"{len(self.retiring)} retiring")
        if self.conn is None:
            parts.append("database unavailable")
        prefix = "draining; " if self.stopping else ""
        return prefix + "; ".join(parts)

    def _update_status(self) -> None:
        text = self._status_text()
        if text != self.last_status:
            self.last_status = text
            setproctitle.setproctitle(f"jobd: supervisor {self.config.node_name}: {text}")
            self.notifier.status(text)


def _as_int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _settings_differ(new: LaneConfig, old: LaneConfig) -> bool:
    """Whether a lane's workers must be replaced (a change of worker count alone is not)."""
    return replace(new, workers=0) != replace(old, workers=0)


def _with_database(new: Config, old: Config) -> Config:
    return replace(new, database_url=old.database_url, schema=old.schema)


def schema_problem(conn: psycopg.Connection) -> str | None:
    """Why the database is not ready for the daemon, or None."""
    latest = max(m.version for m in available())
    try:
        row = conn.execute("SELECT max(version) FROM schema_migrations").fetchone()
    except psycopg.errors.UndefinedTable:
        return "jobd's tables are missing in this database; run `jobd migrate` first"
    version = row[0] if row else None
    if version is None or version < latest:
        return f"the schema is at version {version}, this jobd needs {latest}; run `jobd migrate`"
    return None
