"""What a read of the supervisor's wake pipe asks of a worker. Any byte means new work may be
due in the lane; some say more (``jobd.protocol`` names them): a suspect may be due, the
lane's pauses changed, jobs were asked to stop, or jobs due for a while were enqueued below
the worker's claim floors. The worker reads the pipe and handles its end (the supervisor
gone); this applies what was read."""

from __future__ import annotations

import time

from jobd import protocol
from jobd.claimer import Claimer
from jobd.leases import LeaseKeeper
from jobd.worker_controls import Controls


def apply(data: bytes, claimer: Claimer, controls: Controls, leases: LeaseKeeper) -> None:
    claimer.maybe_more = True
    if protocol.SUSPECTS in data:
        claimer.suspects_possible = True
        claimer.prefetch.hold(time.monotonic())
    if protocol.CONTROLS in data:
        controls.stale = True
    if protocol.CANCELS in data:
        leases.renew_now()  # the renewal's result names the jobs
    if protocol.BEHIND in data:
        claimer.floors.forget()
