"""The supervisor's worker processes: slots, spawning, reaping, liveness and restarts.

Each lane has ``workers`` slots; a slot holds at most one process at a time. A worker that
exits is replaced after a per-slot delay that grows while it keeps dying young and resets
after a healthy uptime (supervisord's model, :class:`jobd.restarts.SlotBackoff`). Only a
worker that finished its shutdown (the mark on its run board, ``jobd.run_board``) and exited
with status 0 stopped cleanly: any other exit, status 0 included, is a crash. A spawn that
fails (out of processes, memory or descriptors) is retried after the same delay; three
boot failures in a row (exit code 3: a handler cannot be imported) halt the lane until a
reload. A worker whose liveness reports stop for ``worker_timeout`` is hung: SIGABRT (its
``faulthandler`` dumps every thread's stack), then SIGKILL. A reload that changes a lane
replaces its workers by a new generation while the old ones retire.

Workers are started as ``python -m jobd.worker``, fork *and* exec, with their spec on stdin
(``jobd.protocol``): no connection, lock or thread of the supervisor's crosses over.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import structlog

from jobd import crash_dumps
from jobd.config import Config, LaneConfig
from jobd.eventloop import SelectLoop
from jobd.protocol import (
    EXIT_BOOT_FAILURE,
    EXIT_OK,
    StatusReport,
    WorkerMode,
    WorkerSpec,
    describe_exit,
)
from jobd.restarts import SlotBackoff, restart_reason
from jobd.run_board import RunBoard, Running
from jobd.worker_mode import HELD_AT_START

ABORT_GRACE = 5.0  # after SIGABRT, how long a hung worker gets before SIGKILL
# The supervisor's loop looks at its workers at least once a second. A longer gap between two
# looks means the supervisor itself did not run (SIGSTOP, a paused VM, a starved host): the
# reports it did not read meanwhile are not its workers' silence.
SUPERVISOR_STALL = 3.0
BOOT_FAILURES_BEFORE_FATAL = 3

# What a lane's slots hold (jobd_workers' state): a worker that has not reported yet, one per
# mode it reports, one being aborted for silence, a slot waiting out its restart delay, or a
# slot of a lane halted for boot failures. Retiring workers count beside their lane's slots.
WORKER_STATES = ("starting", "running", "draining", "retiring", "hung", "restarting",
                 "halted")

log = structlog.get_logger("jobd.workerpool")


@dataclass(eq=False)
class WorkerProcess:
    spec: WorkerSpec
    popen: subprocess.Popen[bytes]
    wake_w: int
    status_r: int
    board: RunBoard  # the jobs its handlers run (jobd.run_board), read when it exits
    started: float
    last_seen: float
    report: StatusReport = field(default_factory=StatusReport)
    wake_load: int = 0  # work routed to it since its last report or idle (jobd.wake_routing)
    buffer: bytes = b""
    kill_at: float | None = None  # SIGKILL due (after SIGABRT, or after the drain timeout)
    kill_reason: str | None = None
    release_on_exit: bool = False  # killed at the drain deadline: give its jobs back
    retiring: bool = False
    reported: bool = False  # a status report has arrived
    idle_seen: int = 0  # its board's idle count when the router last looked
    idle_since_report: bool = False  # it ran out of work after its last report

    @property
    def lane(self) -> str:
        return self.spec.lane.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def busy(self) -> int:
        return 0 if self.idle_since_report else self.report.busy

    def look_for_idle(self) -> None:
        """Before routing: if the worker ran out of work since the router last looked (its
        board's idle count moved), what it reported and what was routed to it is done. A
        worker stopped or hung since its last count takes one wake-up; the load of that one
        sends the next ones to other workers, as before the count, until liveness acts."""
        count = self.board.idle_count()
        if count != self.idle_seen:
            self.idle_seen = count
            self.idle_since_report = True
            self.wake_load = 0

    @property
    def capacity(self) -> int:
        """Jobs it can hold: its slots and the buffer it claims ahead into."""
        return self.spec.lane.concurrency + self.spec.lane.buffer_size

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass  # it has exited already: the reaper takes its exit, whatever was asked


@dataclass
class Slot:
    lane: LaneConfig
    index: int
    generation: int
    backoff: SlotBackoff = field(default_factory=SlotBackoff)
    process: WorkerProcess | None = None
    spawn_at: float = 0.0
    boot_failures: int = 0
    # The worker that last exited from this slot, and when: a crash pinned on its one job
    # is forgiven (forgive_crash).
    last_worker: str | None = None
    exited_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Exited:
    """A worker that is gone, and what to do with the jobs it may still hold."""

    worker_id: str
    lane: str
    pid: int
    reason: str
    crashed: bool  # else we stopped it (or it exited cleanly): its jobs are given back
    report: StatusReport  # its last report (its final one, after a clean exit)
    running: Running  # the jobs its handlers were running when it died


class WorkerPool:
    def __init__(self, config: Config, database_url: str, loop: SelectLoop) -> None:
        self.config = config
        self.url = database_url
        self.loop = loop
        self.slots: dict[tuple[str, int], Slot] = {}
        self.retiring: list[WorkerProcess] = []
        self.fatal_lanes: dict[str, str] = {}
        self.generation = 0
        # Counters of workers that exited, so a node's totals never go backwards.
        self.exited_counters: dict[str, dict[str, int]] = {}
        self.restarts: dict[tuple[str, str], int] = {}  # (lane, reason): slot workers replaced
        # The cores the workers may run on (they inherit the supervisor's affinity).
        self.cores = len(os.sched_getaffinity(0))
        self.last_liveness_check: float | None = None  # monotonic

    def processes(self) -> list[WorkerProcess]:
        live = [slot.process for slot in self.slots.values() if slot.process is not None]
        return live + self.retiring

    def serving(self, lane: str) -> list[WorkerProcess]:
        return [p for p in self.processes() if p.lane == lane and not p.retiring]

    def next_spawn_at(self) -> float | None:
        moments = [slot.spawn_at for slot in self.slots.values()
                   if slot.process is None and slot.lane.name not in self.fatal_lanes]
        return min(moments, default=None)

    def next_kill_at(self) -> float | None:
        return min((p.kill_at for p in self.processes() if p.kill_at is not None),
                   default=None)

    # --- generations ----------------------------------------------------------------------

    def build(self) -> None:
        self.generation += 1
        for lane in self.config.lanes.values():
            for index in range(lane.workers):
                self.slots[(lane.name, index)] = self._new_slot(lane, index)

    def _new_slot(self, lane: LaneConfig, index: int) -> Slot:
        restart = self.config.restart_backoff
        backoff = SlotBackoff(restart.base, restart.cap, self.config.healthy_uptime)
        return Slot(lane, index, self.generation, backoff)

    def apply(self, new: Config) -> None:
        """A reloaded config: lanes whose settings changed get a new generation of workers
        while the old ones retire (finish what they hold), and every lane does when a
        setting every worker carries changed (_node_wide); a change of ``workers`` alone
        adds or retires slots."""
        old = self.config
        handlers_changed = _node_wide(new) != _node_wide(old)
        self.fatal_lanes.clear()
        self.generation += 1
        # Slots replaced only because the node's worker count flipped settle_connection:
        # auto: nothing about their lane changed, so neither does its crash history (a
        # crash-looping lane must not restart at once after any reload).
        carried: dict[tuple[str, int], Slot] = {}
        for (lane_name, index), slot in list(self.slots.items()):
            lane = new.lanes.get(lane_name)
            if lane is None:  # the lane is gone
                changed = replaced = True
            else:
                changed = handlers_changed or _settings_differ(lane, slot.lane)
                replaced = changed or (self._settles_apart(new, lane)
                                       != self._settles_apart(old, slot.lane))
            if replaced or lane is None or index >= lane.workers:
                del self.slots[(lane_name, index)]
                if slot.process is not None:
                    self._retire(slot.process)
                if not changed:
                    carried[(lane_name, index)] = slot
            else:
                slot.lane = lane  # its worker count changed, at most: a respawn uses the new
        self.config = new
        for lane in new.lanes.values():
            for index in range(lane.workers):
                if (lane.name, index) not in self.slots:
                    slot = self.slots[(lane.name, index)] = self._new_slot(lane, index)
                    old_slot = carried.get((lane.name, index))
                    if old_slot is not None:
                        _carry_restart_state(old_slot, slot)

    def _settles_apart(self, config: Config, lane: LaneConfig) -> bool:
        return lane.settles_apart(self.cores, config.workers)

    def _retire(self, process: WorkerProcess) -> None:
        process.retiring = True
        self.retiring.append(process)
        process.signal(signal.SIGUSR2)
        log.info("worker retiring", lane=process.lane, pid=process.pid,
                 worker=process.spec.worker_id)

    # --- spawning -------------------------------------------------------------------------

    def spawn_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            if (slot.process is None and slot.spawn_at <= now
                    and slot.lane.name not in self.fatal_lanes):
                slot.process = self._try_spawn(slot)

    def _try_spawn(self, slot: Slot) -> WorkerProcess | None:
        """A spawn that fails (EAGAIN at the process limit, ENOMEM, EMFILE) must not end the
        supervisor, whose other workers run on: the slot stays empty and tries again after
        its restart delay, which grows while spawns keep failing."""
        try:
            return self._spawn(slot)
        except OSError as exc:
            delay = slot.backoff.record_exit(0.0)
            slot.spawn_at = time.monotonic() + delay
            log.error("worker spawn failed; retrying after the restart delay",
                      lane=slot.lane.name, slot=slot.index, error=str(exc), delay=delay,
                      failures=slot.backoff.failures)
            return None

    def _spawn(self, slot: Slot) -> WorkerProcess:
        opened: list[int] = []  # closed again if the spawn fails
        board: RunBoard | None = None
        try:
            wake_r, wake_w = os.pipe()
            opened += (wake_r, wake_w)
            status_r, status_w = os.pipe()
            opened += (status_r, status_w)
            board, board_fd = RunBoard.create(slot.lane.concurrency)
            opened.append(board_fd)
            crash_fd = crash_dumps.create()
            opened.append(crash_fd)
            spec = self._spec(slot, status_w, wake_r, board_fd, crash_fd)
            popen = _start_worker_process((wake_r, status_w, board_fd, crash_fd))
        except OSError:
            _close_all(opened)
            if board is not None:
                board.close()
            raise
        _hand_over_spec(popen, spec)
        for fd in (wake_r, status_w, board_fd):
            os.close(fd)
        # crash_fd stays open here: the supervisor reads the dump once the worker exits.
        os.set_blocking(wake_w, False)
        os.set_blocking(status_r, False)
        now = time.monotonic()
        process = WorkerProcess(spec, popen, wake_w, status_r, board, started=now,
                                last_seen=now)
        self.loop.register(status_r, lambda _fd: self._read_status(process))
        log.info("worker spawned", lane=slot.lane.name, slot=slot.index, pid=popen.pid,
                 worker=spec.worker_id, generation=slot.generation)
        return process

    def _spec(self, slot: Slot, status_w: int, wake_r: int, board_fd: int, crash_fd: int
              ) -> WorkerSpec:
        config = self.config
        return WorkerSpec(
            worker_id=f"{config.node_name}:{slot.lane.name}#{slot.index}:"
                      f"{secrets.token_hex(4)}",
            lane=slot.lane, handlers=config.worker_handlers(),
            senders=dict(config.outbox_senders), outbox_lane=config.outbox_lane,
            database_url=self.url, schema=config.schema, slot=slot.index,
            generation=slot.generation, status_fd=status_w, wake_fd=wake_r,
            shutdown_timeout=config.shutdown_timeout, log_level=config.log_level,
            metrics=config.metrics_listen is not None,
            node=config.node_name, session=config.session,
            settles_apart=self._settles_apart(config, slot.lane), board_fd=board_fd,
            crash_fd=crash_fd, worker_timeout=config.worker_timeout,
        )

    def _read_status(self, process: WorkerProcess) -> None:
        try:
            data = os.read(process.status_r, 65536)
        except BlockingIOError:
            return
        if not data:
            self.loop.unregister(process.status_r)
            return
        process.last_seen = time.monotonic()
        self._take_reports(process, data)

    def _take_reports(self, process: WorkerProcess, data: bytes) -> None:
        process.buffer += data
        *lines, process.buffer = process.buffer.split(b"\n")
        for line in lines[-1:]:  # only the newest report matters
            try:
                process.report = StatusReport.parse(line)
                process.wake_load = 0  # the report counts what it was sent
                # Counts up to the report's are older than it: only a later one is news.
                process.idle_seen = process.report.idle_count
                process.idle_since_report = False
                process.reported = True
            except ValueError:
                log.warning("unreadable worker report", pid=process.pid)

    def _read_final_reports(self, process: WorkerProcess) -> None:
        """What an exited worker wrote and the loop has not read yet: its final report,
        after a clean exit. Its totals then count in full."""
        while True:
            try:
                data = os.read(process.status_r, 65536)
            except BlockingIOError:
                return  # all read: the worker wrote nothing more
            except OSError as exc:
                # The worker's last counts are lost to the node's metrics: say so, as the
                # totals then fall short of what the worker did.
                log.warning("could not read an exited worker's final report",
                            lane=process.lane, pid=process.pid, error=str(exc))
                return
            if not data:
                return
            self._take_reports(process, data)

    # --- exits and liveness ---------------------------------------------------------------

    def reap(self, stopping: bool) -> Iterator[Exited]:
        """The workers that exited since the last call; their slots respawn after their
        restart delay (not while ``stopping``)."""
        for slot in self.slots.values():
            process = slot.process
            if process is not None and process.popen.poll() is not None:
                slot.process = None
                yield self._exited(process, None if stopping else slot)
        for process in list(self.retiring):
            if process.popen.poll() is not None:
                self.retiring.remove(process)
                yield self._exited(process, None)

    def _exited(self, process: WorkerProcess, slot: Slot | None) -> Exited:
        returncode = process.popen.returncode
        uptime = time.monotonic() - process.started
        self._read_final_reports(process)
        running = process.board.running()
        shut_down = process.board.shut_down()
        process.board.close()
        for fd in (process.status_r, process.wake_w):
            self.loop.unregister(fd)
            try:
                os.close(fd)
            except OSError as exc:  # EBADF: closed twice, a bug worth seeing in the log
                log.warning("could not close a descriptor of an exited worker", fd=fd,
                            lane=process.lane, pid=process.pid, error=str(exc))
        base = self.exited_counters.setdefault(process.lane, {})
        for counter, value in process.report.counters.items():
            base[counter] = base.get(counter, 0) + value
        # Status 0 alone proves nothing: a handler calling os._exit(0) exits with it too,
        # and is a crash (its job spends an attempt, its slot backs off) like a segfault.
        clean = returncode == EXIT_OK and shut_down
        crashed = not clean and not process.release_on_exit
        # A worker reports once its handlers are loaded: a status 3 after that is a handler
        # ending the process (os._exit(3)), not a boot failure, which would halt the lane.
        booted = process.reported
        reason = process.kill_reason or describe_exit(returncode, shut_down, booted)
        # The stack dump of a worker that died of a signal, in the record, not as loose lines.
        dump = crash_dumps.take(process.spec.crash_fd)
        (log.error if crashed else log.info)(
            "worker exited", lane=process.lane, pid=process.pid,
            worker=process.spec.worker_id, cause=reason, uptime=round(uptime, 1),
            **({"stack": dump} if dump else {}))
        if slot is not None:
            slot.last_worker, slot.exited_at = process.spec.worker_id, time.monotonic()
            key = (process.lane,
                   restart_reason(returncode, process.kill_reason, shut_down, booted))
            self.restarts[key] = self.restarts.get(key, 0) + 1
            self._schedule_restart(slot, returncode == EXIT_BOOT_FAILURE and not booted,
                                   uptime, clean)
        return Exited(process.spec.worker_id, process.lane, process.pid, reason, crashed,
                      process.report, running)

    def _schedule_restart(self, slot: Slot, boot_failed: bool, uptime: float, clean: bool
                          ) -> None:
        if boot_failed:
            slot.boot_failures += 1
            if slot.boot_failures >= BOOT_FAILURES_BEFORE_FATAL:
                self.fatal_lanes[slot.lane.name] = "workers cannot start (boot failure)"
                log.error("lane halted: its workers fail to boot; fix the config and send "
                          "SIGHUP", lane=slot.lane.name)
                return
        else:
            slot.boot_failures = 0
        delay = 0.0 if clean else slot.backoff.record_exit(uptime)
        slot.spawn_at = time.monotonic() + delay
        if delay:
            log.warning("worker restart backing off", lane=slot.lane.name, slot=slot.index,
                        delay=delay, failures=slot.backoff.failures)

    def count_settled(self, lane: str, counts: dict[str, dict[str, int]]) -> None:
        """Outcomes (handler -> outcome -> jobs) written for the jobs of a worker that died,
        added to the lane's counters as its own outcomes are when it exits."""
        base = self.exited_counters.setdefault(lane, {})
        for by_outcome in counts.values():
            for outcome, count in by_outcome.items():
                base[outcome] = base.get(outcome, 0) + count

    def forgive_crash(self, worker_id: str) -> None:
        """Crash attribution explained the crash of ``worker_id`` by its jobs (pinned on the
        one it ran, or suspects run alone next): its slot restarts after the base delay, and
        the crash does not grow its backoff."""
        for slot in self.slots.values():
            if slot.last_worker != worker_id:
                continue
            delay = slot.backoff.forgive()
            if slot.process is not None:
                # Respawned already (the settlement took longer than the delay: it waits up
                # to a second for the dead worker's backends): the crash still comes off
                # the count, or each would double the next delay.
                return
            spawn_at = min(slot.spawn_at, slot.exited_at + delay)
            if spawn_at < slot.spawn_at:
                log.info("crash explained by its jobs; restarting without further backoff",
                         lane=slot.lane.name, slot=slot.index, delay=delay,
                         failures=slot.backoff.failures)
            slot.spawn_at = spawn_at
            return

    def check_liveness(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        stalled = 0.0 if self.last_liveness_check is None else now - self.last_liveness_check
        self.last_liveness_check = now
        if stalled > SUPERVISOR_STALL:
            # Every worker gets a fresh worker_timeout, rather than being aborted, its
            # running jobs charged to it, for the supervisor's own pause.
            log.warning("the supervisor did not run for a while; its workers' silence is "
                        "counted from now", stalled=round(stalled, 1))
            for process in self.processes():
                process.last_seen = max(process.last_seen, now)
            return
        for process in self.processes():
            if process.kill_at is not None or process.kill_reason is not None:
                continue  # already being aborted
            # The timeout it was started with, which bounds its loop's waits: one retiring
            # after a reload that shortened it may wait longer than the new one.
            timeout = process.spec.worker_timeout or self.config.worker_timeout
            silent = now - process.last_seen
            if silent > timeout:
                process.kill_reason = (f"hung: no liveness report for {silent:.0f}s "
                                       f"(worker_timeout {timeout:g}s)")
                log.error("worker hung; aborting it", lane=process.lane, pid=process.pid,
                          worker=process.spec.worker_id, silent=round(silent, 1))
                process.signal(signal.SIGABRT)
                process.kill_at = now + ABORT_GRACE

    def enforce_kills(self) -> None:
        """SIGKILL the workers whose grace after SIGABRT has run out."""
        now = time.monotonic()
        for process in self.processes():
            if process.kill_at is not None and now >= process.kill_at:
                process.signal(signal.SIGKILL)
                process.kill_at = None

    def signal_all(self, signum: int) -> None:
        for process in self.processes():
            process.signal(signum)

    def kill_stragglers(self) -> None:
        """The drain deadline passed: SIGKILL what is left, and give its jobs back."""
        for process in self.processes():
            if process.popen.poll() is None:
                log.warning("worker did not stop in time; killing it", lane=process.lane,
                            pid=process.pid, worker=process.spec.worker_id)
                process.release_on_exit = True
                process.signal(signal.SIGKILL)

    # --- what it reports ------------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        """Live workers and counters (including those of exited workers) per lane.

        A worker is live as the unserved-lane alert counts it (``jobd_workers`` starting or
        running): one that is hung, draining or retiring takes no new job, and `jobd status`
        said the lane was served while the alert said it was not. Its lane stays listed, at
        0 if nothing else serves it: the lease sweep of other nodes leaves the lane's
        expired leases to a node that lists it."""
        workers: dict[str, int] = {}
        counters = {lane: dict(values) for lane, values in self.exited_counters.items()}
        for process in self.processes():
            workers[process.lane] = workers.get(process.lane, 0) + int(_takes_jobs(process))
            lane_counters = counters.setdefault(process.lane, {})
            for key, value in process.report.counters.items():
                lane_counters[key] = lane_counters.get(key, 0) + value
        return workers, counters

    def worker_states(self) -> dict[str, dict[str, int]]:
        """Per lane, how many of its slots (and retiring workers) are in each state."""
        states: dict[str, dict[str, int]] = {}
        for slot in self.slots.values():
            lane = states.setdefault(slot.lane.name, {})
            state = _state_of(slot.process) if slot.process is not None else (
                "halted" if slot.lane.name in self.fatal_lanes else "restarting")
            lane[state] = lane.get(state, 0) + 1
        for process in self.retiring:
            lane = states.setdefault(process.lane, {})
            lane["retiring"] = lane.get("retiring", 0) + 1
        return states

    def status_parts(self) -> list[str]:
        parts = []
        for name in sorted(self.config.lanes):
            processes = self.serving(name)
            busy = sum(p.busy for p in processes)
            state = f" HALTED: {self.fatal_lanes[name]}" if name in self.fatal_lanes else ""
            parts.append(f"{name} {len(processes)}/{self.config.lanes[name].workers} workers "
                         f"busy {busy}{state}")
        if self.retiring:
            parts.append(f"{len(self.retiring)} retiring")
        return parts


def _carry_restart_state(old: Slot, new: Slot) -> None:
    """What decides when ``new`` (replacing ``old`` for the same lane and index) spawns: its
    failure count, the spawn time its delay set (or a crash-looping slot would restart at
    once), its boot failures, and the worker that exited last (so crash attribution can
    still forgive that worker's crash). The backoff's base and cap are the new config's."""
    new.backoff.failures = old.backoff.failures
    new.spawn_at = old.spawn_at
    new.boot_failures = old.boot_failures
    new.last_worker, new.exited_at = old.last_worker, old.exited_at


def _start_worker_process(pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """``python -m jobd.worker``, born with the signals its loop will handle held."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_AT_START)
    try:
        return subprocess.Popen([sys.executable, "-m", "jobd.worker"], stdin=subprocess.PIPE,
                                pass_fds=pass_fds, close_fds=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _hand_over_spec(popen: subprocess.Popen[bytes], spec: WorkerSpec) -> None:
    """Write the worker its spec. A child that died before reading it breaks the pipe: it is
    reaped as an exit like any other (a crash, with the slot's restart delay)."""
    stdin = popen.stdin
    assert stdin is not None
    try:
        stdin.write(spec.to_json().encode())
        stdin.flush()
    except OSError as exc:
        log.error("could not hand a new worker its spec", lane=spec.lane.name,
                  pid=popen.pid, error=str(exc))
    try:
        stdin.close()
    except OSError as exc:  # the flush failed again; the descriptor is closed all the same
        log.warning("could not flush a new worker's spec", lane=spec.lane.name,
                    pid=popen.pid, error=str(exc))


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            log.warning("could not close a descriptor of a failed spawn", fd=fd,
                        error=str(exc))


def _takes_jobs(process: WorkerProcess) -> bool:
    return not process.retiring and _state_of(process) in ("starting", WorkerMode.RUNNING)


def _state_of(process: WorkerProcess) -> str:
    if process.kill_reason is not None:
        return "hung"
    return str(process.report.mode) if process.reported else "starting"


def _node_wide(config: Config) -> tuple[object, ...]:
    """What every worker's spec carries from outside its lane (_spec): a worker keeps what
    it was started with, so a change to any of these needs new workers in every lane (a
    moved outbox lane, say, would otherwise keep getting the deliveries). worker_timeout is
    one: a worker's loop gives a silent connection up before it (db.worker_reply_cap), so a
    worker started under a longer one would be aborted as hung under the shorter."""
    return (config.worker_handlers(), config.outbox_senders, config.outbox_lane,
            config.shutdown_timeout, config.log_level, config.worker_timeout)


def _settings_differ(new: LaneConfig, old: LaneConfig) -> bool:
    """Whether a lane's workers must be replaced (a change of worker count alone is not)."""
    return replace(new, workers=0) != replace(old, workers=0)
