"""``jobd top``: the queue per lane and per node, from the database alone.

:func:`collect` reads one :class:`Snapshot` through :mod:`jobd.views` (what ``jobd status``
reads, plus the latencies of recently finished jobs); :func:`render` turns a snapshot into
styled lines for a screen of a given size and :func:`plain` into text for a pipe, both
without I/O. The live loop, curses and keys, is :mod:`jobd.top_screen`.

Where the figures come from:

- depth, due/scheduled/claimed/retrying, oldest unclaimed age and DLQ depth: the live jobs
  and the dead-letter queue (``lane_stats``, as in ``jobd status``);
- claim, completion and failure rates: the counters each supervisor writes to ``jobd.nodes``
  at every heartbeat (``duty_interval``), over its last two heartbeats;
- RUN (claim to finish: it includes time in a worker's prefetch buffer, which the database
  cannot tell from running) and PICKUP (due to claimed) percentiles: the archive's
  ``claimed_at``, ``run_at`` and ``finished_at`` of each lane's jobs finished in the last
  :data:`LATENCY_WINDOW` seconds, at most its :data:`LATENCY_SAMPLE` newest. Only jobs that
  finished are counted: failed attempts and dead jobs are not in the archive.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import psycopg

from jobd import pauses, views
from jobd.cli_output import seconds
from jobd.config import Config

LATENCY_WINDOW = 60.0
LATENCY_SAMPLE = 1000

Style = Literal["title", "header", "normal", "alert", "warn", "error", "dim"]


@dataclass(frozen=True, slots=True)
class Line:
    text: str
    style: Style = "normal"


@dataclass(frozen=True, slots=True)
class LaneRow:
    status: views.LaneStatus
    latency: views.LaneLatency | None
    # Per second, summed over the live nodes; None until a node has sent two heartbeats.
    rates: dict[str, float] | None
    workers: int
    slo_pickup: float | None
    # jobd.pause: the whole lane, and the handlers paused in it.
    paused: bool = False
    paused_handlers: tuple[str, ...] = ()

    @property
    def over_slo(self) -> bool | None:
        return views.over_slo(self.status, self.slo_pickup)

    @property
    def unserved(self) -> bool:
        """Due work and no live worker to take it."""
        return self.status.due > 0 and self.workers == 0

    def rate(self, *kinds: str) -> float | None:
        if self.rates is None:
            return None
        return sum(self.rates.get(kind, 0.0) for kind in kinds)

    def as_dict(self) -> dict[str, Any]:
        s, latency = self.status, self.latency
        return {
            "lane": s.lane, "depth": s.depth, "due": s.due, "scheduled": s.scheduled,
            "claimed": s.claimed, "retrying": s.retrying, "dead": s.dead,
            "oldest_unclaimed_age": s.oldest_unclaimed_age,
            "slo_pickup_seconds": self.slo_pickup, "over_slo": self.over_slo,
            "paused": self.paused, "paused_handlers": list(self.paused_handlers),
            "live_workers": self.workers, "claim_rate": self.rate("claimed"),
            "completion_rate": self.rate("completed"),
            "failure_rate": self.rate("failed", "dead"),
            "finished_in_window": latency.finished if latency else 0,
            "run_p50_seconds": latency.run_p50 if latency else None,
            "run_p99_seconds": latency.run_p99 if latency else None,
            "pickup_p50_seconds": latency.pickup_p50 if latency else None,
            "pickup_p99_seconds": latency.pickup_p99 if latency else None,
        }


@dataclass(frozen=True, slots=True)
class NodeRow:
    node: str
    instance: str
    pid: int
    workers: dict[str, int]
    seen_ago: float  # seconds since its last heartbeat, by the database clock

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "instance": self.instance, "pid": self.pid,
                "workers": self.workers, "seen_seconds_ago": self.seen_ago}


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: datetime  # the database clock when it was read
    lanes: tuple[LaneRow, ...]
    nodes: tuple[NodeRow, ...]
    window: float = LATENCY_WINDOW
    sample: int = LATENCY_SAMPLE

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.at, "latency_window_seconds": self.window,
                "latency_sample": self.sample,
                "lanes": [lane.as_dict() for lane in self.lanes],
                "nodes": [node.as_dict() for node in self.nodes]}


def collect(conn: psycopg.Connection, config: Config, *, window: float = LATENCY_WINDOW,
            sample: int = LATENCY_SAMPLE, now: datetime | None = None) -> Snapshot:
    """One snapshot: the lanes that hold jobs or dead jobs, that the config names, that a
    live node serves or that a pause names (the lanes of ``jobd status``), and the live
    nodes."""
    nodes = views.node_status(conn)
    workers = views.live_workers(nodes)
    paused = pauses.pauses(conn)
    # A lane paused before its first job (ahead of a deploy) shows, as in `jobd status`
    # and jobd_lane_paused: the pause is in force for the jobs still to come.
    statuses = views.with_lanes(views.lane_status(conn, now), set(config.lanes) | set(workers)
                                | {p.lane for p in paused})
    latency = views.lane_latency(conn, [s.lane for s in statuses], window, sample, now)
    at = views.database_clock(conn, now)
    rates = views.lane_rates(nodes)
    lanes = tuple(
        LaneRow(s, latency.get(s.lane), rates.get(s.lane), workers.get(s.lane, 0),
                config.lanes[s.lane].slo_pickup if s.lane in config.lanes else None,
                paused=any(p.lane == s.lane and p.handler is None for p in paused),
                paused_handlers=tuple(p.handler for p in paused
                                      if p.lane == s.lane and p.handler is not None))
        for s in statuses)
    node_rows = tuple(NodeRow(n.node, n.instance, n.pid, n.workers,
                              max(0.0, (at - n.seen_at).total_seconds())) for n in nodes)
    return Snapshot(at, lanes, node_rows, window, sample)


# --- formatting ----------------------------------------------------------------------------


def rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 10_000 else f"{value / 1000:.1f}k"


# --- tables --------------------------------------------------------------------------------

LANE_COLUMNS = ("LANE", "DEPTH", "DUE", "SCHED", "CLAIMED", "RETRY", "OLDEST", "SLO", "DLQ",
                "CLAIM/s", "DONE/s", "FAIL/s", "RUN p50", "RUN p99", "PICK p50", "PICK p99",
                "WORKERS", "")
NODE_COLUMNS = ("NODE", "PID", "SEEN", "WORKERS")


def _lane_cells(row: LaneRow) -> list[str]:
    s, latency = row.status, row.latency
    notes = ((["OVER SLO"] if row.over_slo else []) + (["PAUSED"] if row.paused else [])
             + ([f"paused: {', '.join(row.paused_handlers)}"] if row.paused_handlers else [])
             + (["no worker"] if row.unserved else []))
    return [s.lane, str(s.depth), str(s.due), str(s.scheduled), str(s.claimed), str(s.retrying),
            seconds(s.oldest_unclaimed_age) if views.waits(s) else "-", seconds(row.slo_pickup),
            str(s.dead), rate(row.rate("claimed")), rate(row.rate("completed")),
            rate(row.rate("failed", "dead")),
            seconds(latency.run_p50 if latency else None),
            seconds(latency.run_p99 if latency else None),
            seconds(latency.pickup_p50 if latency else None),
            seconds(latency.pickup_p99 if latency else None),
            str(row.workers), ", ".join(notes)]


def _lane_style(row: LaneRow) -> Style:
    if row.over_slo:
        return "alert"
    return "warn" if row.unserved else "normal"


def _node_cells(row: NodeRow) -> list[str]:
    workers = ", ".join(f"{lane} {count}" for lane, count in sorted(row.workers.items()))
    return [row.node, str(row.pid), seconds(row.seen_ago) + " ago", workers or "-"]


def _table(headers: tuple[str, ...], rows: list[tuple[list[str], Style]]) -> list[Line]:
    """Aligned lines: the first and last columns left-aligned (names, notes), the figures
    right-aligned, two spaces apart."""
    widths = [max(len(h), *(len(cells[i]) for cells, _ in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str] | tuple[str, ...]) -> str:
        last = len(cells) - 1
        parts = [c.ljust(w) if i in (0, last) else c.rjust(w)
                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    return [Line(line(headers), "header"), *(Line(line(cells), style) for cells, style in rows)]


def lane_table(snapshot: Snapshot) -> list[Line]:
    return _table(LANE_COLUMNS, [(_lane_cells(r), _lane_style(r)) for r in snapshot.lanes])


def node_table(snapshot: Snapshot) -> list[Line]:
    if not snapshot.nodes:
        return [Line("no live nodes (no daemon has reported in the last minute)", "dim")]
    return _table(NODE_COLUMNS, [(_node_cells(n), "normal") for n in snapshot.nodes])


def footnote(snapshot: Snapshot) -> Line:
    return Line(f"RUN: claim to finish, PICK: due to claimed, over each lane's jobs finished "
                f"in the last {seconds(snapshot.window)} (newest {snapshot.sample}); "
                f"rates from the nodes' heartbeats", "dim")


def _title(snapshot: Snapshot) -> str:
    at = snapshot.at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return (f"jobd top  {at} (database clock)  {_count(len(snapshot.lanes), 'lane')}, "
            f"{_count(len(snapshot.nodes), 'live node')}")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def plain(snapshot: Snapshot) -> str:
    """The snapshot as text, for a pipe or a file (``--once``, or stdout not a terminal)."""
    lanes = lane_table(snapshot) if snapshot.lanes else [Line("(no lanes: no jobs, no "
                                                              "configured lanes)")]
    lines = [Line(_title(snapshot)), Line(""), *lanes, Line(""), *node_table(snapshot),
             Line(""), footnote(snapshot)]
    return "\n".join(line.text for line in lines)


def render(snapshot: Snapshot, width: int, height: int, *, interval: float,
           note: str | None = None, slowed: bool = False) -> list[Line]:
    """What the live view shows on a ``width`` x ``height`` screen: at most ``height``
    lines of at most ``width`` characters. Lanes come first; when they do not all fit, a
    line says how many are left out, and the nodes get what room remains. ``slowed``: the
    refresh is longer than asked because reads take long."""
    pace = f"every {seconds(interval)}" + (" (slowed: reads take long)" if slowed else "")
    top = [Line(f"{_title(snapshot)}  {pace}  q quits", "title")]
    if note:
        top.append(Line(note, "error"))
    lanes = lane_table(snapshot) if snapshot.lanes else [Line("(no lanes)", "dim")]
    nodes = node_table(snapshot)
    room = height - len(top) - 1  # a blank line under the title
    # Keep room for the nodes' header and first row unless the lanes need all of it.
    lane_room = max(2, room - 3) if len(lanes) + 3 > room else len(lanes)
    shown = _fit(lanes, lane_room, "lanes")
    node_room = room - len(shown) - 1
    lines = [*top, Line(""), *shown]
    if node_room >= 1:
        lines += [Line(""), *_fit(nodes, node_room, "nodes")]
    if len(lines) + 2 <= height:
        lines += [Line(""), footnote(snapshot)]
    return [Line(line.text[:width], line.style) for line in lines[:height]]


def _fit(table: list[Line], room: int, what: str) -> list[Line]:
    """The table in ``room`` lines; when it does not fit, its last line says what is left
    out (the header is kept: rows without it cannot be read)."""
    if len(table) <= room:
        return table
    if room < 2:
        return table[:room]
    kept = table[:room - 1]
    return [*kept, Line(f"... {len(table) - len(kept)} more {what} (enlarge the window)", "dim")]
