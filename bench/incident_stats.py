"""The incident drill's figures, once it ran: what Prometheus recorded and what the database
says, as one JSON-ready record (bench/incident_report.py writes it out and draws it).

Times are seconds from the cause (the moment the drill rewrote the server's clock file), on
this machine's clock. The database's timestamps are an hour ahead after the jump; they are
brought back with the offset measured right after it (``offset_after_s``), before the jump
with ``offset_before_s``.

Pickup (claim time minus ``run_at``, both the database's clock) comes from the archive's
``claimed_at`` and ``run_at`` of every finished job, per handler, in two windows of
*enqueue* time: the baseline (enqueued after the first 5 s of steady traffic, claimed before
the jump) and the herd (enqueued from the jump until the herd drained). A job enqueued just
before the jump and claimed after it is in neither: its ``run_at`` is on the old clock.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    from bench.incident_run import Drill

from bench.incident_run import LANE, POISON, STEADY

WARMUP_S = 5.0
RATE_WINDOW = "10s"

# The chart's series: PromQL per panel, one line per label set.
SERIES = {
    "depth": f'max by (state) (jobd_queue_depth{{lane="{LANE}"}})',
    "oldest_unclaimed_age": f'max(jobd_oldest_unclaimed_age_seconds{{lane="{LANE}"}})',
    "dlq_depth": f'max(jobd_dlq_depth{{lane="{LANE}"}})',
    "restarts": f'sum by (reason) (jobd_worker_restarts_total{{lane="{LANE}"}})',
    "lease_expiries": f'sum(jobd_lease_expiries_total{{lane="{LANE}"}})',
    "throughput": (f'sum by (handler) (rate(jobd_jobs_completed_total{{lane="{LANE}", '
                   f'outcome="done"}}[{RATE_WINDOW}]))'),
    "workers_running": f'sum(jobd_workers{{lane="{LANE}", state="running"}})',
}


def _epoch(value: datetime, offset: float) -> float:
    return value.timestamp() - offset


def _pickup(conn: psycopg.Connection, low: str, high: str,
            claimed_before: str | None) -> dict[str, dict[str, float]]:
    rows = conn.execute(
        "SELECT handler, count(*),"
        "       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY"
        "           extract(epoch FROM claimed_at - run_at)),"
        "       max(extract(epoch FROM claimed_at - run_at))"
        "  FROM jobd.jobs_archive"
        " WHERE state = 'done' AND created_at >= %s AND created_at <= %s"
        "   AND (%s::timestamptz IS NULL OR claimed_at < %s::timestamptz)"
        " GROUP BY handler ORDER BY handler",
        (low, high, claimed_before, claimed_before)).fetchall()
    return {handler: {"jobs": int(n), "p50_s": round(float(q[0]), 4),
                      "p99_s": round(float(q[1]), 4), "max_s": round(float(m), 4)}
            for handler, n, q, m in rows}


def pickup_windows(drill: Drill) -> dict[str, Any]:
    notes = drill.marks.notes
    with psycopg.connect(drill.url, autocommit=True) as conn:
        row = conn.execute("SELECT (%s::timestamptz - make_interval(secs => %s))::text",
                           (notes["db_before_jump"], drill.s.baseline_s - WARMUP_S)).fetchone()
        assert row is not None
        baseline = _pickup(conn, row[0], notes["db_before_jump"], notes["db_before_jump"])
        end = notes.get("db_herd_drained", notes["db_end"])
        herd = _pickup(conn, notes["db_after_jump"], end, None)
    ratios = {}
    for handler in STEADY:
        base, during = baseline.get(handler), herd.get(handler)
        if base and during and base["p99_s"] > 0:
            ratios[handler] = round(during["p99_s"] / base["p99_s"], 2)
    return {"baseline": baseline, "herd": herd, "p99_ratio": ratios}


def crashes(drill: Drill) -> list[tuple[int, int, float]]:
    path = drill.stamps / "crashes.txt"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        job_id, attempt, at = line.split()
        rows.append((int(job_id), int(attempt), float(at)))
    return sorted(rows, key=lambda r: r[2])


def poison_fates(drill: Drill, crash_rows: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Each poison job's first crash, its death and how it died: attempts spent by crashes
    (crash attribution) or moved by the quarantine."""
    offset = drill.marks.notes["offset_after_s"]
    first_crash: dict[int, float] = {}
    crash_count: dict[int, int] = {}
    for job_id, _attempt, at in crash_rows:
        first_crash.setdefault(job_id, at)
        crash_count[job_id] = crash_count.get(job_id, 0) + 1
    with psycopg.connect(drill.url, autocommit=True) as conn:
        dead = conn.execute("SELECT id, died_at, attempts, last_error, created_at "
                            "FROM jobd.dead_letter WHERE handler = %s ORDER BY died_at",
                            (POISON,)).fetchall()
        row = conn.execute("SELECT count(*) FROM jobd.jobs WHERE handler = %s",
                           (POISON,)).fetchone()
        assert row is not None
        still_queued = int(row[0])
    to_dlq, quarantined = [], []
    for job_id, died_at, attempts, error, created_at in dead:
        died = _epoch(died_at, offset)
        entry = {"id": job_id, "died": died, "attempts": attempts,
                 "created": _epoch(created_at, offset),
                 "crashes": crash_count.get(job_id, 0), "first_crash": first_crash.get(job_id)}
        if "quarantine" in (error or ""):
            quarantined.append(entry)
        else:
            entry["first_crash_to_dlq_s"] = (round(died - first_crash[job_id], 3)
                                             if job_id in first_crash else None)
            to_dlq.append(entry)
    sent = len(drill.poison.sent_rows().splitlines())
    return {"sent": sent, "crashed": len(first_crash), "crashes": len(crash_rows),
            "dead_by_crashes": to_dlq, "quarantined": quarantined,
            "still_queued_paused": still_queued}


def completeness(drill: Drill) -> dict[str, Any]:
    with psycopg.connect(drill.url, autocommit=True) as conn:
        rows = conn.execute("SELECT handler, state, count(*) FROM jobd.jobs_archive "
                            "GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
        live = conn.execute("SELECT handler, count(*) FROM jobd.jobs GROUP BY 1 "
                            "ORDER BY 1").fetchall()
    sent = {h: p.jobs_sent for h, p in drill.producers.items()}
    return {"archived": [{"handler": h, "state": st, "jobs": n} for h, st, n in rows],
            "live": dict(live), "steady_sent": sent}


def series(drill: Drill, start: float, end: float) -> dict[str, list[dict[str, Any]]]:
    step = drill.s.interval_s
    return {name: drill.prom.query_range(expr, start, end, step)
            for name, expr in SERIES.items()}


def _rel(at: float | None, cause: float) -> float | None:
    return None if at is None else round(at - cause, 2)


def timeline(drill: Drill, alerts: dict[str, dict[str, float]],
             fates: dict[str, Any], crash_rows: list[tuple[int, int, float]]) -> list[dict]:
    ev = drill.marks.events
    cause = ev["cause"]
    items: list[tuple[float, str]] = [
        (ev["baseline_begins"], "baseline: steady traffic, the herd scheduled an hour ahead"),
        (cause, "cause: the database server's clock file set to +1h"
                + ("; poison starts arriving" if drill.s.poison_every_s > 0 else "")),
        (ev["jump_seen"], "the database's now() reads an hour ahead"),
    ]
    if crash_rows:
        items.append((crash_rows[0][2], f"first crash: poison job {crash_rows[0][0]} kills "
                                        "its worker (SIGSEGV)"))
    if fates["dead_by_crashes"]:
        first = fates["dead_by_crashes"][0]
        items.append((first["died"], f"first poison job dead-lettered by crash attribution "
                                     f"(job {first['id']}, {first['crashes']} crashes)"))
    for name, states in sorted(alerts.items()):
        if "pending" in states:
            items.append((states["pending"], f"alert {name} pending"))
        if "firing" in states:
            items.append((states["firing"], f"alert {name} firing"))
    for name in ("mitigation_begins", "poison_paused", "poison_quarantined", "herd_drained",
                 "end"):
        if name in ev:
            items.append((ev[name], {
                "mitigation_begins": "mitigation begins (" +
                                     str(drill.marks.notes.get("mitigation_trigger")) + ")",
                "poison_paused": "`jobd lanes pause default --handler poison` done",
                "poison_quarantined": "`jobd dlq quarantine --handler poison` done",
                "herd_drained": "herd drained: no herd job left in jobd.jobs",
                "end": "end of the drill",
            }[name]))
    if crash_rows:
        items.append((crash_rows[-1][2], "last poison crash"))
    items.sort(key=lambda item: item[0])
    return [{"t_s": _rel(at, cause), "utc": datetime.utcfromtimestamp(at).isoformat() + "Z",
             "event": text} for at, text in items]


def _first(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None and not math.isnan(v)]
    return min(real) if real else None


def collect(drill: Drill) -> dict[str, Any]:
    ev, notes = drill.marks.events, drill.marks.notes
    cause = ev["cause"]
    alerts = drill.prom.alert_times(ev["start"] - 5, ev["end"] + drill.s.interval_s)
    crash_rows = crashes(drill)
    fates = poison_fates(drill, crash_rows)
    pickup = pickup_windows(drill)
    dlq_latencies = [d["first_crash_to_dlq_s"] for d in fates["dead_by_crashes"]
                     if d.get("first_crash_to_dlq_s") is not None]
    summary = {
        "herd_jobs": drill.s.herd,
        "herd_drain_s": _rel(ev.get("herd_drained"), cause),
        "first_crash_s": _rel(crash_rows[0][2] if crash_rows else None, cause),
        "first_poison_dlq_s": _rel(fates["dead_by_crashes"][0]["died"]
                                   if fates["dead_by_crashes"] else None, cause),
        "first_crash_to_dlq_s": {
            "min": min(dlq_latencies) if dlq_latencies else None,
            "max": max(dlq_latencies) if dlq_latencies else None,
            "jobs": len(dlq_latencies)},
        "alerts_firing_s": {name: _rel(states.get("firing"), cause)
                            for name, states in sorted(alerts.items())},
        "alerts_pending_s": {name: _rel(states.get("pending"), cause)
                             for name, states in sorted(alerts.items())},
        "mitigation_s": {name: _rel(ev.get(name), cause)
                         for name in ("mitigation_begins", "poison_paused",
                                      "poison_quarantined")},
        "crashes": fates["crashes"],
        "pickup_p99_ratio": pickup["p99_ratio"],
        "fairness": drill.s.fairness,
        "fair_by_key_written": drill.fair_key,
        "drain_timed_out": bool(notes.get("drain_timed_out")),
    }
    first_fire = _first([v for v in summary["alerts_firing_s"].values()])
    summary["first_alert_firing_s"] = first_fire
    return {
        "summary": summary,
        "settings": {k: (str(v) if hasattr(v, "parts") else v)
                     for k, v in vars(drill.s).items()},
        "marks": {k: _rel(v, cause) for k, v in ev.items()},
        "notes": {k: v for k, v in notes.items() if k != "mitigation"},
        "mitigation": [{**m, "started": _rel(m["started"], cause)}
                       for m in notes.get("mitigation", [])],
        "timeline": timeline(drill, alerts, fates, crash_rows),
        "alerts": {name: {state: _rel(at, cause) for state, at in states.items()}
                   for name, states in alerts.items()},
        "pickup": pickup,
        "poison": {**fates,
                   "dead_by_crashes": [{**d, "died": _rel(d["died"], cause),
                                        "created": _rel(d["created"], cause),
                                        "first_crash": _rel(d["first_crash"], cause)}
                                       for d in fates["dead_by_crashes"]],
                   "quarantined": [{**d, "died": _rel(d["died"], cause),
                                    "created": _rel(d["created"], cause),
                                    "first_crash": _rel(d["first_crash"], cause)}
                                   for d in fates["quarantined"]]},
        "completeness": completeness(drill),
        "series": {name: [{"metric": s["metric"],
                           "values": [(round(t - cause, 2), v) for t, v in s["values"]]}
                          for s in got]
                   for name, got in series(drill, ev["start"] - 5, ev["end"]).items()},
    }
