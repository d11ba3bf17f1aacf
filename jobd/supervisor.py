"""The supervisor: a process manager for lane-pinned workers (after gunicorn's arbiter and
supervisord), and the loop that runs everything else the node does.

One loop sleeps in ``select`` on the signal pipe, the workers' status pipes and the pipes of
its threads. Each turn it: handles signals; finishes a reload whose import check is done;
reaps, kills and respawns workers (:mod:`jobd.workerpool`); turns notifications into wake
decisions (:mod:`jobd.wake_routing`); hands the duties that are due (:mod:`jobd.duties`:
crash attribution, lease sweep, node heartbeat, schedules, fallback poll, retention) to the
thread that runs their statements and takes back what they routed; pokes the workers
routing chose; and tells systemd how it is (:mod:`jobd.sdnotify`). The loop waits on its
``select`` alone: the duties' statements run on their thread (:mod:`jobd.duties.runner`),
the LISTEN connection's attempts and probes on its own (:mod:`jobd.listener`), a reload's
handler import runs in a child process. With
``metrics.listen`` it also publishes what the node's Prometheus metrics export
(:mod:`jobd.metrics`), served from a thread of its own.

SIGHUP reloads the config (refused, keeping the old one, if it cannot be read or is
invalid); workers whose settings changed retire while a new generation starts. SIGTERM or
SIGINT drains; a second one stops fast.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import time
from dataclasses import replace
from functools import partial
from typing import Any

import setproctitle
import structlog

from jobd import logs, pipes, sdnotify
from jobd.backoff import RetryPolicy
from jobd.config import Config, load
from jobd.db import ManagedConnection, application_name, supervisor_session
from jobd.duties.crash_attribution import Attribution, CrashAttribution
from jobd.duties.horizon_watch import HorizonWatch
from jobd.duties.lane_poll import LanePoll
from jobd.duties.lease_sweep import LeaseSweep
from jobd.duties.materializer import Materializer
from jobd.duties.metrics_sampler import MetricsSampler
from jobd.duties.node_heartbeat import NodeHeartbeat
from jobd.duties.retention import Retention
from jobd.duties.runner import DeferredRouter, DutyRunner, LoopCalls
from jobd.errors import ConfigError
from jobd.eventloop import SelectLoop
from jobd.handlers import HandlerCheck, check_in_subprocess
from jobd.listener import Listener
from jobd.looplag import LoopLag
from jobd.metrics import NodeCollector, NodeMetrics, NodeView, handler_labels
from jobd.metrics_http import Server
from jobd.sdnotify import Notifier
from jobd.wake_routing import WakeRouter
from jobd.workerpool import WorkerPool

EXIT_OK = 0
EXIT_BOOT_FAILURE_SUPERVISOR = 3

KILL_GRACE = 5.0  # after the drain timeout, how long before stragglers are SIGKILLed
LOOP_TICK = 1.0  # the longest the loop sleeps with nothing due
METRICS_PUBLISH_INTERVAL = 0.5  # seconds between views published for the metrics server
# A batch of duties on their thread this long (each statement is bounded: 10 s, a connection
# attempt 5 s, a lost connection noticed within 30 s) means the thread is stuck: the systemd
# watchdog is no longer pinged, so systemd restarts the daemon.
DUTIES_STUCK_AFTER = 120.0
FINISH_WAIT = 15.0  # on exit, how long to wait for the duties' batch in flight
# What a stop takes beyond shutdown_timeout: KILL_GRACE before the stragglers' SIGKILL,
# FINISH_WAIT for the duties' batch in flight, then 10 s of headroom for the last statements
# (crash attribution, leaving the nodes table), as the unit's TimeoutStopSec=60 gave at the
# default 30 s. systemd is asked for shutdown_timeout + this at SIGTERM (EXTEND_TIMEOUT_USEC),
# so a raised shutdown_timeout is not SIGKILLed mid-drain by the unit's stop timeout.
STOP_MARGIN = KILL_GRACE + FINISH_WAIT + 10.0

log = structlog.get_logger("jobd.supervisor")


class Supervisor:
    def __init__(self, config: Config, database_url: str,
                 notifier: Notifier | None = None, *, file_config: Config | None = None
                 ) -> None:
        self.config = config
        self.url = database_url
        # The file's database settings at start, before the command line's (--schema): a
        # reload compares the file with them, so an option is not taken for an edit.
        self.file_database = _database_of(file_config or config)
        self.instance = f"{config.node_name}:{os.getpid()}:{secrets.token_hex(3)}"
        self.notifier = notifier or Notifier()
        self.loop = SelectLoop()
        self.pool = WorkerPool(config, database_url, self.loop)
        self.link = ManagedConnection(
            database_url, config.schema, application_name("supervisor", node=config.node_name),
            session=supervisor_session(config.session))
        self.listener = Listener(database_url, config.schema, listen_url=config.listen_url,
                                 session=config.session, node=config.node_name)
        self.router = WakeRouter()
        # The duties run on a thread: what they ask of the loop waits for it (runner.py).
        loop_calls = LoopCalls()
        routes = DeferredRouter(self.router, loop_calls)
        self.crashes = CrashAttribution(
            self._retry_policy, routes, self._lanes,
            pinned=lambda worker: loop_calls.later(partial(self.pool.forgive_crash, worker)),
            counted=lambda lane, counts: loop_calls.later(
                partial(self._count_settled, lane, counts)))
        self.lane_poll = LanePoll(lambda: self.config, routes)
        self.materializer = Materializer(self.instance, lambda: self.config, routes)
        self.lease_sweep = LeaseSweep(self._duty_interval, self._retry_policy, routes,
                                      self._lanes)
        duties = [
            # In this order in the transaction they share every duty_interval.
            self.lease_sweep,
            NodeHeartbeat(self._duty_interval, self.instance, lambda: self.config.node_name,
                          self.pool.snapshot, routes, self._lanes,
                          lambda: self.listener.connected,
                          lambda: self.config.archive_retention, self._lane_settings),
            self.materializer,
            self.crashes,
            self.lane_poll,
            HorizonWatch(self._duty_interval, lambda: self.config.horizon_warning),
            Retention(lambda: self.config.archive_retention),
        ]
        self.lag = LoopLag()
        self.started = time.monotonic()
        self.metrics: NodeMetrics | None = None
        self.metrics_server: Server | None = None
        self.sampler: MetricsSampler | None = None
        self.next_publish = 0.0
        if config.metrics_listen is not None:
            self.metrics = NodeMetrics()
            self.metrics_server = Server(config.metrics_listen, NodeCollector(self.metrics))
            self.sampler = MetricsSampler(self._lanes)
            duties.append(self.sampler)
        self.duties = DutyRunner(duties, self.link, self.loop, loop_calls)
        self.next_watchdog = 0.0
        self.stopping = False
        self.stop_deadline: float | None = None
        # A reload's config, its handlers' import check, and when the file was read.
        self.pending_reload: tuple[Config, HandlerCheck, float] | None = None
        self.last_status = ""

    def _retry_policy(self, lane: str) -> RetryPolicy:
        return self.config.retry_policy(lane)

    def _lanes(self) -> list[str]:
        return list(self.config.lanes)

    def _lane_settings(self) -> dict[str, dict[str, Any]]:
        return {name: lane.fleet_settings() for name, lane in self.config.lanes.items()}

    def _duty_interval(self) -> float:
        return self.config.duty_interval

    # --- start and the loop ---------------------------------------------------------------

    def check_boot(self) -> list[str]:
        """Problems that must stop the daemon before anything starts."""
        return check_in_subprocess(self.config.import_paths())

    def run(self) -> int:
        # First: a signal during the boot check (its import of every handler can take a
        # while) waits for it instead of ending the daemon with the default action (a
        # SIGHUP's is to exit, which systemd does not restart) and orphaning the check.
        self.loop.install_signals(
            (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD))
        problems = self.check_boot()
        # A stop asked for during the check comes first: Ctrl-C in a terminal reaches the
        # check's process too, whose import then fails with KeyboardInterrupt. That is the
        # operator's stop, not a handler that cannot be imported (exit code 3).
        stop = [signum for signum in self.loop.pending_signals()
                if signum in (signal.SIGTERM, signal.SIGINT)]
        if stop:
            log.info("stopped before starting", signal=signal.Signals(stop[0]).name)
            return EXIT_OK
        if problems:
            for problem in problems:
                log.error("boot failure", error=problem)
            return EXIT_BOOT_FAILURE_SUPERVISOR
        self._start_metrics()  # before any worker: an address in use stops the start
        self.link.ensure()
        self.listener.start(self.loop)
        self.pool.build()
        self.pool.spawn_due()
        log.info("supervisor started", node=self.config.node_name, instance=self.instance,
                 lanes={name: lane.workers for name, lane in self.config.lanes.items()},
                 metrics=self.config.metrics_listen)
        if not self.config.lanes:
            # As a reload to such a file says: an empty `lanes:` (a bad merge, a template)
            # leaves a node that looks up and runs nothing.
            log.warning("the config declares no lanes: this node runs no workers until a "
                        "reload adds one")
        self.notifier.ready(self._status_text())
        self.lag.begin()
        while True:
            due_at = self._next_moment()
            self.loop.wait(due_at - time.monotonic())
            self.lag.woke(due_at)
            self._handle_signals()
            self._finish_reload()
            self._reap()
            self.pool.enforce_kills()
            if self.stopping:
                if not self.pool.processes():
                    break
                self._enforce_stop_deadline()
            else:
                self.pool.check_liveness()
                self.pool.spawn_due()
            self._receive_wakeups()
            # What a batch of duties that came back routed (retries, suspects) is due too.
            self._wake_workers()
            self.duties.dispatch()
            self._watchdog()
            self._update_status()
            self._publish_metrics()
            self.notifier.flush()
        self._finish()
        return EXIT_OK

    def _next_moment(self) -> float:
        """The earliest moment (monotonic) the loop must act at; it sleeps until then."""
        now = time.monotonic()
        # Duties need the database: while it is away they wait for the next connection try,
        # or an overdue duty would turn the loop into a spin.
        moments = [now + LOOP_TICK, max(self.duties.next_at(), self.link.ready_at()),
                   self.router.next_moment(), self.pool.next_kill_at() or math.inf]
        if not self.stopping:
            moments.append(self.pool.next_spawn_at() or math.inf)
        if self.notifier.watchdog_interval:
            moments.append(self.next_watchdog)
        if self.pending_reload is not None:
            moments.append(self.pending_reload[1].deadline)
        moments.append(self.notifier.retry_at(now) or math.inf)
        return min(moments)

    def _handle_signals(self) -> None:
        for signum in self.loop.take_signals():
            if signum == signal.SIGHUP:
                self.reload()
            elif signum in (signal.SIGTERM, signal.SIGINT):
                self.begin_stop(signal.Signals(signum).name)
            # SIGCHLD needs nothing: it only woke the loop, which reaps below.

    def _reap(self) -> None:
        for exited in self.pool.reap(self.stopping):
            # A crashed worker's jobs are settled now (jobd.duties.crash_attribution); a
            # worker we stopped gives its jobs back. Nobody waits for a lease to expire.
            self.duties.when_idle(partial(self.crashes.add, Attribution(
                exited.worker_id, exited.lane,
                f"worker {exited.worker_id} (pid {exited.pid}) died: {exited.reason}",
                release=not exited.crashed, running=exited.running)))
            if self.metrics is not None:
                self.metrics.retire(exited.lane, exited.report.work)

    def _count_settled(self, lane: str, counts: dict[str, dict[str, int]]) -> None:
        """Outcomes crash attribution wrote for a dead worker: into the node's counters (the
        heartbeat's rates, which `jobd status` and `jobd top` show) and, with metrics on,
        into jobd_jobs_completed_total, as the worker would have counted them."""
        self.pool.count_settled(lane, counts)
        if self.metrics is not None:
            self.metrics.count_settled(lane, counts, self.config.worker_handlers())

    # --- wake-ups -------------------------------------------------------------------------

    def _receive_wakeups(self) -> None:
        wakeups, listening = self.listener.take()
        if listening:
            # Notifications sent while we were not listening are lost: look at every lane.
            self.duties.when_idle(self.lane_poll.poll_now)
        self.router.notified(wakeups)

    def _wake_workers(self) -> None:
        workers = self.pool.processes()
        for worker in workers:
            worker.look_for_idle()
        pokes = self.router.route(workers)
        for worker, byte in pokes:
            pipes.poke(worker.wake_w, byte)
        if pokes:
            log.debug("waking workers", pokes=[f"{w.lane}/{w.pid}:{b.decode()}"
                                               for w, b in pokes])

    # --- reload ---------------------------------------------------------------------------

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
        except ConfigError as exc:  # every mistake in the file
            self._refuse_reload(str(exc))
            return
        except Exception as exc:
            # An unforeseen read or parse failure, a defect of jobd's: refused the same way,
            # as a reload must never stop a running supervisor (whose workers would then run
            # on without it), and logged with its traceback for the bug report.
            self._refuse_reload(f"{type(exc).__name__}: {exc}", exc)
            return
        self._cancel_reload()
        self.pending_reload = (new, HandlerCheck(new.import_paths()), time.monotonic())

    def _finish_reload(self) -> None:
        if self.pending_reload is None:
            return
        new, check, read_at = self.pending_reload
        problems = check.poll()
        if problems is None:
            return  # still importing; SIGCHLD wakes the loop when it is done
        self.pending_reload = None
        if problems:
            self._refuse_reload("; ".join(problems))
            return
        if _database_of(new) != self.file_database:
            log.warning("database settings (url, schema, listen_url, pooler, timeouts) "
                        "change on restart")
        # The connections keep what they were opened with, an override included.
        new = replace(new, database_url=self.config.database_url, schema=self.config.schema,
                      listen_url=self.config.listen_url, session=self.config.session)
        if new.metrics_listen != self.config.metrics_listen:
            log.warning("metrics.listen changes take effect on restart")
            new = replace(new, metrics_listen=self.config.metrics_listen)
        if new.node_name != self.config.node_name:
            # The node's row, its instance id and its connections' names carry the name.
            log.warning("node.name changes take effect on restart")
            new = replace(new, node_name=self.config.node_name)
        if new.log_level != self.config.log_level:
            # The workers follow as they are replaced (WorkerPool.apply).
            logs.configure(new.log_level, reconfigurable=True, process="supervisor")
        if self.config.lanes and not new.lanes:
            log.warning("the reloaded config declares no lanes: this node runs no workers "
                        "until one does")
        self.pool.apply(new)
        self.config = new
        # Declared on the next turn; a changed schedule starts when the file was read.
        self.duties.when_idle(partial(self.materializer.resync, read_at))
        self.duties.when_idle(self.lane_poll.poll_now)  # every lane, new ones included
        log.info("config reloaded", lanes={n: lane.workers for n, lane in new.lanes.items()},
                 generation=self.pool.generation)
        self.notifier.ready(self._status_text())

    def _refuse_reload(self, error: str, unforeseen: BaseException | None = None) -> None:
        # A reload still being checked is the file as it was: the newer SIGHUP supersedes
        # it, refused or not, or it would be applied after this line, a config no longer in
        # the file.
        superseded = self.pending_reload is not None
        self._cancel_reload()
        log.error("reload refused; still running the previous config", error=error,
                  exc_info=unforeseen, **({"superseded_pending_reload": True}
                                          if superseded else {}))
        self.notifier.ready(self._status_text())

    def _cancel_reload(self) -> None:
        if self.pending_reload is not None:
            self.pending_reload[1].cancel()
            self.pending_reload = None

    # --- stop -----------------------------------------------------------------------------

    def begin_stop(self, signal_name: str) -> None:
        if self.stopping:
            log.warning("second stop signal: stopping fast", signal=signal_name)
            self.pool.signal_all(signal.SIGQUIT)
            self.stop_deadline = time.monotonic() + KILL_GRACE
            return
        self.stopping = True
        self._cancel_reload()
        self.stop_deadline = time.monotonic() + self.config.shutdown_timeout + KILL_GRACE
        self.notifier.stopping("draining",
                               extend_timeout=self.config.shutdown_timeout + STOP_MARGIN)
        log.info("draining", signal=signal_name, shutdown_timeout=self.config.shutdown_timeout,
                 workers=len(self.pool.processes()))
        # Retiring workers would finish everything; on shutdown they drain like the rest.
        self.pool.signal_all(signal.SIGTERM)

    def _enforce_stop_deadline(self) -> None:
        if self.stop_deadline is None or time.monotonic() < self.stop_deadline:
            return
        self.pool.kill_stragglers()
        self.stop_deadline = None

    def _finish(self) -> None:
        # The loop is done: the duties' last statements may wait here.
        settled = self.duties.settle(FINISH_WAIT)
        self._reap()
        if settled:
            self.link.run("crash attribution",
                          lambda conn: self.crashes.run(conn, time.monotonic()))
            self.duties.stop()  # leave the nodes table, withdraw schedule declarations
            self.link.close()
        else:
            log.warning("a duty's statement was still running at exit; the node's row and "
                        "schedule declarations expire instead", waited=FINISH_WAIT)
        self.listener.close()
        self.notifier.flush()  # a last try for STOPPING=1; never waits
        self.notifier.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        log.info("stopped")

    # --- metrics --------------------------------------------------------------------------

    def _start_metrics(self) -> None:
        if self.metrics_server is None:
            return
        self._publish_metrics(force=True)
        self.metrics_server.start()
        log.info("serving metrics", listen=self.metrics_server.listen)

    def _publish_metrics(self, force: bool = False) -> None:
        """Hand the metrics server a view of the node (copies; the loop keeps its own state)."""
        now = time.monotonic()
        if self.metrics is None or self.sampler is None or (
                not force and now < self.next_publish):
            return
        self.next_publish = now + METRICS_PUBLISH_INTERVAL
        processes = self.pool.processes()
        # Lanes a reload removed stay while their counts live on (retiring workers included).
        lanes = set(self.config.lanes) | set(self.metrics.retired) | {p.lane for p in processes}
        self.metrics.publish(NodeView(
            lanes=tuple(sorted(lanes)),
            handlers=handler_labels(self.config.worker_handlers()),
            work=self.metrics.lane_totals((p.lane, p.report.work) for p in processes),
            workers=self.pool.worker_states(),
            restarts=dict(self.pool.restarts),
            lease_expiries=dict(self.lease_sweep.expired),
            listener_connected=self.listener.connected,
            loop_lag=self.lag.worst(now),
            sample=self.sampler.latest,
            started=self.started,
            slo_pickup={name: lane.slo_pickup for name, lane in self.config.lanes.items()
                        if lane.slo_pickup is not None}))

    # --- systemd and the process title ----------------------------------------------------

    def _watchdog(self) -> None:
        now = time.monotonic()
        if self.duties.in_flight_for(now) > DUTIES_STUCK_AFTER:
            return  # systemd restarts a daemon whose duties have stopped
        if self.notifier.watchdog_interval and now >= self.next_watchdog:
            delivered = self.notifier.watchdog()
            self.next_watchdog = now + (self.notifier.watchdog_interval if delivered
                                        else sdnotify.RETRY_INTERVAL)

    def _status_text(self) -> str:
        parts = self.pool.status_parts()
        if self.link.conn is None:
            parts.append("database unavailable")
        prefix = "draining; " if self.stopping else ""
        return prefix + "; ".join(parts)

    def _update_status(self) -> None:
        text = self._status_text()
        if text != self.last_status:
            self.last_status = text
            setproctitle.setproctitle(f"jobd: supervisor {self.config.node_name}: {text}")
            self.notifier.status(text)


def _database_of(config: Config) -> tuple[object, ...]:
    """What of the config the connections were opened with: a reload keeps it."""
    return (config.database_url, config.schema, config.listen_url, config.session)
