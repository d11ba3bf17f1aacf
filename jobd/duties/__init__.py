"""The supervisor's background duties, one service a module, each with its own timer.

- :mod:`~jobd.duties.lease_sweep`: jobs whose lease expired (any node's) are failed, and the
  transactions their stale holders may still keep open are ended;
- :mod:`~jobd.duties.crash_attribution`: the jobs of a worker process that died are
  settled at once (failed, or made suspects, or released if we stopped it);
- :mod:`~jobd.duties.node_heartbeat`: this node's row in ``jobd.nodes`` (live workers,
  counters) and the database clock's offset;
- :mod:`~jobd.duties.materializer`: recurring schedules declared, due occurrences enqueued;
- :mod:`~jobd.duties.lane_poll`: the fallback poll for work that no notification announced;
- :mod:`~jobd.duties.horizon_watch`: a warning naming whatever holds vacuum back;
- :mod:`~jobd.duties.retention`: archive partitions, retention, pruning.

A duty says when it next wants to run (:attr:`Duty.next_at`, monotonic) and does its work
in :meth:`Duty.run` with a connection; the :class:`~jobd.duties.runner.DutyRunner` runs the
due ones on a thread of its own, so the supervisor's loop never waits for their statements.
What a duty reads of the loop's state it copies in :meth:`Duty.prepare`, on the loop; what it
routes goes through a :class:`Router`, whose calls the runner carries out on the loop.
Duties that run every ``duty_interval`` share one transaction, so an idle node costs the
database one transaction per interval; the others (``alone``) run in their own, so a slow
one cannot roll back the rest. Each duty is
testable with a connection and an injected clock (``now``), without processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import ClassVar, Protocol

import psycopg


class Router(Protocol):
    """What the duties ask of :class:`jobd.wake_routing.WakeRouter`."""

    def measured_db_clock(self, db_epoch: float) -> None: ...
    def db_epoch(self, now: float | None = None) -> float: ...
    def due_now(self, lane: str, count: int | None = None) -> None: ...
    def due_everywhere(self, lanes: Iterable[str]) -> None: ...
    def due_at(self, lane: str, at_epoch: float) -> None: ...
    def retries_due(self, next_retry_by_lane: Mapping[str, datetime]) -> None: ...
    def suspects_due(self, lane: str, at_epoch: float | None = None) -> None: ...
    def controls_changed(self, lane: str) -> None: ...


class Duty:
    name: ClassVar[str]
    alone: ClassVar[bool] = False  # True: its own transaction (or none), not the shared one

    def __init__(self) -> None:
        self.next_at = 0.0  # monotonic; math.inf: nothing to do until told

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def prepare(self) -> None:
        """On the loop, before a turn on the duties' thread: copy what it reads of the loop."""

    def run(self, conn: psycopg.Connection, now: float) -> None:
        raise NotImplementedError

    def rolled_back(self) -> None:
        """The shared transaction this duty ran in did not commit: forget what it did."""

    def stop(self, conn: psycopg.Connection) -> None:
        """The supervisor is leaving: undo what would otherwise wait for an expiry."""


class Periodic(Duty):
    """A duty that runs every ``interval()`` seconds (read each turn: a reload may change it)."""

    def __init__(self, interval: Callable[[], float]) -> None:
        super().__init__()
        self.interval = interval

    def run(self, conn: psycopg.Connection, now: float) -> None:
        # Scheduled before the work: a failure waits for the next turn, not a spin.
        self.next_at = now + self.interval()
        self.work(conn, now)

    def work(self, conn: psycopg.Connection, now: float) -> None:
        """One turn; ``now`` is the monotonic instant it began."""
        raise NotImplementedError


NEVER = math.inf
