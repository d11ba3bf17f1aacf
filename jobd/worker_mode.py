"""A worker's mode and how signals change it.

SIGTERM drains (stop claiming, let jobs finish up to ``shutdown_timeout``, release the rest);
SIGUSR2 retires (finish every job, however long, then exit: used when a reload replaces the
worker); SIGQUIT stops at once, releasing what the worker holds (the supervisor sends it on a
second stop signal). The supervisor going away counts as a SIGTERM: with no one to account
for it, a retiring worker must not run on for as long as its jobs take.

A signal sent to the whole process group (a terminal that closes, ``systemctl kill``, an init
in a container that forwards to the group) reaches the workers directly as well as the
supervisor, which decides. So a SIGTERM while draining changes nothing (it is the same stop,
relayed by the supervisor too), and neither does SIGHUP (reloading is the supervisor's; its
default action would end the worker mid-job). SIGHUP is handled rather than ignored, so the
handlers' own child processes are born with its default action.
"""

from __future__ import annotations

import signal
import time

import structlog

from jobd.protocol import WorkerMode

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGQUIT, signal.SIGHUP)
# Held from the worker's birth until its loop handles them: the supervisor spawns it with
# these blocked (a blocked signal stays blocked across exec), so a drain's SIGTERM or a
# terminal's Ctrl-C that arrives while the interpreter starts, or while the handlers import,
# waits for the loop instead of taking its default action, which the supervisor would count
# as a crash (and, for SIGINT, print a KeyboardInterrupt traceback).
HELD_AT_START = frozenset({*HANDLED_SIGNALS, signal.SIGINT})

log = structlog.get_logger("jobd.worker")


class Lifecycle:
    """Running, draining, retiring or stopping: what the worker may still do."""

    def __init__(self, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.mode = WorkerMode.RUNNING
        self.drain_deadline: float | None = None  # monotonic: a drain gives up then
        self.stop_now = False

    def on_signal(self, signum: int, in_flight: int) -> None:
        if signum == signal.SIGQUIT:
            log.info("stopping at once", signal=signal.Signals(signum).name)
            self.stop_now = True
        elif signum == signal.SIGTERM and self.mode != WorkerMode.DRAINING:
            self.mode = WorkerMode.DRAINING
            self.drain_deadline = time.monotonic() + self.shutdown_timeout
            log.info("draining", in_flight=in_flight, shutdown_timeout=self.shutdown_timeout)
        elif signum == signal.SIGUSR2 and self.mode == WorkerMode.RUNNING:
            self.mode = WorkerMode.RETIRING
            log.info("retiring", in_flight=in_flight)
        # SIGHUP, and a SIGTERM while draining: nothing (see the module's docstring).

    def supervisor_gone(self, in_flight: int) -> None:
        log.warning("supervisor gone; draining", mode=str(self.mode), in_flight=in_flight)
        if self.mode != WorkerMode.DRAINING:
            self.on_signal(signal.SIGTERM, in_flight)

    def finished(self, holds_work: bool, now: float) -> bool:
        """Whether a draining or retiring worker may exit: it holds no work any more
        (``holds_work``: jobs working, outcomes unwritten, a buffer), or a drain ran out
        of time."""
        if self.mode == WorkerMode.RUNNING:
            return False
        if not holds_work:
            return True
        return (self.mode == WorkerMode.DRAINING and self.drain_deadline is not None
                and now >= self.drain_deadline)
