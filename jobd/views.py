"""Read-only views of the queue for operators: per-lane status, single jobs, listings.

What ``jobd status``, ``jobd jobs`` and ``jobd dlq list`` show. (Named ``views``, not
``inspect``, which is a standard-library module that jobd itself imports.)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.string import TextLoader

from jobd.queries import query

JOB_STATES = ("pending", "claimed", "done", "failed", "dead", "cancelled")


@dataclass(frozen=True, slots=True)
class LaneStatus:
    lane: str
    pending: int
    claimed: int
    failed: int
    dead: int
    oldest_unclaimed_age: float
    # The live jobs by what they wait for; with claimed they add up to the lane's depth.
    due: int = 0  # pending or failed, claimable now
    scheduled: int = 0  # pending, run_at ahead
    retrying: int = 0  # failed, waiting out the backoff

    @property
    def depth(self) -> int:
        return self.pending + self.claimed + self.failed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def lane_status(conn: psycopg.Connection, now: datetime | None = None) -> list[LaneStatus]:
    """Counts of live jobs by state, the oldest due unclaimed job's age (s), DLQ depth."""
    rows = conn.execute(query("lane_stats"), {"now": now}).fetchall()
    return [LaneStatus(*row) for row in rows]


def unlisted_handlers(conn: psycopg.Connection, handlers: list[str]
                       ) -> dict[str, dict[str, int]]:
    """Per lane, the handlers not in ``handlers`` that have jobs waiting to be claimed, and
    how many each."""
    found: dict[str, dict[str, int]] = {}
    for lane, handler, count in conn.execute(query("jobs_of_unlisted_handlers"),
                                             {"handlers": handlers}):
        found.setdefault(lane, {})[handler] = count
    return found


def with_lanes(statuses: list[LaneStatus], names: set[str]) -> list[LaneStatus]:
    """``statuses`` plus an empty status for each named lane that has none (a lane the
    config or a live node names but that holds no jobs), sorted by lane."""
    missing = names - {s.lane for s in statuses}
    return sorted([*statuses, *(LaneStatus(name, 0, 0, 0, 0, 0.0) for name in missing)],
                  key=lambda s: s.lane)


def waits(status: LaneStatus) -> bool:
    """Whether a due job of the lane waits to be claimed: due jobs that are all paused wait
    by the operator's choice, and have no oldest unclaimed age to show."""
    return status.due > 0 and status.oldest_unclaimed_age > 0


def over_slo(status: LaneStatus, slo_pickup: float | None) -> bool | None:
    """Whether the lane's oldest due job has waited longer than its pickup SLO; None when
    the lane has no SLO (in the config given)."""
    if slo_pickup is None:
        return None
    return status.due > 0 and status.oldest_unclaimed_age > slo_pickup


@dataclass(frozen=True, slots=True)
class LaneLatency:
    """Over a lane's jobs finished in a recent window (at most a sample of the newest):
    percentiles in seconds, None when none finished (or none carries a claim time)."""

    lane: str
    finished: int
    run_p50: float | None
    run_p99: float | None
    pickup_p50: float | None
    pickup_p99: float | None


def lane_latency(conn: psycopg.Connection, lanes: list[str], window: float, sample: int,
                 now: datetime | None = None) -> dict[str, LaneLatency]:
    """Claim-to-finish time and pickup delay of each lane's recently finished jobs, from
    the archive (claimed_at, run_at, finished_at), bounded by ``window`` seconds and
    ``sample`` jobs per lane."""
    rows = conn.execute(query("lane_latency"), {
        "lanes": lanes, "window": window, "sample": sample, "now": now}).fetchall()
    result = {}
    for lane, finished, run, pickup in rows:
        run_p50, run_p99 = run or (None, None)
        pickup_p50, pickup_p99 = pickup or (None, None)
        result[lane] = LaneLatency(lane, finished, run_p50, run_p99, pickup_p50, pickup_p99)
    return result


def database_clock(conn: psycopg.Connection, now: datetime | None = None) -> datetime:
    row = conn.execute(query("database_clock"), {"now": now}).fetchone()
    assert row is not None
    return row[0]


# A node is gone when it missed this many heartbeats and at least GRACE seconds passed; a
# node that does not state its interval (a daemon older than migration 0015) after UNKNOWN.
NODE_GONE_MISSES = 3
NODE_GONE_GRACE = 10.0
NODE_GONE_UNKNOWN = 60.0


@dataclass(frozen=True, slots=True)
class NodeStatus:
    instance: str  # unique per supervisor process: node name, pid, random suffix
    node: str
    pid: int
    seen_at: datetime
    workers: dict[str, int]  # per configured lane: live workers
    # Per lane: {"claimed": per second, "completed": ..., "failed": ..., "dead": ...} over the
    # node's last two heartbeats; empty until it has sent two.
    rates: dict[str, dict[str, float]]
    started_at: datetime | None = None
    last_heartbeat_age_seconds: float = 0.0  # by the database clock
    heartbeat_interval_seconds: float | None = None  # None: a daemon that does not state it
    gone: bool = False  # stopped beating without leaving (killed, frozen, cut off)
    # Whether its supervisor holds its LISTEN connection (False: its workers wake on the
    # fallback poll only); None for a node that does not report it.
    listening: bool | None = None
    # Per configured lane, the settings every node of it should share
    # (LaneConfig.fleet_settings); None for a node that does not report them.
    lane_settings: dict[str, dict[str, Any]] | None = None

    @property
    def lanes(self) -> list[str]:
        return sorted(self.workers)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lanes": self.lanes}


def node_status(conn: psycopg.Connection, include_gone: bool = False) -> list[NodeStatus]:
    """The supervisors that beat recently, with their workers and rates; with
    ``include_gone``, also those that stopped beating without leaving (their rows stay for an
    hour), marked ``gone``."""
    rows = conn.execute(query("live_nodes"), {
        "misses": NODE_GONE_MISSES, "grace": NODE_GONE_GRACE,
        "unknown": NODE_GONE_UNKNOWN}).fetchall()
    nodes = [
        # A gone node's last reported workers are not live: its lanes stay listed, at 0, as
        # the lane table, the unserved-lane alert and the lease sweep judge them.
        NodeStatus(instance, node, pid, seen_at,
                   dict.fromkeys(workers, 0) if gone else workers,
                   _rates(counters, previous, sample_seconds) if not gone else {},
                   started, age, interval, gone, listening, lane_settings)
        for (instance, node, pid, started, seen_at, workers, counters, previous,
             sample_seconds, age, interval, gone, listening, lane_settings) in rows
    ]
    return [n for n in nodes if include_gone or not n.gone]


# {lane: {setting: {instance: value}}}
Disagreements = dict[str, dict[str, dict[str, Any]]]


def lane_disagreements(nodes: list[NodeStatus]) -> Disagreements:
    """The lanes whose live nodes configure them differently: per lane, each setting that
    differs with every such node's value, by instance. Nodes that do not state their
    settings (older daemons) and gone nodes are left out."""
    by_lane: dict[str, dict[str, dict[str, Any]]] = {}
    for node in nodes:
        if node.gone or not node.lane_settings:
            continue
        for lane, settings in node.lane_settings.items():
            by_lane.setdefault(lane, {})[node.instance] = settings
    found: Disagreements = {}
    for lane, per_node in by_lane.items():
        # Only what every node states: a setting a newer release adds is no disagreement
        # with the nodes of the older one during a rolling upgrade.
        names = sorted(set.intersection(*(set(settings) for settings in per_node.values())))
        differing = {
            name: {instance: settings[name] for instance, settings in sorted(per_node.items())}
            for name in names
            if len({json.dumps(settings[name]) for settings in per_node.values()}) > 1}
        if differing:
            found[lane] = differing
    return found


def _rates(counters: dict[str, dict[str, int]], previous: dict[str, dict[str, int]],
           seconds: float | None) -> dict[str, dict[str, float]]:
    if not seconds or seconds <= 0:
        return {}
    rates: dict[str, dict[str, float]] = {}
    for lane, values in counters.items():
        before = previous.get(lane, {})
        rates[lane] = {key: max(0, value - before.get(key, 0)) / seconds
                       for key, value in values.items()}
    return rates


def lane_rates(nodes: list[NodeStatus]) -> dict[str, dict[str, float]]:
    """Rates per lane summed over all live nodes."""
    total: dict[str, dict[str, float]] = {}
    for node in nodes:
        for lane, values in node.rates.items():
            lane_total = total.setdefault(lane, {})
            for key, value in values.items():
                lane_total[key] = lane_total.get(key, 0.0) + value
    return total


def live_workers(nodes: list[NodeStatus]) -> dict[str, int]:
    """Workers per lane summed over the live nodes; a lane missing here has none."""
    total: dict[str, int] = {}
    for node in nodes:
        for lane, count in node.workers.items():
            if count > 0:
                total[lane] = total.get(lane, 0) + count
    return total


def get_job(conn: psycopg.Connection, job_id: int) -> dict[str, Any] | None:
    """One job, live, finished or dead, with its error history.

    ``payload`` is the decoded payload and ``payload_text`` its JSON text as stored. A
    payload that PostgreSQL accepted but Python cannot decode (nested too deeply, an integer
    of more than 4300 digits) must still be shown: then ``payload`` is None and
    ``payload_problem`` says why (it is None otherwise).
    """
    with conn.cursor(row_factory=dict_row) as cur:
        # The JSON columns come back as text, decoded below where a failure can be handled.
        cur.adapters.register_loader("jsonb", TextLoader)
        cur.adapters.register_loader("json", TextLoader)
        job = cur.execute(query("get_job"), {"id": job_id}).fetchone()
    if job is None:
        return None
    job["errors"] = json.loads(job["errors"])
    text = job["payload"]
    job["payload_text"], job["payload_problem"] = text, None
    try:
        job["payload"] = json.loads(text)
    except RecursionError:
        job["payload"], job["payload_problem"] = None, "nested too deeply to decode"
    except ValueError as exc:
        job["payload"], job["payload_problem"] = None, f"cannot be decoded: {exc}"
    return job


def list_jobs(
    conn: psycopg.Connection, state: str | None = None, lane: str | None = None, limit: int = 50,
    before: int | None = None,
) -> list[dict[str, Any]]:
    """Jobs newest first, live and finished; ``before``: only ids below it (the next page
    starts below the last id of this one)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("list_jobs"), {
            "state": state, "lane": lane, "limit": limit, "before": before}).fetchall()


def list_dead(
    conn: psycopg.Connection, lane: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("list_dead"), {"lane": lane, "limit": limit}).fetchall()
