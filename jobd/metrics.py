"""The node's Prometheus metrics: the families it exports and how the workers' totals add up.

Aggregation goes over the status pipe, not prometheus-client's multiprocess mode. Each
worker's report (about every second) carries its cumulative totals per handler
(``jobd.worker_metrics``); the supervisor keeps the last report of every worker. When a
worker ends, its last totals fold into its lane's *retired* totals here, so a node's counter
never goes backwards across restarts, and nothing of a dead worker is left to clean up: no
files, no shared directory, restarts handled in the one place that sees them. The price: what
a worker counted after its last report is lost if it dies without a final one (kill -9 between
reports); the job itself is recovered by crash attribution or the lease sweep, which have
their own counters.

The supervisor's loop builds a :class:`NodeView` (copies of its state, never shared with it)
and :meth:`NodeMetrics.publish` swaps it in; :class:`NodeCollector` turns the latest view
into families when the metrics endpoint's thread asks (``jobd.metrics_http``), so a scrape
never touches the loop's state and never blocks it. :data:`FAMILY_NAMES` is the list of
every exported family; each is exported from the start, zero-valued for every configured
lane and handler.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jobd.duties.metrics_sampler import DEPTH_STATES, Sample
from jobd.restarts import RESTART_REASONS
from jobd.worker_metrics import (
    OUTCOMES,
    UNLISTED,
    HandlerWork,
    Histogram,
    WorkTotals,
)
from jobd.workerpool import WORKER_STATES

FAMILY_NAMES = (
    # RED, per lane and handler
    "jobd_jobs_claimed_total",
    "jobd_jobs_completed_total",
    "jobd_job_duration_seconds",
    "jobd_pickup_delay_seconds",
    # queue state per lane (the sampler)
    "jobd_queue_depth",
    "jobd_oldest_unclaimed_age_seconds",
    "jobd_dlq_depth",
    "jobd_lane_slo_pickup_seconds",
    "jobd_lane_paused",
    # process health
    "jobd_workers",
    "jobd_worker_restarts_total",
    "jobd_lease_expiries_total",
    "jobd_stale_completions_total",
    "jobd_listener_connected",
    "jobd_supervisor_loop_lag_seconds",
    # the database's hazards (the sampler)
    "jobd_oldest_transaction_age_seconds",
    "jobd_xmin_horizon_age_xids",
    "jobd_jobs_dead_tuples",
    "jobd_notification_queue_usage",
    # the sampler itself
    "jobd_metrics_sample_age_seconds",
    "jobd_metrics_sample_duration_seconds",
)


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the node exports, as of one turn of the supervisor's loop. Built from copies:
    the supervisor never changes a view it published."""

    lanes: tuple[str, ...]
    handlers: tuple[str, ...]  # label values: the allow-list and UNLISTED
    work: Mapping[str, WorkTotals]  # per lane: retired and live workers added up
    workers: Mapping[str, Mapping[str, int]]  # lane -> state -> slots
    restarts: Mapping[tuple[str, str], int]  # (lane, reason)
    lease_expiries: Mapping[str, int]
    listener_connected: bool
    loop_lag: float
    sample: Sample | None
    started: float  # monotonic: the node's start, the sample age before the first sample
    # The lanes that declare a pickup SLO (slo.pickup, seconds): alert rules compare the
    # oldest unclaimed age against it. Lanes without one have no series.
    slo_pickup: Mapping[str, float] = field(default_factory=dict)


class NodeMetrics:
    """Aggregation: the retired totals of every lane, and the latest published view."""

    def __init__(self) -> None:
        self.retired: dict[str, WorkTotals] = {}
        self.view: NodeView | None = None

    def retire(self, lane: str, totals: WorkTotals | None) -> None:
        """A worker of ``lane`` ended: its last reported totals stay in the node's."""
        if totals is not None:
            self.retired.setdefault(lane, WorkTotals()).add(totals)

    def count_settled(self, lane: str, counts: Mapping[str, Mapping[str, int]],
                      allowed: Iterable[str]) -> None:
        """Outcomes (handler -> outcome -> jobs) that crash attribution wrote for a dead
        worker's jobs, counted as a worker counts its own: a handler outside the allow-list
        as UNLISTED."""
        totals = self.retired.setdefault(lane, WorkTotals())
        allowed = frozenset(allowed)
        for handler, by_outcome in counts.items():
            work = totals.handler(handler if handler in allowed else UNLISTED)
            for outcome, count in by_outcome.items():
                work.outcomes[OUTCOMES.index(outcome)] += count

    def lane_totals(self, live: Iterable[tuple[str, WorkTotals | None]]) -> dict[str, WorkTotals]:
        """Per lane, the retired totals plus those of the live workers (lane, totals)."""
        lanes: dict[str, WorkTotals] = {}
        for lane, retired in self.retired.items():
            lanes.setdefault(lane, WorkTotals()).add(retired)
        for lane, totals in live:
            if totals is not None:
                lanes.setdefault(lane, WorkTotals()).add(totals)
        return lanes

    def publish(self, view: NodeView) -> None:
        # One reference swap: the server thread sees the old view or the new one, whole.
        self.view = view


class NodeCollector(Collector):
    """prometheus-client's side: the families of the latest published view."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        view = self.metrics.view
        if view is None:
            return iter(())
        return iter(families(view, time.monotonic()))


def families(view: NodeView, now: float) -> list[Metric]:
    """Every family of :data:`FAMILY_NAMES`, in that order, from ``view``."""
    return [*_red(view), *_queue_state(view), *_health(view), *_hazards(view),
            *_sampler(view, now)]


def _red(view: NodeView) -> list[Metric]:
    claimed = CounterMetricFamily("jobd_jobs_claimed", "Jobs claimed by this node's workers.",
                                  labels=["lane", "handler"])
    completed = CounterMetricFamily(
        "jobd_jobs_completed",
        "Jobs this node's workers finished with each outcome: done, failed (retry later), "
        "dead (to the dead-letter queue), lease_lost (the lease had passed on; the result "
        "was discarded), released (given back unstarted), cancelled.",
        labels=["lane", "handler", "outcome"])
    duration = HistogramMetricFamily("jobd_job_duration_seconds",
                                     "How long handlers ran, per lane and handler.",
                                     labels=["lane", "handler"])
    pickup = HistogramMetricFamily(
        "jobd_pickup_delay_seconds",
        "How late jobs were claimed: claim time minus run_at, both on the database clock.",
        labels=["lane"])
    empty = HandlerWork()
    for lane in view.lanes:
        totals = view.work.get(lane, WorkTotals())
        for handler in _handler_labels(view, totals):
            work = totals.handlers.get(handler, empty)
            claimed.add_metric([lane, handler], work.claimed)
            for outcome in OUTCOMES:
                completed.add_metric([lane, handler, outcome], work.outcome(outcome))
            _add_histogram(duration, [lane, handler], work.duration)
        _add_histogram(pickup, [lane], totals.pickup)
    return [claimed, completed, duration, pickup]


def _handler_labels(view: NodeView, totals: WorkTotals) -> list[str]:
    # Handlers a reload removed keep their series while their counts live on.
    return [*view.handlers, *sorted(set(totals.handlers) - set(view.handlers))]


def _add_histogram(family: HistogramMetricFamily, labels: list[str],
                   histogram: Histogram) -> None:
    buckets = [(floatToGoString(bound), count) for bound, count in histogram.cumulative()]
    family.add_metric(labels, buckets, histogram.total)


def _queue_state(view: NodeView) -> list[Metric]:
    depth = GaugeMetricFamily(
        "jobd_queue_depth",
        "Live jobs per lane by state: due (claimable now), scheduled (pending, later), "
        "retrying (failed, waiting for the retry), claimed. The same for every node.",
        labels=["lane", "state"])
    oldest = GaugeMetricFamily("jobd_oldest_unclaimed_age_seconds",
                               "How long the lane's oldest due job has waited to be claimed.",
                               labels=["lane"])
    dlq = GaugeMetricFamily("jobd_dlq_depth", "Jobs in the dead-letter queue, per lane.",
                            labels=["lane"])
    slo = GaugeMetricFamily("jobd_lane_slo_pickup_seconds",
                            "The lane's pickup SLO (slo.pickup): a due job should be claimed "
                            "within this long. Only lanes that declare one.", labels=["lane"])
    for lane, seconds in sorted(view.slo_pickup.items()):
        slo.add_metric([lane], seconds)
    paused = GaugeMetricFamily(
        "jobd_lane_paused",
        "1 while a lane (handler=\"\") or one handler of it is paused (jobd lanes pause), on "
        "every node; 0 for the configured lanes that are not.", labels=["lane", "handler"])
    pauses = set(view.sample.pauses) if view.sample is not None else set()
    for lane, handler in sorted(pauses, key=lambda p: (p[0], p[1] or "")):
        paused.add_metric([lane, handler or ""], 1)
    for lane in view.lanes:
        if (lane, None) not in pauses:
            paused.add_metric([lane, ""], 0)
    lanes = view.sample.lanes if view.sample is not None else {}
    # The sample's lanes too: one with jobs that no config names has no worker anywhere.
    for lane in sorted({*view.lanes, *lanes}):
        state = lanes.get(lane)
        for name in DEPTH_STATES:
            depth.add_metric([lane, name], state.depth[name] if state else 0)
        oldest.add_metric([lane], state.oldest_unclaimed_age if state else 0.0)
        dlq.add_metric([lane], state.dead if state else 0)
    return [depth, oldest, dlq, slo, paused]


def _health(view: NodeView) -> list[Metric]:
    workers = GaugeMetricFamily("jobd_workers", "This node's worker slots per lane by state.",
                                labels=["lane", "state"])
    restarts = CounterMetricFamily(
        "jobd_worker_restarts",
        "Worker processes replaced, by why they ended: crash, timeout (no liveness report), "
        "wedged, boot_failure, exited.", labels=["lane", "reason"])
    expiries = CounterMetricFamily("jobd_lease_expiries",
                                   "Jobs this node's lease sweep took from expired leases.",
                                   labels=["lane"])
    stale = CounterMetricFamily(
        "jobd_stale_completions",
        "Outcomes this node's workers wrote after losing the lease: refused by the fence.",
        labels=["lane"])
    for lane in view.lanes:
        states = view.workers.get(lane, {})
        for state in WORKER_STATES:
            workers.add_metric([lane, state], states.get(state, 0))
        for reason in RESTART_REASONS:
            restarts.add_metric([lane, reason], view.restarts.get((lane, reason), 0))
        totals = view.work.get(lane)
        stale.add_metric([lane], totals.stale_completions if totals else 0)
    # The sweep also takes the leases of lanes no live node configures (a gone node's): those
    # lanes are not this node's, but what it swept of them counts.
    for lane in sorted(set(view.lanes) | set(view.lease_expiries)):
        expiries.add_metric([lane], view.lease_expiries.get(lane, 0))
    listener = GaugeMetricFamily("jobd_listener_connected",
                                 "1 while the LISTEN connection for wake-ups is up.",
                                 value=1 if view.listener_connected else 0)
    lag = GaugeMetricFamily(
        "jobd_supervisor_loop_lag_seconds",
        "How late the supervisor's loop ran its timers: the most over the last seconds.",
        value=view.loop_lag)
    return [workers, restarts, expiries, stale, listener, lag]


def _hazards(view: NodeView) -> list[Metric]:
    sample = view.sample

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, value=value)

    return [
        gauge("jobd_oldest_transaction_age_seconds",
              "Age of the oldest open (or prepared) transaction of the database: it holds back "
              "vacuum of the queue table.", sample.oldest_transaction_age if sample else 0.0),
        gauge("jobd_xmin_horizon_age_xids",
              "Age in transaction ids of the oldest xmin of the database's sessions, prepared "
              "transactions and replication slots.", sample.xmin_horizon_age if sample else 0),
        gauge("jobd_jobs_dead_tuples", "Dead tuples of jobd.jobs (pg_stat_user_tables).",
              sample.jobs_dead_tuples if sample else 0),
        gauge("jobd_notification_queue_usage",
              "Fraction of the NOTIFY queue in use (pg_notification_queue_usage()).",
              sample.notification_queue_usage if sample else 0.0),
    ]


def _sampler(view: NodeView, now: float) -> list[Metric]:
    sample = view.sample
    age = now - (sample.taken_at if sample else view.started)
    return [
        GaugeMetricFamily("jobd_metrics_sample_age_seconds",
                          "Age of the queue-state and database gauges (since the node started, "
                          "before the first sample).", value=max(age, 0.0)),
        GaugeMetricFamily("jobd_metrics_sample_duration_seconds",
                          "How long the last sample of those gauges took.",
                          value=sample.duration if sample else 0.0),
    ]


def handler_labels(handlers: Iterable[str]) -> tuple[str, ...]:
    """The handler label values exported from the start: the allow-list and UNLISTED."""
    return (*sorted(handlers), UNLISTED)
