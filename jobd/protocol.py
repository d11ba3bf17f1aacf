"""What the supervisor and its workers say to each other, and nothing else.

A worker is started as ``python -m jobd.worker`` with a :class:`WorkerSpec` as JSON on
stdin, and inherits two pipes:

- **status** (worker → supervisor): a :class:`StatusReport` JSON line about every second.
  Its arrival is the worker's liveness signal; its content is the worker's own view (the
  supervisor keeps its estimates elsewhere).
- **wake** (supervisor → worker): single bytes, :data:`WAKE` ("your lane may have due work"),
  :data:`SUSPECTS` ("a suspect may be due in your lane": a job to run alone, see
  ``recovery.settle_crashed_worker``), :data:`CONTROLS` ("your lane's pauses changed: look
  again"), :data:`CANCELS` ("jobs of your lane were asked to stop: renew your leases now,
  which tells you which") or :data:`BEHIND` ("jobs due for a while were enqueued: they may
  be below your claim floors, claim from the head"). End of file means the supervisor is
  gone.

The worker's exit code says how it ended (:data:`EXIT_OK`, :data:`EXIT_BOOT_FAILURE`,
:data:`EXIT_WEDGED`, :data:`EXIT_LOOP_FAILED`); :func:`describe_exit` turns one into words for
logs and job errors.
:data:`EXIT_OK` counts as a clean stop only with the shutdown mark on the worker's run board
(``jobd.run_board``): a handler's ``os._exit(0)`` exits with 0 too.
"""

from __future__ import annotations

import enum
import hashlib
import json
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

from jobd.backoff import Backoff
from jobd.config import LaneConfig
from jobd.db import APPLICATION_NAME_MAX, DEFAULT_SESSION, SessionSettings
from jobd.worker_metrics import WorkTotals

EXIT_OK = 0
EXIT_BOOT_FAILURE = 3  # a handler could not be imported: restarting will not help
EXIT_WEDGED = 4  # every slot is held by a handler that ignored its timeout
# The loop raised: a handler closed the worker's pipes or sockets, used up its descriptors...
EXIT_LOOP_FAILED = 5

WAKE = b"!"
SUSPECTS = b"S"
CONTROLS = b"P"
CANCELS = b"C"
BEHIND = b"B"


class WorkerMode(enum.StrEnum):
    RUNNING = "running"
    DRAINING = "draining"  # SIGTERM: no new claims, finish until shutdown_timeout, release
    RETIRING = "retiring"  # SIGUSR2 (a reload replaced it): no new claims, finish everything


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs, handed over on its stdin."""

    worker_id: str
    lane: LaneConfig
    handlers: dict[str, str]
    database_url: str
    schema: str
    slot: int
    generation: int
    status_fd: int
    wake_fd: int
    shutdown_timeout: float
    senders: dict[str, str] = field(default_factory=dict)
    outbox_lane: str = "outbox"
    log_level: str = "info"
    metrics: bool = False  # count per handler for the node's metrics (metrics.listen is set)
    node: str = ""  # the node's name, for the connections' application_name
    session: SessionSettings = DEFAULT_SESSION  # database.pooler and the session settings
    # Outcomes on a connection of their own (jobd.settler): the lane's settle_connection, as
    # the supervisor decided it for the whole node (LaneConfig.settles_apart). None from a
    # supervisor older than the field (a package upgraded under it): the worker decides.
    settles_apart: bool | None = None
    # The run board the supervisor reads when the worker dies (jobd.run_board); -1 from a
    # supervisor older than the field: none, and crash attribution suspects every job held.
    board_fd: int = -1
    # Where the worker's faulthandler writes its stack dumps (jobd.crash_dumps); -1: to the
    # log's stream, as before the field.
    crash_fd: int = -1
    # supervisor.worker_timeout: the worker's loop gives a silent connection up before it
    # (db.worker_reply_cap). None from a supervisor older than the field: no such bound.
    worker_timeout: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        lane = dict(data.pop("lane"))
        lane["backoff"] = Backoff(**lane["backoff"])
        session = SessionSettings(**data.pop("session", {}))
        return cls(lane=LaneConfig(**lane), session=session, **data)


@dataclass(frozen=True, slots=True)
class StatusReport:
    """A worker's report of itself. ``counters`` are totals since it started (claimed,
    completed, failed, dead, lease_lost, released); ``work`` the per-handler totals for the
    metrics (``jobd.worker_metrics``), when the node serves them."""

    busy: int = 0
    capacity: int = 0
    mode: WorkerMode = WorkerMode.RUNNING
    connected: bool = False
    counters: dict[str, int] = field(default_factory=dict)
    work: WorkTotals | None = None
    # The worker's run-board idle count when it wrote this: a count the supervisor reads
    # later but no higher is older than ``busy`` (jobd.workerpool.WorkerProcess.look_for_idle).
    idle_count: int = 0

    def to_line(self) -> bytes:
        data = {"busy": self.busy, "capacity": self.capacity, "mode": str(self.mode),
                "connected": self.connected, "counters": self.counters,
                "work": None if self.work is None else self.work.to_json(),
                "idle_count": self.idle_count}
        return (json.dumps(data, separators=(",", ":")) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> StatusReport:
        """ValueError for anything that is not a report."""
        data: Any = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a status report is a JSON object")
        counters = data.get("counters", {})
        if not isinstance(counters, dict):
            raise ValueError("counters must be an object")
        work = data.get("work")
        return cls(busy=_int(data.get("busy")), capacity=_int(data.get("capacity")),
                   mode=WorkerMode(data.get("mode", WorkerMode.RUNNING)),
                   connected=bool(data.get("connected")),
                   counters={str(k): _int(v) for k, v in counters.items()},
                   work=None if work is None else WorkTotals.from_json(work),
                   idle_count=_int(data.get("idle_count", 0)))


def backend_prefix(worker_id: str) -> str:
    """How the database connections of worker ``worker_id`` are named (``application_name``
    starts with this): a digest, because a worker id can be longer than the 63 characters
    PostgreSQL keeps, and the id's unique part is at its end."""
    digest = hashlib.sha256(worker_id.encode()).hexdigest()[:12]
    return f"jobd worker {digest} "


# Of a lane's name, at least this much shows in a worker connection's name when it is cut.
LANE_NAME_KEPT = 16


def worker_connection_name(spec: WorkerSpec, role: str = "") -> str:
    """``jobd worker <digest> <lane>/<slot>[ <role>] node=<node>``, within the characters
    PostgreSQL keeps. The slot and the role (``settle``, ``handler``) always show; the
    lane's name is cut where the whole node name would not fit after it, but keeps at least
    :data:`LANE_NAME_KEPT` characters, and the node's name is cut to what is left."""
    prefix = backend_prefix(spec.worker_id)
    tail = f"/{spec.slot}" + (f" {role}" if role else "")
    node = f" node={spec.node}"
    room = APPLICATION_NAME_MAX - len(prefix) - len(tail)
    lane = spec.lane.name[:max(room - len(node), LANE_NAME_KEPT)]
    return (prefix + lane + tail + node)[:APPLICATION_NAME_MAX]


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, not {value!r}")
    return value


def describe_exit(returncode: int, shut_down: bool = True, booted: bool = False) -> str:
    """``shut_down``: whether the worker finished its shutdown (its run board's mark); status
    0 without it is a worker that ended itself mid-run (``os._exit(0)`` in a handler).
    ``booted``: whether it reported after loading its handlers; status 3 after that is not a
    boot failure but a handler's own exit (``os._exit(3)``, a C library's ``exit(3)``)."""
    if returncode == EXIT_OK and not shut_down:
        return "exit code 0 without shutting down"
    if booted and returncode == EXIT_BOOT_FAILURE:
        return f"exit code {returncode}"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    meaning = {EXIT_BOOT_FAILURE: " (boot failure)", EXIT_WEDGED: " (wedged by timed-out jobs)",
               EXIT_LOOP_FAILED: " (its loop failed)"}
    return f"exit code {returncode}{meaning.get(returncode, '')}"
